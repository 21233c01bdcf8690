"""The product-wait table's sentence, read from synthetic tables (the table itself: tests/kernels/
test_flash_sm90_compile.py, which compiles the kernels). The tables hold the rows of two variants the kernels no
longer carry, as a table read back from ``results/`` does."""

import pandas as pd

from lab.book.flash import schedule


def table(forward_in_flight=0, overlap_in_flight=0):
    rows = [("forward", 64, "128x64x8x3", 4, 4 - forward_in_flight), ("backward dK/dV", 64, "64x64x64x64x4x3", 8, 6),
            ("backward dQ", 64, "64x64x64x64x4x3", 6, 6), ("forward", 128, "64x64x4x3", 4, 4),
            ("backward dK/dV", 128, "64x128x128x64x8x3", 8, 6), ("backward dQ", 128, "64x128x128x64x8x3", 6, 6),
            (schedule.OVERLAP_KERNEL, 128, "128x64x8x3", 6, 6 - overlap_in_flight),
            (schedule.ATOMIC_KERNEL, 128, "64x128x128x64x8x3", 10, 6)]
    df = pd.DataFrame(rows, columns=["kernel", "d", "tiles", "products", "waited_at_once"])
    df = df.assign(in_flight=df["products"] - df["waited_at_once"], registers=200, spill=0, shared_kib=144.0)
    df.loc[df["kernel"] == schedule.ATOMIC_KERNEL, ["spill", "shared_kib"]] = [48, 209.0]
    return df


def test_sentence_counts_each_kernel_per_head_dim():
    text = schedule.product_wait_sentence(table())
    assert "forward 4 of 4 at d 64 and 4 of 4 at d 128" in text
    assert "backward dK/dV 6 of 8 at d 64 and 6 of 8 at d 128" in text
    assert "backward dQ 6 of 6 at d 64" in text
    assert "issues no matrix product while it computes" in text  # every forward product waited at once
    assert "gives 6 products" in text and "waits for all of them at once" in text and "144 KiB" in text


def test_sentence_follows_the_numbers_when_products_stay_in_flight():
    text = schedule.product_wait_sentence(table(forward_in_flight=2, overlap_in_flight=3))
    assert "forward 2 of 4 at d 64" in text
    assert "issues no matrix product" not in text
    assert "keeps 3 in flight" in text and "does not give" not in text


def test_no_compiler_is_said_not_guessed():
    text = schedule.product_wait_sentence(pd.DataFrame({"note": ["no ptxas"]}))
    assert text == "The kernels could not be compiled for sm_90a here (no ptxas)."


def test_a_note_read_back_is_still_a_note():
    """Saved and read back, a note-only table has every column of a compiled one, empty: still no counts."""
    columns = ["kernel", "d", "tiles", "products", "waited_at_once", "in_flight", "registers", "spill", "shared_kib"]
    back = pd.DataFrame({**{c: [float("nan")] for c in columns}, "note": ["ptxas exited 255"]})
    text = schedule.product_wait_sentence(back)
    assert text == "The kernels could not be compiled for sm_90a here (ptxas exited 255)."


def test_sentence_sets_the_atomic_dq_pass_beside_the_tables_own():
    text = schedule.product_wait_sentence(table())
    clause = text[text.index("With atomic dQ"):]
    assert "issues 10 products, waits for 6 of them at once, spills 48 bytes" in clause and "209 KiB" in clause
    assert "against 8 products, 0 bytes and 144 KiB without it" in clause
    assert "backward dK/dV, atomic dQ" not in text[:text.index("With atomic dQ")]  # not counted with the plain ones
