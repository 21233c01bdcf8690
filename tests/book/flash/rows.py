"""Synthetic grid rows for notebook 05's tests: each pass a median, a spread and a count, as measured rows have."""

import math

import pandas as pd

from lab.bench.attention_grid import Shape, add_tflops

GPU = "NVIDIA H100 80GB HBM3"


def grid_row(impl, shape: Shape, dtype="bf16", ms=1.0, spread=0.01, n=50, sweep="lm", status="ok", timing="eager",
             gpu=GPU, factors=(1.0, 2.0, 3.0), **extra):
    """A row of ``flash_benchmark``: forward ``ms``, backward and forward + backward ``factors`` times it, each with a
    relative ``spread`` and ``n`` samples."""
    ours = "triton" if impl == "triton" else ""
    row = dict(sweep=sweep, impl=impl, kernel=ours, bwd_kernel=ours, dtype=dtype, batch=shape.batch,
               heads=shape.heads, seq_len=shape.seq, d=shape.d, causal=shape.causal, gpu=gpu, timing=timing,
               status=status, note="")
    for p, factor in zip(("fwd", "bwd", "e2e"), factors):
        t = ms * factor if status == "ok" else math.nan
        row.update({f"{p}_ms": t, f"{p}_spread_ms": spread * t, f"{p}_n": n if status == "ok" else 0})
    return {**row, **extra}


def table(*rows) -> pd.DataFrame:
    return add_tflops(pd.DataFrame(rows))
