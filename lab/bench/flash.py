"""FlashAttention against the baselines (notebook 05): correctness against float64, forward / backward /
end-to-end latency of every implementation on a grid of shapes (``triton.testing.do_bench``, every sample
kept), TFLOP/s, speedups, the performance goals, and the course's timing test.

Implementations are named as in ``results/flash_benchmark.csv`` (:data:`lab.bench.attention.IMPLS`):
``triton``, ``pytorch_flash`` (the tiled PyTorch FlashAttention-2), ``pytorch_naive``, ``sdpa`` (the default
backend), ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``. Inputs are ``(batch * heads, seq, d)``.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from lab.bench.attention import (
    DTYPES,
    PASSES,
    _first_line,
    _inputs,
    attention_flops,
    attention_impl,
    naive_attention_totals,
)
from lab.measure.device import empty_cache, is_oom, resolve_device
from lab.measure.timing import time_kernel
from lab.model.attention import AttentionFn, naive_attention


@dataclass(frozen=True)
class Shape:
    """One attention problem: ``batch x heads`` sequences of ``seq`` tokens, head dimension ``d``."""

    batch: int
    heads: int
    seq: int
    d: int
    causal: bool = True


#: LM-like shapes (batch x heads >= 16, 1k-16k tokens, d 64/80/128, causal and not): the goals' grid.
LM_SHAPES = (Shape(1, 16, 16384, 64), Shape(4, 32, 2048, 80), Shape(1, 32, 4096, 80, False), Shape(8, 16, 2048, 128),
             Shape(8, 16, 2048, 128, False), Shape(1, 16, 8192, 128), Shape(2, 16, 4096, 64, False))
#: The goals on those shapes, as speed ratios reference ms / triton ms (the default SDPA backend, cuDNN on Hopper).
GOALS = {"fwd": 1.0, "bwd": 0.9, "e2e": 0.95}


def errors_vs_float64(impls: dict[str, AttentionFn], batch: int = 2, seq: int = 128, d: int = 64,
                      dtype: str = "fp32", causal: bool = True, device: torch.device | str = "auto",
                      seed: int = 0) -> pd.DataFrame:
    """Largest absolute error of each implementation's output and dQ, dK, dV against
    :func:`naive_attention` computed in float64 on the same (rounded) inputs, one row per implementation
    (columns ``impl``, ``dtype``, ``out``, ``dq``, ``dk``, ``dv``; errors in float64 units)."""
    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(batch, seq, d, generator=gen).to(DTYPES[dtype]) for _ in range(4)]
    ref_in = [t.double().requires_grad_() for t in base[:3]]
    ref_out = naive_attention(*ref_in, causal)
    ref = [ref_out, *torch.autograd.grad(ref_out, ref_in, base[3].double())]
    rows = []
    for name, fn in impls.items():
        xs = [t.to(device).requires_grad_() for t in base[:3]]
        out = fn(*xs, causal)
        got = [out, *torch.autograd.grad(out, xs, base[3].to(device))]
        errs = [(g.detach().double().cpu() - r.detach()).abs().max().item() for g, r in zip(got, ref)]
        rows.append(dict(impl=name, dtype=dtype, **dict(zip(["out", "dq", "dk", "dv"], errs))))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# The flash grid (notebook 05): forward, backward, end-to-end per implementation


def measure_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 5, rep_ms: float = 20,
               cpu_warmup: int = 1, cpu_steps: int = 3) -> float:
    """Median milliseconds per call of ``fn`` (:func:`lab.measure.timing.time_kernel`: do_bench on CUDA)."""
    return time_kernel(fn, device, warmup_ms, rep_ms, cpu_warmup, cpu_steps).median_ms


def _measure_flash(fn: AttentionFn, bh, seq, d, dtype, causal, device, timer_kwargs, row) -> None:
    q, k, v, dout = _inputs(bh, seq, d, DTYPES[dtype], device)
    row["phase"] = "forward"
    row["fwd_ms"] = measure_ms(lambda: fn(q, k, v, causal), device, **timer_kwargs)
    row["phase"] = "backward"
    out = fn(q, k, v, causal)
    row["bwd_ms"] = measure_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device,
                               **timer_kwargs)
    out = None  # free the retained graph (held through the lambda's closure) before end-to-end builds its own
    row["phase"] = "end-to-end"
    row["e2e_ms"] = measure_ms(lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout), device,
                               **timer_kwargs)


def grid_shapes(seqs: Sequence[int], ds: Sequence[int], batch: int = 1, heads: int = 1,
                causal: bool = True) -> list[Shape]:
    """Every ``seq x d`` at one batch, heads and causality (05's length sweep)."""
    return [Shape(batch, heads, s, d, causal) for d in ds for s in seqs]


def run_flash_grid(impls: Sequence[str] | dict[str, AttentionFn] = ("triton", "pytorch_naive", "sdpa"),
                   shapes: Sequence[Shape] = LM_SHAPES, dtypes: Sequence[str] = ("bf16",),
                   warmup_ms: float = 5, rep_ms: float = 20, cpu_steps: int = 3,
                   device: torch.device | str = "auto", memory_limit_gib: float | None = None,
                   skip: Callable[[str, Shape, str], str | None] | None = None,
                   progress: bool = True) -> pd.DataFrame:
    """Forward, backward and end-to-end (forward+backward) latency of each attention implementation on each
    shape and dtype.

    ``impls`` are names for :func:`attention_impl` or a dict ``name -> fn(q, k, v, causal)``. Inputs are
    ``(batch*heads, seq, d)``. Timing is :func:`measure_ms` (medians); backward reuses one forward's graph.
    ``pytorch_naive`` configurations whose predicted peak exceeds ``memory_limit_gib`` (default: 1.25x the
    GPU's memory) are not attempted and recorded as ``status="oom"``; ``skip(impl, shape, dtype)`` may
    return a reason not to run a configuration (``status="skipped"``, e.g. the tiled PyTorch version at long
    sequences, where its Python loop would take minutes); every out-of-memory is caught and recorded with the
    pass it hit. Returns one row per (impl, dtype, shape) with ``fwd_ms``, ``bwd_ms``, ``e2e_ms``,
    ``*_tflops`` (FLOPs from :func:`attention_flops`), ``status`` and ``note``.
    """
    from tqdm import tqdm

    device = resolve_device(device) if isinstance(device, str) else device
    fns = dict(impls) if isinstance(impls, dict) else {name: attention_impl(name, device) for name in impls}
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; choose one of {', '.join(DTYPES)}")
    if memory_limit_gib is None and device.type == "cuda":
        memory_limit_gib = 1.25 * torch.cuda.get_device_properties(device).total_memory / 2**30
    timer_kwargs = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps)
    grid = [(dt, shape, name) for dt in dtypes for shape in shapes for name in fns]
    rows = []
    for dt, sh, name in tqdm(grid, desc="attention", disable=not progress):
        bh = sh.batch * sh.heads
        row = dict(impl=name, dtype=dt, batch=sh.batch, heads=sh.heads, seq_len=sh.seq, d=sh.d, causal=sh.causal,
                   fwd_ms=math.nan, bwd_ms=math.nan, e2e_ms=math.nan, status="ok", note="")
        need = naive_attention_totals(bh, sh.seq, sh.d, dt, sh.causal)["peak"] / 2**30
        reason = skip(name, sh, dt) if skip else None
        if reason:
            row.update(status="skipped", note=reason)
        elif name == "pytorch_naive" and memory_limit_gib is not None and need > memory_limit_gib:
            row.update(status="oom", note=f"not attempted: needs >= {need:.0f} GiB (predicted) "
                                           f"> {memory_limit_gib:.0f} GiB")
        else:
            empty_cache()
            try:
                _measure_flash(fns[name], bh, sh.seq, sh.d, dt, sh.causal, device, timer_kwargs, row)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                row.update(status="oom", note=f"out of memory in {row.get('phase')}: {_first_line(exc)}")
            row.pop("phase", None)
            gc.collect()
            empty_cache()
        rows.append(row)
    return add_tflops(pd.DataFrame(rows))


def add_tflops(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``fwd_tflops``, ``bwd_tflops``, ``e2e_tflops``: :func:`attention_flops` / time, in TFLOP/s."""
    df = df.copy()
    for p in PASSES:
        flops = [attention_flops(r.batch, r.seq_len, r.d, bool(r.causal), p, heads=r.heads)
                 for r in df.itertuples()]
        df[f"{p}_tflops"] = np.asarray(flops, dtype=float) / (df[f"{p}_ms"].to_numpy(dtype=float) * 1e-3) / 1e12
    return df


CONFIG_KEY = ["dtype", "batch", "heads", "seq_len", "d", "causal"]


def add_speedups(df: pd.DataFrame, baselines: Sequence[str] = ("pytorch_naive", "sdpa")) -> pd.DataFrame:
    """Add ``{pass}_speedup_vs_{baseline}`` = baseline ms / this row's ms for the same configuration
    (> 1: this implementation is faster). NaN where either side has no time (e.g. out of memory)."""
    df = df.copy()
    for base in baselines:
        ref = df[df["impl"] == base].set_index(CONFIG_KEY)[[f"{p}_ms" for p in PASSES]].add_suffix("_ref")
        joined = df.join(ref, on=CONFIG_KEY)
        for p in PASSES:
            df[f"{p}_speedup_vs_{base}"] = (joined[f"{p}_ms_ref"] / joined[f"{p}_ms"]).to_numpy()
    return df


def flash_goals(df: pd.DataFrame, impl: str = "triton", reference: str = "sdpa",
                dtypes: Sequence[str] = ("bf16", "fp16"),
                min_heads: int = 16, goals: dict[str, float] = GOALS) -> pd.DataFrame:
    """Per qualifying configuration (``dtype`` in ``dtypes``, batch x heads >= ``min_heads``; both ``impl``
    and ``reference`` measured): the speed ratios ``reference_ms / impl_ms`` for fwd, bwd, e2e and whether
    each meets its goal (``fwd_ok`` etc.). Empty when no configuration qualifies (e.g. the CPU quick book)."""
    sel = df[(df["dtype"].isin(dtypes)) & (df["batch"] * df["heads"] >= min_heads)]
    mine = sel[(sel["impl"] == impl) & (sel["status"] == "ok")].set_index(CONFIG_KEY)
    ref = sel[(sel["impl"] == reference) & (sel["status"] == "ok")].set_index(CONFIG_KEY)
    both = mine.index.intersection(ref.index)
    out = pd.DataFrame(index=both)
    for p, target in goals.items():
        out[f"{p}_ratio"] = ref.loc[both, f"{p}_ms"] / mine.loc[both, f"{p}_ms"]
        out[f"{p}_ok"] = out[f"{p}_ratio"] >= target
    return out.reset_index()


def summarize_goals(goals_table: pd.DataFrame, goals: dict[str, float] = GOALS) -> dict:
    """For each pass: configurations checked, how many meet the goal, and the worst ratio (or NaN)."""
    summary = {"configs": len(goals_table)}
    for p, target in goals.items():
        col = goals_table.get(f"{p}_ratio", pd.Series(dtype=float))
        summary[p] = dict(target=target, met=int((col >= target).sum()),
                          worst=float(col.min()) if len(col) else math.nan)
    summary["all_met"] = bool(len(goals_table)) and all(summary[p]["met"] == len(goals_table) for p in goals)
    return summary


def course_timing_test(compile: bool = True, batch: int = 16, seq: int = 16384, d: int = 64,
                       device: torch.device | str = "cuda", rep_ms: float = 200) -> dict:
    """The course's FlashAttention timing: ``FlashAttentionTriton.apply`` (under ``torch.compile`` when
    ``compile``) on q, k, v of shape (batch, seq, d) in bf16, causal; forward, ``o.sum()``, backward, timed
    as one call with ``triton.testing.do_bench``. Returns ``ms`` (median), ``std_ms`` and the shape."""
    from lab.kernels.flash_triton import FlashAttentionTriton

    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, seq, d, generator=gen).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
    fn = torch.compile(FlashAttentionTriton.apply) if compile else FlashAttentionTriton.apply

    def step():
        o = fn(q, k, v, True)
        o.sum().backward()

    timing = time_kernel(step, device, warmup_ms=25, rep_ms=rep_ms)
    return dict(test="course flash timing", compiled=compile, batch=batch, seq_len=seq, d=d, dtype="bf16",
                causal=True, ms=timing.median_ms, std_ms=timing.std_ms)
