"""lab.book.accounting.xxl: the 09 notebook's XXL questions as equations, displays and claims, from the tables of
lab.accounting.xxl (checked by their numbers, never their wording)."""

import matplotlib
import pytest

import lab.accounting as acc
from lab.book import claims as cl
from lab.book.accounting import xxl as xb

matplotlib.use("Agg")


def values(claim) -> list[float]:
    return [f.measured.median for f in claim.findings if isinstance(f, cl.Value)]


def test_xxl_equations_are_latex_of_the_closed_forms():
    p, saved, m = xb.show_xxl_equations(2)
    assert p.endswith("= 2 D F L") and saved.endswith("= D + F") and "M_{state}" in m
    assert xb.show_xxl_equations(3)[1].endswith("= D + 4 F")
    tpu = xb.show_tpu_equations(2)
    assert tpu[3] == r"B_{\min} = \frac{C X}{M_{X} W_{ici}}"


def test_xxl_claim_answers_the_question_as_posed():
    xxl = acc.xxl_table(2048)
    # 2 x 16384 x 53248 x 126 = 219.8 B parameters x 16 B = 3,517.6 GB = 44 H100s; (D + F) x 2 B x 126 per token
    # = 17.5 MB, 35.9 GB for 2,048 tokens, 45 H100s in all; SwiGLU: 5.28 TB and (D + 4F) x 2 B x 126 per token
    assert values(xb.xxl_claim(xxl)) == pytest.approx([219.8486, 3.5176, 44, 17.5473, 35.9368, 45, 5.2764, 57.7975],
                                                      rel=1e-4)
    shown = xb.xxl_display(xxl)
    assert shown.columns.tolist() == ["quantity", "2 matrices (the question)", "SwiGLU (3 matrices)"]


def test_fsdp_claim():
    fsdp = acc.xxl_fsdp_table([0, 1, 2048, 8192])
    claim = xb.fsdp_claim(fsdp)
    # state only: 3,517.6 GB / 95 GB = 37.03 -> 38; with 2048 tokens (35.9 GB): (3517.6 + 18.0) / (95 - 18.0) -> 46
    assert values(claim) == [38, 38, 46, 156, 56, 56, 149]
    assert [f.label for f in claim.findings if isinstance(f, cl.Observed)] == ["SwiGLU, 8,192 tokens"]  # none fits
    assert "1 token:" in cl.sentence(claim)  # one token, not "1 tokens"
    assert xb.fsdp_display(fsdp)["devices_needed"].tolist()[-1] == "none fits"


def test_tpu_and_tricks_claims():
    tpu = acc.tpu_batch_table(**acc.TPU_MESH)
    # C / (W_ici M_X) = 4.6e14 / 3.6e11 = 1,277.8 tokens per FSDP shard; x X = 16 -> 20,444; exact ring x 15/16;
    # TP: compute / comm = F M_Y W_ici / (Y C) = 5.21 for two matrices, up to Y = 20.8
    base = 4.6e14 / 3.6e11
    assert values(xb.tpu_claim(tpu, acc.TPU_MESH))[:6] == pytest.approx(
        [base, base / 4, 16 * base, 15 * base, 53248 * 1.8e11 / (4 * 4.6e14), 53248 * 1.8e11 / 4.6e14])
    tricks = acc.tpu_tricks_table()
    claim = xb.tricks_claim(tricks)
    assert values(claim) == pytest.approx([16 * base, 4 * base, 16 * 4.6e14 / 5.4e11, 8 * base, 16 * base])
    assert "pipeline" not in " ".join(f.measured.label for f in claim.findings)  # no batch bound: not a number
