"""How the compiled FlashAttention kernels wait for their matrix products (notebook 05): the kernels the tile
tables launch for a long causal bf16 sequence, compiled for Hopper (``sm_90a``) on any machine
(:mod:`lab.kernels.flash_sm90`), and read from their PTX (:func:`lab.kernels.sm90_compile.product_waits`).

A warp group's matrix product (``wgmma``) runs asynchronously until the code waits for it. A product waited
for before anything else is issued leaves its warp group idle meanwhile: the tile's exponentials never run
under a product. FlashAttention-3 overlaps them on purpose; this table says whether our compiled code does.
Triton's Hopper pipeliner leaves a product in flight only where that is safe by its rules: a register
operand not computed inside the loop, and a result read inside the loop only by later products (as their
accumulator) or under an ``if``. The forward's scores feed the softmax and its probabilities are computed
in the loop, so both of its products are waited for at once, whatever order the source issues them in.
"""

from __future__ import annotations

import pandas as pd

from lab.book.report import fmt

#: Kernels of variants the Triton kernels no longer carry, which a table read back from ``results/`` may hold
#: besides the tables' own (never compiled here): the forward with the next key tile's scores issued before
#: this tile's softmax, and the backward's dK/dV pass with atomic dQ (5 products per tile pair, each query
#: tile's dQ share added by a TMA bulk reduction). The sentence says what they measured.
OVERLAP_KERNEL = "forward, next scores first"
ATOMIC_KERNEL = "backward dK/dV, atomic dQ"


def product_wait_table(head_dims=(64, 128), causal: bool = True, n: int = 4096, batch_heads: int = 64) -> pd.DataFrame:
    """One row per kernel the tables launch at each head dimension in ``head_dims`` (forward, backward passes):
    tiles, ``products`` (the ``tl.dot`` sites of the compiled code, each loop body counted once),
    ``waited_at_once``, ``in_flight`` (the others), registers and spilled bytes a thread, shared memory (KiB).
    Empty, with a ``note``, where this Triton cannot compile for sm_90a."""
    from lab.kernels.flash_sm90 import compile_in_subprocess  # optional dependency (Triton)

    jobs = [["default", dict(d=d, causal=causal, n=n, batch_heads=batch_heads)] for d in head_dims]
    try:
        defaults = compile_in_subprocess(jobs)
    except (FileNotFoundError, RuntimeError) as exc:
        return pd.DataFrame({"note": [str(exc).splitlines()[-1]]})
    df = pd.DataFrame([row for rows in defaults for row in rows])
    df["in_flight"] = df["products"] - df["waited_at_once"]
    df["shared_kib"] = df["shared"] / 1024
    return df[["kernel", "d", "tiles", "products", "waited_at_once", "in_flight", "registers", "spill",
               "shared_kib"]]


def _counts(rows: pd.DataFrame) -> str:
    return " and ".join(f"{int(r.waited_at_once)} of {int(r.products)} at d {int(r.d)}" for r in rows.itertuples())


def product_wait_sentence(table: pd.DataFrame) -> str:
    """What the table says: which kernels wait for every product at once, which keep some in flight, and what
    that means for the softmax."""
    if "products" not in table or table["products"].isna().all():  # only a note (read back: NaN columns too)
        note = table["note"].iloc[0] if "note" in table and len(table) else "no kernel compiled"
        return f"The kernels could not be compiled for sm_90a here ({note})."
    plain = table[~table["kernel"].isin([OVERLAP_KERNEL, ATOMIC_KERNEL])]
    parts = [f"{kernel} {_counts(rows)}" for kernel, rows in plain.groupby("kernel", sort=False)]
    text = ("Compiled for sm_90a, the kernels the tables launch for a long causal bf16 sequence wait at once "
            "(before any other product or exponential is issued) for these of their matrix products: "
            + "; ".join(parts) + ".")
    forward = plain[plain["kernel"] == "forward"]
    if len(forward) and (forward["in_flight"] == 0).all():
        text += (" So a warp group of the forward issues no matrix product while it computes a tile's "
                 "exponentials; only the SM's other warp groups can use the tensor cores meanwhile. "
                 "FlashAttention-3 overlaps a tile's softmax with the next tile's products within a warp group.")
    overlap = table[table["kernel"] == OVERLAP_KERNEL]
    if len(overlap):
        r = overlap.iloc[0]
        verdict = ("waits for all of them at once all the same" if r["in_flight"] == 0
                   else f"keeps {int(r['in_flight'])} in flight")
        text += (f" Issuing the next key tile's scores before this tile's softmax ({r['tiles']} "
                 f"tiles at d {int(r['d'])}) gives {int(r['products'])} products, and the compiled code "
                 f"{verdict}, with {int(r['registers'])} registers a thread and {fmt(r['shared_kib'], 3)} KiB "
                 "of shared memory")
        text += (": the overlap needs control of when a product is waited for, which `tl.dot` does not give."
                 if r["in_flight"] == 0 else ".")
    return text + _atomic_clause(table)


def _atomic_clause(table: pd.DataFrame) -> str:
    """The atomic-dQ dK/dV pass beside the table's own dK/dV pass at the same head dimension and tiles: its
    products, spilled bytes and shared memory (what the 2 products it saves cost elsewhere)."""
    atomic = table[table["kernel"] == ATOMIC_KERNEL]
    if atomic.empty:
        return ""
    a = atomic.iloc[0]
    own = table[(table["kernel"] == "backward dK/dV") & (table["d"] == a["d"]) & (table["tiles"] == a["tiles"])]
    text = (f" With atomic dQ (5 products per tile pair) the dK/dV pass at d {int(a['d'])} ({a['tiles']} tiles) "
            f"issues {int(a['products'])} products, waits for {int(a['waited_at_once'])} of them at once, spills "
            f"{int(a['spill'])} bytes a thread and needs {fmt(a['shared_kib'], 3)} KiB of shared memory")
    if len(own):
        o = own.iloc[0]
        text += (f", against {int(o['products'])} products, {int(o['spill'])} bytes and {fmt(o['shared_kib'], 3)} "
                 "KiB without it (where the dQ pass computes the other two products)")
    return text + "."
