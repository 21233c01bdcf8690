"""FlashAttention against the baselines (notebook 05): correctness against float64, forward / backward /
end-to-end latency of every implementation on a grid of shapes (``triton.testing.do_bench``; median, mean,
standard deviation and sample count of each pass kept; short shapes also as CUDA-graph replays), TFLOP/s, and
the course's timing test. Speedups, verdicts and goals on these rows are :mod:`lab.book.flash.goals`'.

Implementations are named as in ``results/flash_benchmark.csv`` (:data:`lab.bench.attention.IMPLS`):
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
from lab.bench.attention import attention_impl, attention_inputs
from lab.accounting.attention import DTYPES, PASSES, attention_flops, naive_attention_totals
from lab.kernels.flash_config import backward_plan, block_d, head_chunks
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device
from lab.measure.results import gpu_label
from lab.measure.timing import Timing, graph_replay, time_kernel
from lab.model.attention import AttentionFn, naive_attention


@dataclass(frozen=True)
class Shape:
    """One attention problem: ``batch x heads`` sequences of ``seq`` tokens, head dimension ``d``."""

    batch: int
    heads: int
    seq: int
    d: int
    causal: bool = True

    @classmethod
    def of(cls, row) -> Shape:
        """The shape of a table row (``batch``, ``heads``, ``seq_len``, ``d``, ``causal``)."""
        return cls(int(row["batch"]), int(row["heads"]), int(row["seq_len"]), int(row["d"]), bool(row["causal"]))

    @property
    def label(self) -> str:
        """``"8x16x2048x128 full"``: batch x heads x tokens x head dim, `` full`` without the causal mask."""
        return f"{self.batch}x{self.heads}x{self.seq}x{self.d}{'' if self.causal else ' full'}"


#: LM-like shapes (batch x heads >= 16, 1k-16k tokens, d 64/80/128, causal and not), the leaderboard model's
#: attention (32 heads of 128 over 32k tokens) and the 2.7B model's (4 x 32 heads of 80 over 512 tokens): the
#: goals' grid.
LM_SHAPES = (Shape(1, 16, 16384, 64), Shape(4, 32, 2048, 80), Shape(1, 32, 4096, 80, False), Shape(8, 16, 2048, 128),
             Shape(8, 16, 2048, 128, False), Shape(1, 16, 8192, 128), Shape(2, 16, 4096, 64, False),
             Shape(1, 32, 32768, 128), Shape(4, 32, 512, 80))
#: Shapes up to this many tokens are timed as CUDA-graph replays on a GPU (``timing="graph"``): their kernels take
#: tens of microseconds, so timed eagerly every implementation would be timed by its host's launches instead.
GRAPH_MAX_SEQ = 1024
#: Samples each pass of the goal grid gets at least: do_bench fits as many calls as its budget holds, so at 32k
#: tokens (70 ms a forward + backward) a pass would get one or two, too few for a spread and so for a verdict.
MIN_SAMPLES = 5
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


def _measure_flash(fn: AttentionFn, bh, seq, d, dtype, causal, device, timer_kwargs, row, graph=False) -> None:
    q, k, v, dout = attention_inputs(bh, seq, d, DTYPES[dtype], device)
    row["phase"] = "forward"
    _record(row, "fwd", time_kernel(lambda: fn(q, k, v, causal), device, **timer_kwargs))
    row["phase"] = "backward"
    out = fn(q, k, v, causal)
    _record(row, "bwd", time_kernel(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device,
                                    **timer_kwargs))
    out = None  # free the retained graph (held through the lambda's closure) before end-to-end builds its own
    row["phase"] = "end-to-end"
    e2e = lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)  # noqa: E731
    _record(row, "e2e", time_kernel(e2e, device, **timer_kwargs))
    row["timing"] = "eager"
    if graph:
        row["phase"] = "CUDA-graph replay"
        try:
            replays = {p: time_kernel(graph_replay(step), device, **timer_kwargs)
                       for p, step in (("fwd", lambda: fn(q, k, v, causal)), ("e2e", e2e))}
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its eager times
            if is_oom(exc):
                raise
            row["note"] = f"timed eagerly: the CUDA-graph capture failed ({error_summary(exc)})"
            return
        row.update({f"{p}_eager_ms": row[f"{p}_ms"] for p in PASSES}, timing="graph")
        row.update(graph_times(replays["fwd"], replays["e2e"]))


def graph_times(fwd: Timing, e2e: Timing) -> dict:
    """The row fields of CUDA-graph replays of the forward and of forward+backward: ``{pass}_ms`` (median),
    ``_mean_ms``, ``_std_ms``, ``_n`` for fwd and e2e, and for the backward their differences (a backward alone
    is not captured: autograd would run it behind a forward outside the graph), its spread that of a difference
    of independent means (standard deviations added in quadrature) and its samples the fewer of the two."""
    row = {}
    _record(row, "fwd", fwd)
    _record(row, "e2e", e2e)
    row.update(bwd_ms=e2e.median_ms - fwd.median_ms, bwd_mean_ms=e2e.mean_ms - fwd.mean_ms,
               bwd_std_ms=math.hypot(e2e.std_ms, fwd.std_ms), bwd_n=min(len(fwd.samples_ms), len(e2e.samples_ms)))
    return row


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
                   progress: bool = True, graph_max_seq: int = 0, min_samples: int = 1) -> pd.DataFrame:
    """Forward, backward and end-to-end (forward+backward) latency of each attention implementation on each
    shape and dtype.

    ``impls`` are names for :func:`attention_impl` or a dict ``name -> fn(q, k, v, causal)``. Inputs are
    ``(batch*heads, seq, d)``. Each pass is timed with :func:`lab.measure.timing.time_kernel` (do_bench on
    CUDA); ``{pass}_ms`` is the median, ``{pass}_mean_ms``, ``{pass}_std_ms`` and ``{pass}_n`` the mean,
    standard deviation and number of samples (what a verdict needs; at least ``min_samples`` on a GPU, however
    long a call). Backward reuses one forward's graph.
    On a GPU, shapes of at most ``graph_max_seq`` tokens (e.g. :data:`GRAPH_MAX_SEQ`; 0: none) are then timed
    again as CUDA-graph replays, which replace those times (:func:`graph_times`; the eager medians stay as
    ``{pass}_eager_ms``); ``timing`` says which (``"graph"`` or ``"eager"``), and only rows timed alike are
    compared.
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
    timer_kwargs = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps, min_samples=min_samples)
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
                _measure_flash(fns[name], bh, sh.seq, sh.d, dt, sh.causal, device, timer_kwargs, row,
                               graph=device.type == "cuda" and sh.seq <= graph_max_seq)
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
