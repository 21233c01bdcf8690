"""Attention benchmarks: the naive PyTorch baseline, torch.compile, and FlashAttention against SDPA.

What lives here, for notebooks 04 and 05:

* the implementations compared, by the names of the tables (:func:`attention_impl`);
* the naive grid: forward and backward passes timed separately, memory in use before backward, what autograd
  saved, OOM as rows;
* tables built from those rows: eager vs compiled (with noise-aware verdicts), the power law of the saved
  memory, the configuration to account for; and the whole model eager against compiled, size by size
  (``lm_step`` rows, notebook 04).

The closed forms (FLOPs, naive attention's memory, FlashAttention's saved bytes, the power-law fit) live in
:mod:`lab.accounting.attention`, what autograd really saves in :func:`lab.measure.saved_tensors.saved_tensor_bytes`;
the FlashAttention grid and its goals in :mod:`lab.book.flash.bench`.

Attention functions here take ``fn(q, k, v, causal)`` on ``(batch, seq, d)`` tensors (heads folded into
the batch), the interface of ``FlashAttentionTriton.apply``.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence

import pandas as pd
import torch
import torch._functorch.config  # not imported by ``import torch``; run_naive_grid patches it

from lab.accounting.attention import DTYPES, fit_power_law, naive_attention_totals
from lab.bench.attention import attention_impl, attention_inputs  # noqa: F401 - the notebooks' names
from lab.bench.lm import compare_variants
from lab.bench.progress import progress_bar
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device, synchronize
from lab.measure.results import gpu_label
from lab.measure.saved_tensors import saved_tensor_bytes
from lab.measure.timing import time_callable
from lab.measure.verdicts import compare_summaries
from lab.model.attention import AttentionFn, naive_attention
from lab.units import GiB, MiB

# ----------------------------------------------------------------------------------------------------------
# The naive grid (notebook 04): forward and backward passes timed separately, memory before backward


def _measure_naive(fn: AttentionFn, batch, seq, d, dtype, causal, passes, warmup, device, row) -> None:
    torch_dtype = DTYPES[dtype]
    if device.type == "cuda":
        # cuBLAS takes its workspace from PyTorch's allocator on first use: create it before the baseline
        # so that it is not charged to this configuration
        torch.ones(8, 8, device=device, dtype=torch_dtype) @ torch.ones(8, 8, device=device, dtype=torch_dtype)
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        row["mem_baseline_mib"] = torch.cuda.memory_allocated(device) / MiB
    q, k, v, dout = attention_inputs(batch, seq, d, torch_dtype, device)
    row["phase"] = "forward"
    fwd = time_callable(lambda: fn(q, k, v, causal), warmup, passes, device)
    row.update(fwd_ms=fwd.mean_ms, fwd_std_ms=fwd.std_ms)
    # one forward whose graph the backward passes reuse (retain_graph), measured before backward starts
    synchronize(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else math.nan
    out = fn(q, k, v, causal)
    synchronize(device)
    if device.type == "cuda":
        row["mem_before_bwd_mib"] = torch.cuda.memory_allocated(device) / MiB
        row["forward_left_mib"] = (torch.cuda.memory_allocated(device) - base) / MiB
    row["phase"] = "backward"
    bwd = time_callable(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup, passes,
                        device)
    row.update(bwd_ms=bwd.mean_ms, bwd_std_ms=bwd.std_ms, phase="saved-tensor count")
    if device.type == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / MiB
    out = None  # the lambda above holds the graph through this name: drop it
    # what autograd keeps, counted tensor by tensor (device independent), once per configuration
    row["saved_mib"] = saved_tensor_bytes(lambda a, b, c: fn(a, b, c, causal), q, k, v) / MiB


def run_naive_grid(fn: AttentionFn = naive_attention, ds: Sequence[int] = (16, 32, 64, 128),
                   seqs: Sequence[int] = (256, 1024, 4096, 8192, 16384), batch: int = 8, dtype: str = "fp32",
                   causal: bool = False, passes: int = 100, warmup: int = 5, compile: bool | Sequence[bool] = False,
                   impl: str | None = None, device: torch.device | str = "auto",
                   progress: bool = True) -> pd.DataFrame:
    """Time ``passes`` forward and ``passes`` backward passes of ``fn`` for every ``d x seq``.

    Each configuration gets fresh ``(batch, seq, d)`` inputs. Forward passes run with gradients enabled (as
    in training) and each one's graph is dropped; then one forward is kept, the memory in use is read
    (``torch.cuda.memory_allocated``), and ``passes`` backward passes reuse its graph
    (``retain_graph=True``). With ``compile=True`` the function is compiled afresh per shape
    (``torch.compile(dynamic=False)`` after ``torch._dynamo.reset()``), and ``compile_s`` is the time of the
    first forward+backward (compilation included). ``compile=(False, True)`` measures each configuration
    eagerly and then compiled, one right after the other (side by side, so that a comparison of the two is
    not a comparison of two moments of the machine); the ``compile`` column tells the rows apart.
    Out-of-memory in either phase becomes a row with ``status="oom"`` and ``note`` naming the phase. Times
    are ms per pass (mean and standard deviation of ``passes`` samples), memory in MiB (NaN on the CPU,
    except ``saved_mib`` which is measured with saved-tensor hooks), ``predicted_*_mib`` come from
    :func:`naive_attention_totals`, ``gpu`` names the device (``"cpu"`` on the CPU) and ``gpu_memory_gib``
    is its total memory (NaN on the CPU).
    """
    device = resolve_device(device) if isinstance(device, str) else device
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if passes < 1 or warmup < 0:
        raise ValueError("passes must be >= 1 and warmup >= 0")
    compiles = (bool(compile),) if isinstance(compile, bool) else tuple(bool(c) for c in compile)
    if not compiles:
        raise ValueError("compile must be a bool or a non-empty sequence of bools")
    impl = impl or getattr(fn, "__name__", "attention")
    gpu = gpu_label() if device.type == "cuda" else "cpu"
    memory_gib = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else math.nan
    grid = [(d, s, c) for d in ds for s in seqs for c in compiles]
    label = {(False,): "", (True,): " compiled"}.get(compiles, " eager and compiled")
    rows = []
    for d, seq, compiled in progress_bar(grid, f"{impl}{label}", progress):
        predicted = naive_attention_totals(batch, seq, d, dtype, causal)
        row = dict(impl=impl, compile=compiled, batch=batch, seq_len=seq, d=d, dtype=dtype, causal=causal,
                   passes=passes, fwd_ms=math.nan, fwd_std_ms=math.nan, bwd_ms=math.nan, bwd_std_ms=math.nan,
                   mem_baseline_mib=math.nan, mem_before_bwd_mib=math.nan, forward_left_mib=math.nan,
                   peak_mib=math.nan,
                   saved_mib=math.nan, predicted_saved_mib=predicted["saved"] / MiB,
                   predicted_before_bwd_mib=predicted["before_backward"] / MiB,
                   predicted_peak_mib=predicted["peak"] / MiB, compile_s=math.nan, gpu=gpu,
                   gpu_memory_gib=memory_gib, status="ok", note="")
        empty_cache()
        # Compiled backward graphs may donate (reuse) saved buffers, which forbids retain_graph=True; the
        # backward timing reuses one graph, so donation is switched off (a small memory saving forgone).
        try:
            with torch._functorch.config.patch(donated_buffer=False):
                _run_naive_config(fn, compiled, batch, seq, d, dtype, causal, passes, warmup, device, row)
        except Exception as exc:
            if not is_oom(exc):
                raise
            row.update(status="oom", note=f"out of memory in {row.get('phase', 'setup')}: {error_summary(exc)}")
        row.pop("phase", None)
        rows.append(row)
        gc.collect()
        empty_cache()
    return pd.DataFrame(rows)


def _run_naive_config(fn, compile, batch, seq, d, dtype, causal, passes, warmup, device, row) -> None:
    run = fn
    if compile:
        import time

        torch._dynamo.reset()
        run = torch.compile(fn, dynamic=False)
        q, k, v, dout = attention_inputs(batch, seq, d, DTYPES[dtype], device)
        start = time.perf_counter()
        torch.autograd.grad(run(q, k, v, causal), (q, k, v), dout)
        synchronize(device)
        row["compile_s"] = time.perf_counter() - start
        del q, k, v, dout
    _measure_naive(run, batch, seq, d, dtype, causal, passes, warmup, device, row)


def eager_vs_compiled(eager: pd.DataFrame, compiled: pd.DataFrame) -> pd.DataFrame:
    """One row per ``(d, seq_len)``: eager and compiled forward/backward ms, their speedups (eager /
    compiled, > 1 means compiling helps), the verdict of each (:func:`lab.measure.verdicts.compare_summaries`
    of the two means with their spread over ``passes`` samples: ``"faster"``/``"slower"`` when the compiled
    pass differs beyond the noise, else ``"within noise"``; empty where either side has no time) and the
    memory in use before backward (above the configuration's baseline) and saved for backward for both."""
    key = ["d", "seq_len"]
    eager, compiled = (_with_memory_above_baseline(t) for t in (eager, compiled))
    cols = ["fwd_ms", "fwd_std_ms", "bwd_ms", "bwd_std_ms", "passes", "mem_before_bwd_mib", "mem_above_baseline_mib",
            "saved_mib", "status"]
    cols = [c for c in cols if c in eager.columns and c in compiled.columns]
    extra = [c for c in ("compile_s",) if c in compiled.columns]
    merged = eager[key + cols].merge(compiled[key + cols + extra], on=key, suffixes=("_eager", "_compiled"))
    for p in ("fwd", "bwd"):
        merged[f"{p}_speedup"] = merged[f"{p}_ms_eager"] / merged[f"{p}_ms_compiled"]
        merged[f"{p}_verdict"] = [_compiled_verdict(r, p) for _, r in merged.iterrows()]
    return merged.sort_values(key).reset_index(drop=True)


def _compiled_verdict(row: pd.Series, p: str) -> str:
    names = [f"{p}_ms_compiled", f"{p}_std_ms_compiled", "passes_compiled", f"{p}_ms_eager", f"{p}_std_ms_eager",
             "passes_eager"]
    if not all(n in row.index for n in names) or pd.isna(row[names]).any():
        return ""
    c = compare_summaries(row[names[0]], row[names[1]], int(row[names[2]]), row[names[3]], row[names[4]],
                          int(row[names[5]]))
    return c.verdict


def _with_memory_above_baseline(grid: pd.DataFrame) -> pd.DataFrame:
    if "mem_baseline_mib" not in grid.columns or "mem_before_bwd_mib" not in grid.columns:
        return grid
    return grid.assign(mem_above_baseline_mib=grid["mem_before_bwd_mib"] - grid["mem_baseline_mib"])


def saved_memory_scaling(grid: pd.DataFrame, column: str = "saved_mib") -> pd.DataFrame:
    """Per head dimension ``d``, the exponent ``p`` of ``column ~ seq^p`` fitted over the measured rows
    (``p_all``) and between the two longest measured sequences (``p_longest``)."""
    rows = []
    for d, g in grid[grid["status"] == "ok"].groupby("d"):
        g = g.dropna(subset=[column]).sort_values("seq_len")
        if len(g) < 2:
            continue
        p_all, _ = fit_power_law(g["seq_len"], g[column])
        p_last, _ = fit_power_law(g["seq_len"].iloc[-2:], g[column].iloc[-2:])
        rows.append(dict(d=d, points=len(g), p_all=p_all, p_longest=p_last))
    return pd.DataFrame(rows)


def accounting_config(grid: pd.DataFrame) -> tuple[pd.Series, str]:
    """The configuration to account for: the smallest (by predicted peak memory) that ran out of memory,
    else the largest that fit. Returns ``(row, "oom" | "largest_fit")``."""
    oom = grid[grid["status"] == "oom"]
    if len(oom):
        return oom.sort_values("predicted_peak_mib").iloc[0], "oom"
    return grid.sort_values("predicted_peak_mib").iloc[-1], "largest_fit"


def naive_memory_check(row: pd.Series) -> pd.DataFrame:
    """Predicted vs measured memory (MiB) for one row of :func:`run_naive_grid`: what autograd saved beyond
    the inputs (saved-tensor hooks, any device), what was allocated when backward started and the peak
    (``torch.cuda.memory_allocated`` / ``max_memory_allocated`` above the configuration's baseline, i.e.
    without cuBLAS's workspace; NaN on the CPU or when out of memory)."""
    base = row.get("mem_baseline_mib", math.nan)
    checks = [("saved for backward beyond q, k, v", row["predicted_saved_mib"], row["saved_mib"]),
              ("allocated when backward starts", row["predicted_before_bwd_mib"], row["mem_before_bwd_mib"] - base),
              ("peak (lower bound)", row["predicted_peak_mib"], row["peak_mib"] - base)]
    out = pd.DataFrame([dict(quantity=q, predicted_mib=p, measured_mib=m) for q, p, m in checks])
    out["measured_over_predicted"] = out["measured_mib"] / out["predicted_mib"]
    return out


# ----------------------------------------------------------------------------------------------------------
# The whole model (notebook 04): eager against compiled, size by size


def lm_eager_vs_compiled(sizes: Sequence[str], context: int = 512, batch: int = 4, dtype: str = "bf16",
                         modes: Sequence[str] = ("forward", "forward_backward", "train_step"),
                         attention: str = "sdpa", warmup: int = 2, steps: int = 5,
                         device: torch.device | str = "auto", progress: bool = True) -> pd.DataFrame:
    """:func:`lab.bench.lm.compare_variants` of each size eagerly and under ``torch.compile(model)``, the two
    one right after the other in this process: ``lm_step`` rows (each mode's mean, standard deviation over
    ``steps`` samples and peak memory). A size that does not fit is a row with ``status="oom"`` whose modes
    that fit keep their numbers."""
    variants = [dict(attention=attention), dict(attention=attention, compile=True)]
    tables = [compare_variants(size, variants, context=context, batch=batch, dtype=dtype, modes=modes,
                               warmup=warmup, steps=steps, device=device, progress=progress) for size in sizes]
    return pd.concat(tables, ignore_index=True)
