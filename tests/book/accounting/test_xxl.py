"""lab.book.accounting.xxl: the 09 notebook's XXL questions, equations and sentences, from the tables of
lab.book.accounting.bench."""

import matplotlib

matplotlib.use("Agg")

from lab.book.accounting import bench as ba  # noqa: E402
from lab.book.accounting import xxl as xb  # noqa: E402
from tests.book.prose import in_order, numbers, sentence_with  # noqa: E402


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
    assert in_order(text, [219.8, 879, 879, 1759, 3.52, 44])  # parameters (B); params, grads, AdamW (GB); TB; H100s
    assert in_order(text, [17.5, 35.9, 2048, 45])  # MB per token, GB for 2,048 tokens, H100s in all
    assert in_order(sentence_with(text, "SwiGLU"), [5.28, 66])
    assert numbers(xb.xxl_answer(xxl))[:2] == [3.52, 44]
    shown = xb.xxl_display(xxl)
    assert shown.columns.tolist() == ["quantity", "2 matrices (the question)", "SwiGLU (3 matrices)"]
    assert [q for q in shown["quantity"] if "bf16" in q and "(GB)" in q and "2,048" in q]  # the tokens' row, in GB


def test_fsdp_sentence():
    fsdp = ba.xxl_fsdp_table([0, 1, 2048, 8192])
    text = xb.fsdp_sentence(fsdp)
    # state only: 3,517.6 GB / 95 GB = 37.03 -> 38; with 2048 tokens (35.9 GB): (3517.6 + 18.0) / (95 - 18.0) -> 46
    assert in_order(text, [38, 1, 38, 2048, 46])  # state alone; per token count, the N that fits
    assert in_order(text[text.index("8,192"):], [8192, 237]) and "none fits" in text  # SwiGLU: nothing fits
    assert in_order(xb.fsdp_answer(fsdp, 2048), [38, 46, 2048, 95])
    shown = xb.fsdp_display(fsdp)
    assert shown["devices_needed"].tolist()[-1] == "none fits" and shown["tokens"].tolist()[2] == "2,048"


def test_tpu_and_tricks_sentences():
    tpu = ba.tpu_batch_table(**ba.TPU_MESH)
    text = xb.tpu_sentence(tpu, ba.TPU_MESH)
    # C / (W_ici M_X) = 4.6e14 / 3.6e11 = 1,277.8 tokens per FSDP shard; x X = 16 -> 20,444
    assert in_order(text, [1278, 319, 64, 20444, 19167])  # per shard, per chip, chips; overall, exact ring
    # TP: compute / comm = F M_Y W_ici / (Y C) = 53248 x 1.8e11 / (4 x 4.6e14) = 5.21 for two matrices
    assert in_order(sentence_with(text, "compute bound"), [5.2, 21])
    assert numbers(xb.tpu_answer(tpu)) == [1278, 319, 20444]
    tricks = ba.tpu_tricks_table()
    assert in_order(xb.tricks_sentence(tricks), [20444, 5111])
    assert xb.tricks_display(tricks)["condition"].str.startswith("$").all()
    answer = xb.tricks_answer(tricks)
    helps, excluded = answer.split(";")  # the tricks with the batch each needs, then the one that does not help
    assert numbers(helps) == [5111, 13630, 10222] and "gradient accumulation" not in helps
    assert "gradient accumulation" in excluded and "not" in excluded and not numbers(excluded)
