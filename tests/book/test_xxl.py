"""lab.book.xxl: the 09 notebook's XXL questions, equations and sentences, from the tables of
lab.bench.accounting."""

import matplotlib

matplotlib.use("Agg")

from lab.bench import accounting as ba  # noqa: E402
from lab.book import xxl as xb  # noqa: E402


def test_xxl_equations_are_latex_of_the_closed_forms():
    p, saved, m = xb.show_xxl_equations(2)
    assert p.endswith("= 2 D F L") and saved.endswith("= D + F") and "M_{state}" in m
    assert xb.show_xxl_equations(3)[1].endswith("= D + 4 F")
    tpu = xb.show_tpu_equations(2)
    assert tpu[3] == r"B_{\min} = \frac{C X}{M_{X} W_{ici}}"


def test_xxl_sentences_answer_the_question_as_posed():
    xxl = ba.xxl_table(2048)
    text = xb.xxl_sentence(xxl)
    # 2 x 16384 x 53248 x 126 = 219.8 B parameters x 16 B = 3,517.6 GB = 44 H100s; (D + F) x 2 B x 126 per token
    assert "has 219.8 B parameters" in text and "(879 + 879 + 1,759 GB) take **3.52 TB**" in text
    assert "**44 H100s**" in text and "**17.5 MB per token**: 35.9 GB for 2,048 tokens (45 H100s in all)" in text
    assert "With SwiGLU's three matrices the state is 5.28 TB (66 H100s)" in text
    assert xb.xxl_answer(xxl).startswith("3.52 TB of fp32 state (44 H100s)")
    shown = xb.xxl_display(xxl)
    assert shown.columns.tolist() == ["quantity", "2 matrices (the question)", "SwiGLU (3 matrices)"]
    assert "bf16 saved activations of the tokens (GB), 2,048 tokens" in shown["quantity"].tolist()


def test_fsdp_sentence():
    fsdp = ba.xxl_fsdp_table([0, 1, 2048, 8192])
    text = xb.fsdp_sentence(fsdp)
    # state only: 3,517.6 GB / 95 GB = 37.03 -> 38; with 2048 tokens (35.9 GB): (3517.6 + 18.0) / (95 - 18.0) -> 46
    assert text.startswith("With the question's two matrices, the state alone needs **N = 38**")
    assert "1 token: N = 38" in text and "2,048 tokens: N = 46" in text
    assert "8,192 tokens: none fits (the unsharded half alone is 237 GB)" in text  # SwiGLU
    assert xb.fsdp_answer(fsdp, 2048).endswith("N = 38 for the state alone, N = 46 with 2,048 tokens of "
                                               "activations (95 GB TPU v5p).")
    shown = xb.fsdp_display(fsdp)
    assert shown["devices_needed"].tolist()[-1] == "none fits" and shown["tokens"].tolist()[2] == "2,048"


def test_tpu_and_tricks_sentences():
    tpu = ba.tpu_batch_table(**ba.TPU_MESH)
    text = xb.tpu_sentence(tpu, ba.TPU_MESH)
    # C / (W_ici M_X) = 4.6e14 / 3.6e11 = 1,277.8 tokens per FSDP shard; x X = 16 -> 20,444
    assert "**B/X ≥ 1,278 tokens**" in text and "319 tokens per chip over all X·Y = 64 chips" in text
    assert "**B ≥ 20,444 tokens**" in text and "exact ring factor it is 19,167 tokens" in text
    # TP: compute / comm = F M_Y W_ici / (Y C) = 53248 x 1.8e11 / (4 x 4.6e14) = 5.21 for two matrices
    assert "compute bound by a factor 5.2 (up to Y = 21)" in text
    assert xb.tpu_answer(tpu) == "per device (FSDP shard) B/X ≥ 1,278 tokens (319 per chip); overall B ≥ 20,444 tokens."
    tricks = ba.tpu_tricks_table()
    assert "from 20,444 to 5,111 tokens" in xb.tricks_sentence(tricks)
    assert xb.tricks_display(tricks)["condition"].str.startswith("$").all()
    assert "not gradient accumulation" in xb.tricks_answer(tricks)
