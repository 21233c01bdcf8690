"""FlashAttention against the baselines (notebook 05): correctness against float64, forward / backward /
end-to-end latency of every implementation on a grid of shapes (``triton.testing.do_bench``; median, mean,
standard deviation and sample count of each pass kept), TFLOP/s, speedups with noise-aware verdicts, the
performance goals, and the course's timing test.

Implementations are named as in ``results/flash_benchmark.csv`` (:data:`lab.book.attention.bench.IMPLS`):
``triton``, ``pytorch_flash`` (the tiled PyTorch FlashAttention-2), ``pytorch_naive``, ``sdpa`` (the default
backend), ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``flex`` (compiled FlexAttention). Inputs are
``(batch * heads, seq, d)``. The Triton kernels' own variants (tiles, backward launch modes) are swept by
:mod:`lab.book.flash.sweep`.

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

from lab.bench.progress import progress_bar
from lab.book.attention.bench import attention_impl, attention_inputs
from lab.book.attention.costs import DTYPES, PASSES, attention_flops, naive_attention_totals
from lab.kernels.flash_config import backward_plan, block_d, head_chunks
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device
from lab.measure.results import gpu_label
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
        return f"not supported: {error_summary(exc)}"
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
    q, k, v, dout = attention_inputs(bh, seq, d, DTYPES[dtype], device)
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
    ``gpu`` (``"cpu"`` on the CPU), ``status`` and ``note``; ``triton`` rows also name the backward launch
    mode the default config chose for the shape on this device (``bwd_mode``, ``backward_plan``).
    """

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
        if name == "triton":
            row["bwd_mode"] = backward_plan(bh, sh.seq, sh.seq, sh.d, DTYPES[dt], device)[0]
            for p in ("fwd", "bwd"):  # the head-dimension columns its tiles compute (split or masked)
                row[f"{p}_columns"] = sum(head_chunks(sh.d, DTYPES[dt], p, sh.seq, sh.seq))
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
                    row.update(status="oom", note=f"out of memory in {row.get('phase')}: {error_summary(exc)}")
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


def kernel_columns(row, direction: str) -> int:
    """The head-dimension columns the Triton kernels compute for ``row``'s shape in ``direction`` (``"fwd"``
    or ``"bwd"``): the row's ``<direction>_columns`` where its table recorded them, else the default
    config's choice for its dtype and length on the device that measured it (``gpu``; ``"cpu"``: the
    interpreter, which never splits): two power-of-two chunks summing to d where d is split, one masked
    power-of-two tile otherwise (:func:`lab.kernels.flash_config.splits_head_dim`); without a dtype or a
    length, one masked tile."""
    recorded = row.get(f"{direction}_columns")
    if recorded is not None and recorded == recorded:
        return int(recorded)
    d, seq = int(row["d"]), row.get("seq_len")
    if row.get("dtype") in DTYPES and seq is not None and seq == seq:
        return sum(head_chunks(d, DTYPES[row["dtype"]], direction, int(seq), int(seq),
                               interpreted=row.get("gpu") == "cpu"))
    return block_d(d)


def run_flash_benchmark(sweeps: dict[str, dict], **common) -> pd.DataFrame:
    """:func:`run_flash_grid` once per named sweep (``{"lm": dict(impls=..., shapes=..., dtypes=...), ...}``,
    each dict's keywords over ``common``'s), rows labelled by the ``sweep`` column, in one table."""
    tables = [run_flash_grid(**{**common, **kwargs, "sweep": name}) for name, kwargs in sweeps.items()]
    return pd.concat(tables, ignore_index=True)


def add_tflops(df: pd.DataFrame) -> pd.DataFrame:
    """Add ``fwd_tflops``, ``bwd_tflops``, ``e2e_tflops``: :func:`attention_flops` / median time, in TFLOP/s (for
    the passes ``df`` has times of)."""
    df = df.copy()
    for p in [p for p in PASSES if f"{p}_ms" in df.columns]:
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
    from lab.kernels import flash_triton as flash  # Triton, an optional dependency

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
