"""Notebook 05's measurements: the grid of shapes and its two sweeps (:mod:`lab.bench.attention_grid` does the
timing), the course's timing test, the matmul ceiling, and how the compiled kernels wait for their products."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd

from lab.accounting.attention import DTYPES
from lab.bench.attention_grid import GRAPH_MAX_SEQ, SHAPE_2_7B, Shape, time_attention_grid
from lab.measure.timing import matmul_tflops

__all__ = ["COURSE_GOAL_MS", "GRAPH_MAX_SEQ", "LM_SHAPES", "SHAPE_2_7B", "matmul_ceilings", "run_flash_benchmark",
           "skip_pytorch_flash"]

#: LM-like shapes (batch x heads >= 16, 1k-16k tokens, d 64/80/128, causal and not), the leaderboard model's
#: attention (32 heads of 128 over 32k tokens) and the 2.7B model's (4 x 32 heads of 80 over 512 tokens).
LM_SHAPES = (Shape(1, 16, 16384, 64), Shape(4, 32, 2048, 80), Shape(1, 32, 4096, 80, False), Shape(8, 16, 2048, 128),
             Shape(8, 16, 2048, 128, False), Shape(1, 16, 8192, 128), Shape(2, 16, 4096, 64, False),
             Shape(1, 32, 32768, 128), SHAPE_2_7B)
#: The course's timing test (16 x 16384 x 64, bf16, causal, forward + backward) should take at most this on an H100.
COURSE_GOAL_MS = 4.6


def skip_pytorch_flash(max_seq: int = 2048, dtypes: Sequence[str] | None = None,
                       impl: str = "pytorch_flash") -> Callable[[str, Shape, str], str | None]:
    """A ``skip`` rule for the grid: the tiled PyTorch FlashAttention-2 walks its tiles in a Python loop
    (``(seq / 64)^2`` tile pairs, each a dozen small kernels), so beyond ``max_seq`` tokens one configuration
    would take minutes; it also runs only in ``dtypes`` (None: all; its time barely depends on the dtype)."""

    def skip(name: str, shape: Shape, dtype: str) -> str | None:
        if name != impl:
            return None
        if shape.seq > max_seq:
            return "not run on this length: its Python tile loop is too slow"
        if dtypes is not None and dtype not in dtypes:
            return "not run in this dtype: its tile loop's time barely depends on it"
        return None

    return skip


def run_flash_benchmark(sweeps: dict[str, dict], **common) -> pd.DataFrame:
    """:func:`lab.bench.attention_grid.time_attention_grid` once per named sweep (``{"lm": dict(impls=...,
    shapes=..., dtypes=...), ...}``, each dict's keywords over ``common``'s), rows labelled by ``sweep``."""
    return pd.concat([time_attention_grid(**{**common, **kw, "sweep": name}) for name, kw in sweeps.items()],
                     ignore_index=True)


def matmul_ceilings(dtypes: Sequence[str], n: int, device) -> pd.DataFrame:
    """The tensor-core rate a kernel's matrix products can hope for: one ``n x n x n`` ``torch.mm`` per dtype
    (:func:`lab.measure.timing.matmul_tflops`); columns ``dtype``, ``n``, ``tflops``."""
    return pd.DataFrame([dict(dtype=dt, n=n, tflops=matmul_tflops(DTYPES[dt], n, device)) for dt in dtypes])
