"""FlashAttention against the baselines (notebook 05): correctness against float64, forward / backward /
end-to-end latency of every implementation on a grid of shapes (``triton.testing.do_bench``; median, mean,
standard deviation and sample count of each pass kept), TFLOP/s, speedups with noise-aware verdicts, the
performance goals, and the course's timing test.

Implementations are named as in ``results/flash_benchmark.csv`` (:data:`lab.bench.attention.IMPLS`):
``triton``, ``pytorch_flash`` (the tiled PyTorch FlashAttention-2), ``pytorch_naive``, ``sdpa`` (the default
backend), ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``. Inputs are ``(batch * heads, seq, d)``.

A configuration an implementation cannot run (a head dimension its kernels do not support, an SDPA backend
that has no kernel for this dtype or device) is a row with ``status="unsupported"`` and the reason in
``note``; one it is not asked to run (``skip``) is ``status="skipped"``; out-of-memory is ``status="oom"``.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from lab.bench.attention import _first_line, _inputs, attention_impl
from lab.bench.attention_costs import DTYPES, PASSES, attention_flops, naive_attention_totals
from lab.bench.progress import progress_bar
from lab.measure.device import empty_cache, is_oom, resolve_device
from lab.measure.timing import Timing, time_kernel
from lab.measure.verdicts import GoalCheck, compare_summaries
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
#: The course's timing test (16 x 16384 x 64, bf16, causal, forward + backward) should take at most this on an H100.
COURSE_GOAL_MS = 4.6

# Said by PyTorch while a correct implementation runs, about nothing this check measures: the autograd
# thread's first cuBLAS call, and Inductor's advice to use TF32 for the fp32 matmuls of a compiled reference.
_BENIGN_WARNINGS = ("there was no current CUDA context", "TensorFloat32 tensor cores for float32 matrix")
_UNSUPPORTED_MARKERS = ("not supported", "no available kernel", "no viable backend")


def unsupported_reason(exc: BaseException) -> str | None:
    """The one-line reason when ``exc`` says that an implementation cannot run this input at all (the Triton
    kernels' input checks, an SDPA backend without a kernel for this dtype, head dimension or device); None
    for any other error, which stays an error."""
    text = str(exc).lower()
    if isinstance(exc, (ValueError, TypeError, RuntimeError, NotImplementedError)) and any(
            m in text for m in _UNSUPPORTED_MARKERS):
        return f"not supported: {_first_line(exc)}"
    return None


# ----------------------------------------------------------------------------------------------------------
# Correctness


def errors_vs_float64(impls: dict[str, AttentionFn], batch: int = 2, seq: int = 128, d: int = 64,
                      dtype: str = "fp32", causal: bool = True, device: torch.device | str = "auto",
                      seed: int = 0) -> pd.DataFrame:
    """Largest absolute error of each implementation's output and dQ, dK, dV against
    :func:`naive_attention` computed in float64 on the same (rounded) inputs, one row per implementation
    (columns ``impl``, ``dtype``, ``d``, ``seq_len``, ``out``, ``dq``, ``dk``, ``dv`` in float64 units,
    ``status`` and ``note``). An implementation that cannot run this input is a row with
    ``status="unsupported"`` (see :func:`unsupported_reason`) and NaN errors."""
    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(batch, seq, d, generator=gen).to(DTYPES[dtype]) for _ in range(4)]
    # the reference in float64 on the device itself (a GPU does it in milliseconds), brought back to the CPU
    ref_in = [t.to(device).double().requires_grad_() for t in base[:3]]
    ref_out = naive_attention(*ref_in, causal)
    ref = [t.detach().cpu() for t in (ref_out, *torch.autograd.grad(ref_out, ref_in, base[3].to(device).double()))]
    del ref_in, ref_out
    rows = []
    for name, fn in impls.items():
        row = dict(impl=name, dtype=dtype, d=d, seq_len=seq, out=math.nan, dq=math.nan, dk=math.nan, dv=math.nan,
                   status="ok", note="")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                xs = [t.to(device).requires_grad_() for t in base[:3]]
                out = fn(*xs, causal)
                got = [out, *torch.autograd.grad(out, xs, base[3].to(device))]
        except Exception as exc:  # noqa: BLE001 - only "cannot run this input" becomes a row
            reason = unsupported_reason(exc)
            if reason is None:
                raise
            # SDPA warns once per backend why it declined before raising: the note keeps the reason
            row.update(status="unsupported", note=reason)
            rows.append(row)
            continue
        for w in caught:
            if not any(m in str(w.message) for m in _BENIGN_WARNINGS):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        errs = [(g.detach().double().cpu() - r.detach()).abs().max().item() for g, r in zip(got, ref)]
        row.update(zip(["out", "dq", "dk", "dv"], errs))
        rows.append(row)
    return pd.DataFrame(rows)


def correctness_grid(impls: Sequence[str], ds: Sequence[int] = (64, 80, 96, 128),
                     dtypes: Sequence[str] = ("bf16", "fp32"), batch: int = 4, seq: int = 1024, causal: bool = True,
                     device: torch.device | str = "auto", progress: bool = True) -> pd.DataFrame:
    """:func:`errors_vs_float64` of every implementation (names for :func:`attention_impl`) at every head
    dimension and dtype: one row per (impl, dtype, d)."""
    device = resolve_device(device) if isinstance(device, str) else device
    fns = {name: attention_impl(name, device) for name in impls}
    grid = [(dt, d) for dt in dtypes for d in ds]
    tables = [errors_vs_float64(fns, batch, seq, d, dt, causal, device)
              for dt, d in progress_bar(grid, "correctness", progress)]
    return pd.concat(tables, ignore_index=True)


# ----------------------------------------------------------------------------------------------------------
# The flash grid (notebook 05): forward, backward, end-to-end per implementation


def _record(row: dict, pass_: str, timing: Timing) -> None:
    row.update({f"{pass_}_ms": timing.median_ms, f"{pass_}_mean_ms": timing.mean_ms,
                f"{pass_}_std_ms": timing.std_ms, f"{pass_}_n": len(timing.samples_ms)})


def _measure_flash(fn: AttentionFn, bh, seq, d, dtype, causal, device, timer_kwargs, row) -> None:
    q, k, v, dout = _inputs(bh, seq, d, DTYPES[dtype], device)
    row["phase"] = "forward"
    _record(row, "fwd", time_kernel(lambda: fn(q, k, v, causal), device, **timer_kwargs))
    row["phase"] = "backward"
    out = fn(q, k, v, causal)
    _record(row, "bwd", time_kernel(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device,
                                    **timer_kwargs))
    out = None  # free the retained graph (held through the lambda's closure) before end-to-end builds its own
    row["phase"] = "end-to-end"
    _record(row, "e2e", time_kernel(lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout), device,
                                    **timer_kwargs))


def grid_shapes(seqs: Sequence[int], ds: Sequence[int], batch: int = 1, heads: int = 1,
                causal: bool = True) -> list[Shape]:
    """Every ``seq x d`` at one batch, heads and causality (a length sweep)."""
    return [Shape(batch, heads, s, d, causal) for d in ds for s in seqs]


def skip_pytorch_flash(max_seq: int = 2048, dtypes: Sequence[str] | None = None,
                       impl: str = "pytorch_flash") -> Callable[[str, Shape, str], str | None]:
    """A ``skip`` rule for :func:`run_flash_grid`: the tiled PyTorch FlashAttention-2 walks its tiles in a
    Python loop (``(seq / 64)^2`` tile pairs forward, half that causal, as many again backward, each a dozen
    small kernels), so beyond ``max_seq`` tokens one configuration would take tens of seconds to minutes; it
    also runs only in ``dtypes`` (None: all). Returns ``skip(impl, shape, dtype) -> reason or None``."""

    def skip(name: str, shape: Shape, dtype: str) -> str | None:
        if name != impl:
            return None
        if shape.seq > max_seq:
            n = math.ceil(shape.seq / 64)
            tiles = n * (n + 1) // 2 if shape.causal else n * n
            return (f"not run beyond {max_seq} tokens: its Python tile loop would visit {tiles:,} tile pairs per "
                    "sequence and pass, too slow for this book")
        if dtypes is not None and dtype not in dtypes:
            return f"not run in {dtype}: timed in {', '.join(dtypes)} only (the tile loop's time barely depends on it)"
        return None

    return skip


def run_flash_grid(impls: Sequence[str] | dict[str, AttentionFn] = ("triton", "pytorch_naive", "sdpa"),
                   shapes: Sequence[Shape] = LM_SHAPES, dtypes: Sequence[str] = ("bf16",),
                   warmup_ms: float = 5, rep_ms: float = 20, cpu_steps: int = 3,
                   device: torch.device | str = "auto", memory_limit_gib: float | None = None,
                   skip: Callable[[str, Shape, str], str | None] | None = None, sweep: str = "",
                   progress: bool = True) -> pd.DataFrame:
    """Forward, backward and end-to-end (forward+backward) latency of each attention implementation on each
    shape and dtype.

    ``impls`` are names for :func:`attention_impl` or a dict ``name -> fn(q, k, v, causal)``. Inputs are
    ``(batch*heads, seq, d)``. Each pass is timed with :func:`lab.measure.timing.time_kernel` (do_bench on
    CUDA); ``{pass}_ms`` is the median, ``{pass}_mean_ms``, ``{pass}_std_ms`` and ``{pass}_n`` the mean,
    standard deviation and number of samples (what a verdict needs). Backward reuses one forward's graph.
    ``pytorch_naive`` configurations whose predicted peak exceeds ``memory_limit_gib`` (default: 1.25x the
    GPU's memory) are not attempted and recorded as ``status="oom"``; ``skip(impl, shape, dtype)`` may
    return a reason not to run a configuration (``status="skipped"``, see :func:`skip_pytorch_flash`); an
    implementation that cannot run a configuration is ``status="unsupported"`` (:func:`unsupported_reason`);
    every out-of-memory is caught and recorded with the pass it hit. Returns one row per (impl, dtype, shape)
    with those times, ``*_tflops`` (FLOPs from :func:`attention_flops`), ``sweep`` (the label given),
    ``gpu`` (``"cpu"`` on the CPU), ``status`` and ``note``.
    """
    from lab.measure.results import gpu_label

    device = resolve_device(device) if isinstance(device, str) else device
    fns = dict(impls) if isinstance(impls, dict) else {name: attention_impl(name, device) for name in impls}
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; choose one of {', '.join(DTYPES)}")
    if memory_limit_gib is None and device.type == "cuda":
        memory_limit_gib = 1.25 * torch.cuda.get_device_properties(device).total_memory / 2**30
    gpu = gpu_label() if device.type == "cuda" else "cpu"
    timer_kwargs = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps)
    grid = [(dt, shape, name) for dt in dtypes for shape in shapes for name in fns]
    rows = []
    for dt, sh, name in progress_bar(grid, f"attention {sweep}".strip(), progress):
        bh = sh.batch * sh.heads
        row = dict(sweep=sweep, impl=name, dtype=dt, batch=sh.batch, heads=sh.heads, seq_len=sh.seq, d=sh.d,
                   causal=sh.causal, gpu=gpu, status="ok", note="")
        for p in PASSES:
            row.update({f"{p}_ms": math.nan, f"{p}_mean_ms": math.nan, f"{p}_std_ms": math.nan, f"{p}_n": 0})
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
                if is_oom(exc):
                    row.update(status="oom", note=f"out of memory in {row.get('phase')}: {_first_line(exc)}")
                elif unsupported_reason(exc):
                    row.update(status="unsupported", note=unsupported_reason(exc))
                else:
                    raise
                for p in PASSES:  # a pass measured before the failure is not a result of this configuration
                    row.update({f"{p}_ms": math.nan, f"{p}_mean_ms": math.nan, f"{p}_std_ms": math.nan,
                                f"{p}_n": 0})
            row.pop("phase", None)
            gc.collect()
            empty_cache()
        rows.append(row)
    return add_tflops(pd.DataFrame(rows))


def run_flash_benchmark(sweeps: dict[str, dict], **common) -> pd.DataFrame:
    """:func:`run_flash_grid` once per named sweep (``{"lm": dict(impls=..., shapes=..., dtypes=...), ...}``,
    each dict's keywords over ``common``'s), rows labelled by the ``sweep`` column, in one table."""
    tables = [run_flash_grid(**{**common, **kwargs, "sweep": name}) for name, kwargs in sweeps.items()]
    return pd.concat(tables, ignore_index=True)


def add_tflops(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``fwd_tflops``, ``bwd_tflops``, ``e2e_tflops``: :func:`attention_flops` / median time, in TFLOP/s."""
    df = df.copy()
    for p in PASSES:
        flops = [attention_flops(r.batch, r.seq_len, r.d, bool(r.causal), p, heads=r.heads)
                 for r in df.itertuples()]
        df[f"{p}_tflops"] = np.asarray(flops, dtype=float) / (df[f"{p}_ms"].to_numpy(dtype=float) * 1e-3) / 1e12
    return df


CONFIG_KEY = ["dtype", "batch", "heads", "seq_len", "d", "causal"]


def add_speedups(df: pd.DataFrame, baselines: Sequence[str] = ("pytorch_naive", "sdpa")) -> pd.DataFrame:
    """Add ``{pass}_speedup_vs_{baseline}`` = baseline ms / this row's ms (medians) for the same configuration
    (> 1: this implementation is faster). NaN where either side has no time (e.g. out of memory)."""
    df = df.copy()
    for base in baselines:
        ref = df[df["impl"] == base].set_index(CONFIG_KEY)[[f"{p}_ms" for p in PASSES]].add_suffix("_ref")
        joined = df.join(ref, on=CONFIG_KEY)
        for p in PASSES:
            df[f"{p}_speedup_vs_{base}"] = (joined[f"{p}_ms_ref"] / joined[f"{p}_ms"]).to_numpy()
    return df


def _by_config(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows indexed by configuration; a configuration measured twice (in two sweeps) keeps its last row."""
    return rows.drop_duplicates(CONFIG_KEY, keep="last").set_index(CONFIG_KEY)


def _comparison(mine: pd.Series, ref: pd.Series, p: str):
    """Time of ``mine`` against ``ref`` for pass ``p`` (compare_summaries of means; a row without a spread,
    e.g. one sample, gives an interval of infinities and the verdict "within noise")."""
    mean = mine.get(f"{p}_mean_ms", mine[f"{p}_ms"])
    ref_mean = ref.get(f"{p}_mean_ms", ref[f"{p}_ms"])
    return compare_summaries(mean, mine.get(f"{p}_std_ms", math.nan), int(mine.get(f"{p}_n", 0) or 0), ref_mean,
                             ref.get(f"{p}_std_ms", math.nan), int(ref.get(f"{p}_n", 0) or 0))


def versus(df: pd.DataFrame, impl: str = "triton", references: Sequence[str] = ("sdpa",),
           passes: Sequence[str] = PASSES) -> pd.DataFrame:
    """``impl`` against each reference on every configuration both measured: one row per (configuration,
    reference, pass) with both mean times, ``speedup`` = reference / impl (of the means, > 1: ``impl`` is
    faster), its 95% interval ``[low, high]`` and the verdict on ``impl``'s time (``"faster"``, ``"slower"``
    or ``"within noise"``, :func:`lab.measure.verdicts.compare_summaries`)."""
    ok = df[df["status"] == "ok"]
    mine = _by_config(ok[ok["impl"] == impl])
    rows = []
    for reference in references:
        ref = _by_config(ok[ok["impl"] == reference])
        for key in mine.index.intersection(ref.index):
            for p in passes:
                c = _comparison(mine.loc[key], ref.loc[key], p)
                rows.append({**dict(zip(CONFIG_KEY, key)), "reference": reference, "pass": p,
                             "ms": mine.loc[key].get(f"{p}_mean_ms", mine.loc[key][f"{p}_ms"]),
                             "reference_ms": ref.loc[key].get(f"{p}_mean_ms", ref.loc[key][f"{p}_ms"]),
                             "speedup": c.speedup, "low": 1 / c.high if c.high else math.inf,
                             "high": 1 / c.low if c.low > 0 else math.inf, "verdict": c.verdict})
    columns = CONFIG_KEY + ["reference", "pass", "ms", "reference_ms", "speedup", "low", "high", "verdict"]
    return pd.DataFrame(rows, columns=columns)


def flash_goals(df: pd.DataFrame, impl: str = "triton", reference: str = "sdpa",
                dtypes: Sequence[str] = ("bf16", "fp16"),
                min_heads: int = 16, goals: dict[str, float] = GOALS) -> pd.DataFrame:
    """Per qualifying configuration (``dtype`` in ``dtypes``, batch x heads >= ``min_heads``; both ``impl``
    and ``reference`` measured): for fwd, bwd, e2e the speed ratio ``{p}_ratio`` = reference / impl (of the
    means), its 95% interval ``{p}_low``-``{p}_high``, ``{p}_goal`` (``"met"`` when the whole interval is at
    or above the goal, ``"missed"`` when it is wholly below, ``"undecided"`` when the goal lies inside the
    noise or no spread was measured) and ``{p}_ok`` (True only when met). Empty when no configuration
    qualifies (e.g. the CPU quick book)."""
    sel = df[(df["dtype"].isin(dtypes)) & (df["batch"] * df["heads"] >= min_heads)]
    mine = _by_config(sel[(sel["impl"] == impl) & (sel["status"] == "ok")])
    ref = _by_config(sel[(sel["impl"] == reference) & (sel["status"] == "ok")])
    both = mine.index.intersection(ref.index)
    rows = []
    for key in both:
        row = dict(zip(CONFIG_KEY, key))
        for p, target in goals.items():
            check = GoalCheck(_comparison(mine.loc[key], ref.loc[key], p), 1 / target)  # time ratio <= 1/goal
            c = check.comparison
            row.update({f"{p}_ratio": c.speedup, f"{p}_low": 1 / c.high if c.high else math.inf,
                        f"{p}_high": 1 / c.low if c.low > 0 else math.inf,
                        f"{p}_goal": {True: "met", False: "missed", None: "undecided"}[check.met],
                        f"{p}_ok": check.met is True})
        rows.append(row)
    columns = CONFIG_KEY + [f"{p}_{c}" for p in goals for c in ("ratio", "low", "high", "goal", "ok")]
    return pd.DataFrame(rows, columns=columns)


def summarize_goals(goals_table: pd.DataFrame, goals: dict[str, float] = GOALS) -> dict:
    """For each pass: the target, configurations checked, how many meet the goal, miss it or are undecided
    within the noise, and the worst (lowest) speed ratio with its configuration (a dict of
    :data:`CONFIG_KEY`, or None). ``all_met``: every goal met on every configuration (False when none was
    checked)."""
    summary = {"configs": len(goals_table)}
    for p, target in goals.items():
        col = goals_table.get(f"{p}_ratio", pd.Series(dtype=float))
        word = goals_table.get(f"{p}_goal", pd.Series(dtype=str))
        worst = goals_table.loc[col.idxmin()] if len(col) and col.notna().any() else None
        summary[p] = dict(target=target, met=int((word == "met").sum()), missed=int((word == "missed").sum()),
                          undecided=int((word == "undecided").sum()),
                          worst=float(col.min()) if len(col) else math.nan,
                          worst_config=None if worst is None else {k: worst[k] for k in CONFIG_KEY})
    summary["all_met"] = bool(len(goals_table)) and all(summary[p]["met"] == len(goals_table) for p in goals)
    return summary


def course_timing_test(compile: bool = True, batch: int = 16, seq: int = 16384, d: int = 64,
                       device: torch.device | str = "cuda", rep_ms: float = 200, cpu_steps: int = 3) -> dict:
    """The course's FlashAttention timing: ``FlashAttentionTriton.apply`` (under ``torch.compile`` when
    ``compile``) on q, k, v of shape (batch, seq, d) in bf16, causal; forward, ``o.sum()``, backward, timed
    as one call with ``triton.testing.do_bench`` (on the CPU: the host timer, ``cpu_steps`` calls). Returns
    ``ms`` (median), ``mean_ms``, ``std_ms``, ``n`` (samples), ``gpu`` (``"cpu"`` on the CPU) and the shape."""
    from lab.kernels import flash_triton as flash
    from lab.measure.results import gpu_label

    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, seq, d, generator=gen).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
    fn = torch.compile(flash.FlashAttentionTriton.apply) if compile else flash.FlashAttentionTriton.apply

    def step():
        o = fn(q, k, v, True)
        o.sum().backward()

    timing = time_kernel(step, device, warmup_ms=25, rep_ms=rep_ms, cpu_steps=cpu_steps)
    return dict(test="course flash timing", compiled=compile, batch=batch, seq_len=seq, d=d, dtype="bf16",
                causal=True, ms=timing.median_ms, mean_ms=timing.mean_ms, std_ms=timing.std_ms,
                n=len(timing.samples_ms), gpu=gpu_label() if device.type == "cuda" else "cpu",
                goal_ms=COURSE_GOAL_MS)


def course_timing_table(compiles: Sequence[bool] = (True, False), batch: int = 16, seq: int = 16384, d: int = 64,
                        **kwargs) -> pd.DataFrame:
    """:func:`course_timing_test` once per ``compile`` setting, one row each."""
    return pd.DataFrame([course_timing_test(compile=c, batch=batch, seq=seq, d=d, **kwargs) for c in compiles])


# ----------------------------------------------------------------------------------------------------------
# Kernel variants: a sweep of FlashConfig settings next to the peers, where the backward's time goes, and the
# host's share of a short sequence (the command line below runs them on a GPU)

#: Forward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` a sweep tries besides the table's.
SWEEP_FWD_TILES = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2))
#: Shapes up to this many tokens are also timed as CUDA-graph replays (``{pass}_graph_ms``): their kernels
#: are short enough that the host's launch time, not the device, can set the eager time.
GRAPH_MAX_SEQ = 2048
#: Backward variants a sweep tries besides the table's: name -> (launch mode, tiles ``(BLOCK_M1, BLOCK_N1,
#: BLOCK_M2, BLOCK_N2, num_warps, num_stages)``, extra FlashConfig fields). ``M1 x N1`` are the (query, key)
#: tiles of the dK/dV programs, ``M2 x N2`` those of the dQ programs.
SWEEP_BWD = {
    "fused 32x64 w8 s2": ("fused", (32, 64, 64, 32, 8, 2), {}),
    "fused 32x64 w4 s2": ("fused", (32, 64, 64, 32, 4, 2), {}),
    "fused 32x64 w8 s2 +delta": ("fused", (32, 64, 64, 32, 8, 2), {"fused_delta": True}),
    "fused 64x64 w4 s3": ("fused", (64, 64, 64, 64, 4, 3), {}),
    "two_pass 64x128 w8 s3": ("two_pass", (64, 128, 128, 64, 8, 3), {}),
    "two_pass 64x64 w4 s3": ("two_pass", (64, 64, 64, 64, 4, 3), {}),
    "atomic 64x128 w8 s2": ("atomic", (64, 128, 128, 64, 8, 2), {}),
    "atomic 64x128 w8 s3": ("atomic", (64, 128, 128, 64, 8, 3), {}),
    "atomic 64x128 w8 s3 +delta": ("atomic", (64, 128, 128, 64, 8, 3), {"fused_delta": True}),
    "atomic 64x64 w4 s3": ("atomic", (64, 64, 64, 64, 4, 3), {}),
    "atomic 32x64 w4 s2": ("atomic", (32, 64, 64, 32, 4, 2), {}),
    "atomic 64x128 w8 s2 no-tma": ("atomic", (64, 128, 128, 64, 8, 2), {"atomic_tma": False}),
}
#: Matrix products per (query tile, key tile) pair of each backward launch mode: the dK/dV programs compute
#: S, dV, dP, dK and, in "atomic" mode, dQ (5); the separate dQ programs of "fused" and "two_pass" recompute
#: S and dP before dQ (7).
PRODUCTS = {"fused": 7, "two_pass": 7, "atomic": 5}
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}


def sweep_configs(fwd_tiles: Sequence[tuple] = SWEEP_FWD_TILES, bwd: dict | None = None) -> dict:
    """The FlashConfig variants of a sweep: ``{name: (config, passes)}`` where ``passes`` are the passes the
    variant changes ("default" runs all three, a forward variant times "fwd", a backward one "bwd")."""
    from lab.kernels.flash_config import FlashConfig

    bwd = SWEEP_BWD if bwd is None else bwd
    out = {"default": (FlashConfig(), PASSES)}
    out.update({"fwd {}x{} w{} s{}".format(*t): (FlashConfig(fwd_tiles=tuple(t)), ("fwd",)) for t in fwd_tiles})
    out.update({name: (FlashConfig(backward_launch=mode, bwd_tiles=tuple(tiles), **extra), ("bwd",))
                for name, (mode, tiles, extra) in bwd.items()})
    return out


def relative_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the pairs (output and gradients), in float64."""
    return max(((g.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item()
               for g, r in zip(got, ref))


def _outputs(fn: AttentionFn, q, k, v, dout, causal, heads: int):
    """Output and (dQ, dK, dV) of the first ``heads`` rows of the batch, for a correctness check."""
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*xs, causal)
    grads = torch.autograd.grad(out, xs, dout)
    return [t[:heads].detach() for t in (out, *grads)]


def backward_breakdown(shape: Shape, ms: float, mode: str, ceiling_tflops: float) -> dict:
    """Where a backward's time goes: ``products`` per tile pair (:data:`PRODUCTS`), ``useful_tflops`` (the
    5-product FLOPs of :func:`attention_flops` per second), ``executed_tflops`` (the products really issued,
    on ``BLOCK_D``-wide tiles: useful x products / 5 x BLOCK_D / d; masked diagonal tiles not counted) and
    ``of_ceiling``, executed against ``ceiling_tflops`` (a measured large matmul of the same dtype)."""
    from lab.kernels.flash_config import block_d

    useful = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, "bwd", heads=shape.heads)
    executed = useful * PRODUCTS[mode] / 5 * block_d(shape.d) / shape.d
    rate = executed / (ms * 1e-3) / 1e12
    return dict(products=PRODUCTS[mode], useful_tflops=useful / (ms * 1e-3) / 1e12, executed_tflops=rate,
                of_ceiling=rate / ceiling_tflops if ceiling_tflops else math.nan)


def matmul_ceiling(dtype: str = "bf16", n: int = 8192, device: torch.device | str = "auto",
                   rep_ms: float = 100) -> float:
    """TFLOP/s of one ``n x n x n`` matmul in ``dtype`` (``torch.mm``), the tensor-core rate a kernel's
    matrix products can hope for on this device."""
    device = resolve_device(device) if isinstance(device, str) else device
    a, b = (torch.randn(n, n, device=device).to(DTYPES[dtype]) for _ in range(2))
    timing = time_kernel(lambda: a @ b, device, warmup_ms=25, rep_ms=rep_ms)
    return 2 * n**3 / (timing.median_ms * 1e-3) / 1e12


def resolved_plan(shape: Shape, dtype: str, config, device: torch.device) -> dict:
    """The tiles and backward launch mode the kernels would use for ``shape`` under ``config`` (from the
    tables, or the config's own): ``fwd_tiles``, ``bwd_mode``, ``bwd_tiles`` as text for a results table."""
    from lab.kernels.flash_config import backward_plan, forward_tiles

    bh, dt = shape.batch * shape.heads, DTYPES[dtype]
    f = forward_tiles(bh, shape.seq, shape.seq, shape.d, dt, device, config)
    mode, plan = backward_plan(bh, shape.seq, shape.seq, shape.d, dt, device, config)
    return dict(fwd_tiles="{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**f), bwd_mode=mode,
                bwd_tiles=" / ".join("{BLOCK_M1}x{BLOCK_N1},{BLOCK_M2}x{BLOCK_N2} w{num_warps} s{num_stages}".format(
                    **plan[p]) for p in ({"fused": (0,), "atomic": (1,)}.get(mode, (1, 2)))))


def sweep_shape(shape: Shape, dtype: str = "bf16", variants: dict | None = None,
                peers: Sequence[str] = ("sdpa", "flex"), device: torch.device | str = "auto",
                warmup_ms: float = 10, rep_ms: float = 50, check_heads: int = 2,
                ceiling_tflops: float = math.nan, sink: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Every FlashConfig variant of :func:`sweep_configs` and every peer implementation on one shape, in one
    process: first a correctness check of each against fp32 SDPA on the first ``check_heads`` heads
    (``rel_err``, max error over output and gradients relative to the reference's largest value; ``ok``
    within :data:`TOLERANCE`), then the passes the variant changes, timed (``{pass}_ms`` medians,
    ``{pass}_tflops``; up to :data:`GRAPH_MAX_SEQ` tokens also ``{pass}_graph_ms`` / ``_graph_tflops``, CUDA
    graph replays). Backward rows also carry :func:`backward_breakdown` (of the graph replay's time when
    there is one). ``sink(row)`` sees each row as
    it is made (to write it out before a later one fails). A variant that fails is a row with ``status``
    "error" and the reason in ``note``."""
    from lab.bench.attention import attention_impl
    from lab.kernels.flash_triton import FlashAttentionTriton

    device = resolve_device(device) if isinstance(device, str) else device
    variants = sweep_configs() if variants is None else variants
    bh = shape.batch * shape.heads
    q, k, v, dout = _inputs(bh, shape.seq, shape.d, DTYPES[dtype], device)
    ref = _outputs(lambda a, b, c, causal: torch.nn.functional.scaled_dot_product_attention(
        a.float().unsqueeze(0), b.float().unsqueeze(0), c.float().unsqueeze(0), is_causal=causal)[0],
        q[:check_heads], k[:check_heads], v[:check_heads], dout[:check_heads].float(), shape.causal, check_heads)
    fns = {name: (lambda a, b, c, causal, cfg=cfg: FlashAttentionTriton.apply(a, b, c, causal, cfg), passes, cfg)
           for name, (cfg, passes) in variants.items()}
    fns.update({name: (attention_impl(name, device), PASSES, None) for name in peers})
    timer = dict(warmup_ms=warmup_ms, rep_ms=rep_ms)
    rows = []
    for name, (fn, passes, cfg) in fns.items():
        row = dict(shape=f"{shape.batch}x{shape.heads}x{shape.seq}x{shape.d}", causal=shape.causal, dtype=dtype,
                   impl="triton" if cfg is not None else name, variant=name, status="ok", note="")
        if cfg is not None:
            row.update(resolved_plan(shape, dtype, cfg, device))
        try:
            got = _outputs(fn, q, k, v, dout, shape.causal, check_heads)
            row["rel_err"] = relative_errors(got, ref)
            row["ok"] = row["rel_err"] <= TOLERANCE[dtype]
            del got
            graph = device.type == "cuda" and shape.seq <= GRAPH_MAX_SEQ
            row.update(_time_passes(fn, q, k, v, dout, shape.causal, passes, device, timer, graph))
            for p in PASSES:
                flops = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, p, heads=shape.heads)
                if f"{p}_ms" in row:
                    row[f"{p}_tflops"] = flops / (row[f"{p}_ms"] * 1e-3) / 1e12
                if f"{p}_graph_ms" in row:
                    row[f"{p}_graph_tflops"] = flops / (row[f"{p}_graph_ms"] * 1e-3) / 1e12
            if cfg is not None and "bwd" in passes:
                ms = row.get("bwd_graph_ms", row["bwd_ms"])
                row.update(backward_breakdown(shape, ms, row["bwd_mode"], ceiling_tflops))
        except Exception as exc:  # noqa: BLE001 - a variant that cannot compile or run is a row, not the end
            if is_oom(exc):
                empty_cache()
            row.update(status="error", note=_first_line(exc))
        rows.append(row)
        if sink:
            sink(row)
    return pd.DataFrame(rows)


def _time_passes(fn, q, k, v, dout, causal, passes, device, timer, graph: bool = False) -> dict:
    """``{pass}_ms`` of each pass in ``passes`` (do_bench medians); with ``graph`` also ``{pass}_graph_ms`` of
    every pass, the device's time without the host's: the forward and forward+backward replayed from CUDA
    graphs, the backward their difference (a backward alone cannot be captured: autograd runs it on the
    stream of its forward, which ran before the capture)."""
    row = {}
    out = fn(q, k, v, causal) if "bwd" in passes else None
    steps = {"fwd": lambda: fn(q, k, v, causal),
             "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
             "e2e": lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)}
    for p in passes:
        row[f"{p}_ms"] = time_kernel(steps[p], device, **timer).median_ms
    if graph:
        try:
            for p in ("fwd", "e2e"):
                row[f"{p}_graph_ms"] = time_kernel(_graph_replay(steps[p]), device, **timer).median_ms
            row["bwd_graph_ms"] = row["e2e_graph_ms"] - row["fwd_graph_ms"]
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its eager times
            row["note"] = f"graph: {_first_line(exc)}"
    return row


def best_variants(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per (shape, dtype): the fastest correct Triton variant for the forward and for the backward, next to
    the default and the peers, in TFLOP/s (one row per shape; columns ``{who}_{pass}_tflops``). Where a
    shape was timed as CUDA-graph replays, those (the device's time) decide and are reported
    (``timing="graph"``), else the eager times (``timing="eager"``)."""
    ok = sweep[(sweep["status"] == "ok") & (sweep.get("ok", True) != False)]  # noqa: E712 - NaN for peers
    rows = []
    for (shape, dtype), grp in ok.groupby(["shape", "dtype"], sort=False):
        graph = "bwd_graph_tflops" in grp and grp["bwd_graph_tflops"].notna().any()
        suffix = "_graph_tflops" if graph else "_tflops"
        row = dict(shape=shape, dtype=dtype, timing="graph" if graph else "eager")
        tri = grp[grp["impl"] == "triton"]
        for p in ("fwd", "bwd"):
            col = f"{p}{suffix}"
            if col in tri and tri[col].notna().any():
                best = tri.loc[tri[col].idxmax()]
                row.update({f"best_{p}": best["variant"], f"best_{p}_tflops": best[col]})
        for who in ["default", *grp.loc[grp["impl"] != "triton", "variant"]]:
            sel = grp[grp["variant"] == who]
            for p in PASSES:
                if len(sel) and f"{p}{suffix}" in sel:
                    row[f"{who}_{p}_tflops"] = sel[f"{p}{suffix}"].iloc[0]
        rows.append(row)
    return pd.DataFrame(rows)


def _graph_replay(step: Callable[[], object]) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (after warm-up calls on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _python_profile(step: Callable[[], object], device: torch.device, calls: int = 50) -> str:
    """cProfile's table (own time per Python function, top 30) of ``calls`` calls of ``step``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def host_costs(shape: Shape, dtype: str = "bf16", impls: Sequence[str] = ("flash_triton", "sdpa"),
               device: torch.device | str = "auto", calls: int = 20, rep_ms: float = 50,
               profile: bool = True) -> tuple[pd.DataFrame, str]:
    """Where a short sequence's attention time goes, in the model's layout (q, k, v as ``transpose(1, 2)``
    views of (batch, seq, heads, d), the registry's ``fn(q, k, v, True)``), forward + backward per row:
    ``eager_ms`` (do_bench median), ``host_ms`` (wall time to issue one call, ``calls`` calls without a
    sync), ``graph_ms`` (the same step replayed from a CUDA graph: the device's time alone),
    ``compiled_ms`` (``torch.compile(fullgraph=True)`` of the attention and its output transpose) and
    ``host_bound`` (eager well above the graph replay). Also returns the torch.profiler table of a few
    eager steps of the first implementation (self CPU time per op) and cProfile's table of its Python functions,
    or "" when ``profile`` is False."""
    import time

    from lab.model.attention import get_attention

    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator(device="cpu").manual_seed(0)
    dt = DTYPES[dtype]
    make = lambda: torch.randn(shape.batch, shape.seq, shape.heads, shape.d, generator=gen).to(device, dt)
    base = [make().requires_grad_() for _ in range(3)]
    dout = make().transpose(1, 2)
    rows, table = [], ""
    timer = dict(warmup_ms=10, rep_ms=rep_ms)
    for name in impls:
        attn = get_attention(name)

        def step(fn=attn):
            q, k, v = (t.transpose(1, 2) for t in base)
            return torch.autograd.grad(fn(q, k, v, shape.causal), base, dout)

        row = dict(shape=f"{shape.batch}x{shape.heads}x{shape.seq}x{shape.d}", dtype=dtype, impl=name)
        row["eager_ms"] = time_kernel(step, device, **timer).median_ms
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                step()
            row["host_ms"] = (time.perf_counter() - start) * 1e3 / calls
            torch.cuda.synchronize(device)
            try:
                row["graph_ms"] = time_kernel(_graph_replay(step), device, **timer).median_ms
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its other columns
                row["note"] = f"graph: {_first_line(exc)}"
        compiled = torch.compile(lambda q, k, v, fn=attn: fn(q, k, v, shape.causal).transpose(1, 2).reshape(
            shape.batch, shape.seq, -1), fullgraph=True)
        douts = dout.transpose(1, 2).reshape(shape.batch, shape.seq, -1)
        row["compiled_ms"] = time_kernel(lambda: torch.autograd.grad(
            compiled(*(t.transpose(1, 2) for t in base)), base, douts), device, **timer).median_ms
        row["host_bound"] = bool(row.get("graph_ms", math.nan) * 1.2 < row["eager_ms"])
        if profile and not table:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
                for _ in range(5):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            table += "\n\nPython functions by own time, 50 eager steps:\n" + _python_profile(step, device)
        rows.append(row)
    return pd.DataFrame(rows), table


# ----------------------------------------------------------------------------------------------------------
# Command line: python -m lab.bench.flash {sweep,check,course} ...

_SHAPE_HELP = "BxHxLxD[:dtype][:full], e.g. 1x32x32768x128:bf16 or 2x16x4096x64:fp16:full (default causal, bf16)"


def parse_shape(text: str) -> tuple[Shape, str]:
    """``"BxHxLxD[:dtype][:full]"`` -> (Shape, dtype name); causal unless ``full`` is given."""
    dims, *flags = text.split(":")
    try:
        b, h, n, d = (int(x) for x in dims.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad shape {text!r}: expected {_SHAPE_HELP}") from None
    dtype = next((f for f in flags if f in DTYPES), "bf16")
    unknown = [f for f in flags if f not in DTYPES and f != "full"]
    if unknown:
        raise ValueError(f"bad shape {text!r}: unknown flag(s) {unknown}; expected {_SHAPE_HELP}")
    return Shape(b, h, n, d, "full" not in flags), dtype


def _warm_task(task):
    """A pool worker's job: one forward+backward of a variant (Triton's and Inductor's on-disk caches then
    hold its kernels for the timing process). Returns (name, None or the error's first line)."""
    shape, dtype, name, device = task
    try:
        fns = sweep_configs()
        q, k, v, dout = _inputs(shape.batch * shape.heads, shape.seq, shape.d, DTYPES[dtype], torch.device(device))
        if name in fns:
            from lab.kernels.flash_triton import FlashAttentionTriton

            fn = lambda a, b, c, causal: FlashAttentionTriton.apply(a, b, c, causal, fns[name][0])
        else:
            from lab.bench.attention import attention_impl

            fn = attention_impl(name, device)
        _outputs(fn, q, k, v, dout, shape.causal, 1)
        return name, None
    except Exception as exc:  # noqa: BLE001 - reported by the parent, which times what compiled
        return name, _first_line(exc)


def warm_variants(jobs: Sequence[tuple[Shape, str]], names: Sequence[str], device: str, workers: int) -> list:
    """Compile every variant in ``names`` (:func:`sweep_configs` names or peers) for every (shape, dtype) of
    ``jobs`` in ``workers`` spawned processes, so that the timing process finds them compiled and has the
    GPU to itself. Returns the failures as (name, reason)."""
    import multiprocessing as mp

    tasks = [(s, dt, n, device) for s, dt in jobs for n in names]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [r for r in pool.imap_unordered(_warm_task, tasks) if r[1]]


def main(argv: Sequence[str] | None = None) -> None:
    """``sweep``: every FlashConfig variant and the peers (SDPA's default backend, compiled FlexAttention) on
    the given shapes, each checked against fp32 SDPA first, written to ``OUT/sweep.csv`` row by row, the best
    per shape to ``OUT/best.csv``, the host's share of a short shape to ``OUT/host.csv`` (and the profiler's
    table to ``OUT/host_profile.txt``); ``check``: only the correctness checks; ``course``: the course's
    timing test (compiled and eager) to ``OUT/course.csv``."""
    import argparse
    import os
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m lab.bench.flash", description=main.__doc__)
    parser.add_argument("mode", choices=("sweep", "check", "course"))
    parser.add_argument("--shapes", nargs="+", default=["1x32x32768x128", "4x32x512x80"], help=_SHAPE_HELP)
    parser.add_argument("--peers", nargs="*", default=["sdpa", "flex"])
    parser.add_argument("--host-shape", default="4x32x512x80", help="shape of the host-cost table ('' skips it)")
    parser.add_argument("--workers", type=int, default=0, help="processes compiling the variants first (0: none)")
    parser.add_argument("--rep-ms", type=float, default=50)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    if args.mode == "course":
        course_timing_table(device=device).to_csv(out / "course.csv", index=False)
        print(pd.read_csv(out / "course.csv").to_string())
        return
    jobs = [parse_shape(s) for s in args.shapes]
    variants = sweep_configs()
    if args.mode == "check":
        variants = {n: (c, ()) for n, (c, _) in variants.items()}
    if args.workers and device.type == "cuda":
        for name, reason in warm_variants(jobs, [*variants, *args.peers], str(device), args.workers):
            print(f"warm-up of {name} failed: {reason}", flush=True)
    ceiling = {dt: matmul_ceiling(dt, device=device) for dt in {dt for _, dt in jobs}} if device.type == "cuda" else {}
    path = out / ("sweep.csv" if args.mode == "sweep" else "check.csv")
    written = []

    def sink(row):
        written.append(row)
        pd.DataFrame(written).to_csv(path, index=False)
        cells = [row["variant"], row["status"], f"err {row.get('rel_err', math.nan):.2e}",
                 *(f"{p} {row[f'{p}_tflops']:.0f}" for p in PASSES if f"{p}_tflops" in row), row.get("note", "")]
        print(row["shape"], row["dtype"], *cells, flush=True)

    if args.mode == "sweep" and args.host_shape:  # first: the short sequence's question is the cheapest to answer
        shape, dt = parse_shape(args.host_shape)
        host, table = host_costs(shape, dt, device=device, rep_ms=args.rep_ms)
        host.to_csv(out / "host.csv", index=False)
        (out / "host_profile.txt").write_text(table)
        print(host.to_string(), flush=True)
    for shape, dt in jobs:
        sweep_shape(shape, dt, variants, args.peers if args.mode == "sweep" else (), device, rep_ms=args.rep_ms,
                    ceiling_tflops=ceiling.get(dt, math.nan), sink=sink)
    if args.mode == "sweep":
        best = best_variants(pd.DataFrame(written))
        best.assign(ceiling_tflops=best["dtype"].map(ceiling)).to_csv(out / "best.csv", index=False)
        print(best.to_string())


if __name__ == "__main__":
    main()
