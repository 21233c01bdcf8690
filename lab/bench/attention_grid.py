"""Attention implementations checked and timed shape by shape (notebook 05's grid, the kernel sweep of
``python -m lab.bench.flash_sweep``).

* :func:`errors_vs_float64`, :func:`correctness_grid`: output and the three gradients against naive attention
  computed in float64 on the same (rounded) inputs;
* :func:`time_passes`: forward, backward (on one retained forward graph) and end-to-end forward+backward of one
  implementation, each by :func:`lab.measure.timing.time_kernel` (do_bench on a GPU) and summarized as the one
  statistic (:func:`lab.measure.verdicts.summarize`: ``<pass>_ms`` the median, ``_spread_ms``, ``_n``); short
  shapes also as CUDA-graph replays, the device's time without the host's launches;
* :func:`time_attention_grid`: every implementation x shape x dtype, one row each, with TFLOP/s
  (:func:`add_tflops`). A configuration an implementation cannot run is ``status="unsupported"`` (the reason in
  ``note``), one it is told to skip ``"skipped"``, out of memory ``"oom"`` with the memory the device had
  (``limit_gib``), never a crash of the grid.

Implementations are named as in :data:`lab.bench.attention.IMPLS`, on ``(batch * heads, seq, d)`` inputs.
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

from lab.accounting.attention import DTYPES, PASSES, attention_flops, naive_attention_totals
from lab.bench.attention import attention_impl, attention_inputs
from lab.bench.progress import progress_bar
from lab.kernels.flash_config import backward_plan, head_chunks
from lab.measure.device import available_memory_bytes, empty_cache, error_summary, is_oom, resolve_device
from lab.measure.results import gpu_label
from lab.measure.timing import graph_replay, time_kernel
from lab.measure.verdicts import summarize
from lab.model.attention import AttentionFn, naive_attention

#: Our own kernels among the implementations: their rows say which kernels ran (``kernel``, ``bwd_kernel``).
OURS = ("triton", "triton_compiled_bwd")

# Said by PyTorch while a correct implementation runs, about nothing this check measures: the autograd
# thread's first cuBLAS call, and Inductor's advice to use TF32 for the fp32 matmuls of a compiled reference.
_BENIGN_WARNINGS = ("there was no current CUDA context", "TensorFloat32 tensor cores for float32 matrix")
_UNSUPPORTED_MARKERS = ("not supported", "no available kernel", "no viable backend")


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


#: The 2.7B model's attention calls (batch 4 of its step, 32 heads of 80 over its 512 tokens), which notebooks 05
#: and 10 both time (the book's ledger compares them).
SHAPE_2_7B = Shape(4, 32, 512, 80)
#: Shapes up to this many tokens are timed as CUDA-graph replays on a GPU (``graph_max_seq``): their kernels take
#: tens of microseconds, so timed eagerly every implementation would be timed by its host's launches instead.
GRAPH_MAX_SEQ = 1024


def unsupported_reason(exc: BaseException) -> str | None:
    """The one-line reason when ``exc`` says that an implementation cannot run this input at all (the Triton
    kernels' input checks, an SDPA backend without a kernel for this dtype, head dimension or device); None
    for any other error, which stays an error."""
    text = str(exc).lower()
    if isinstance(exc, (ValueError, TypeError, RuntimeError, NotImplementedError)) and any(
            m in text for m in _UNSUPPORTED_MARKERS):
        return f"not supported: {error_summary(exc)}"
    return None


def errors_vs_float64(impls: dict[str, AttentionFn], batch: int = 2, seq: int = 128, d: int = 64,
                      dtype: str = "fp32", causal: bool = True, device: torch.device | str = "auto",
                      seed: int = 0) -> pd.DataFrame:
    """Largest absolute error of each implementation's output and dQ, dK, dV against :func:`naive_attention`
    in float64 on the same (rounded) inputs, one row per implementation (``impl``, ``dtype``, ``d``,
    ``seq_len``, ``out``, ``dq``, ``dk``, ``dv``, ``status``, ``note``). An implementation that cannot run this
    input is a row with ``status="unsupported"`` (:func:`unsupported_reason`) and NaN errors."""
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
            rows.append({**row, "status": "unsupported", "note": reason})
            continue
        for w in caught:
            if not any(m in str(w.message) for m in _BENIGN_WARNINGS):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        row.update(zip(["out", "dq", "dk", "dv"],
                       [(g.detach().double().cpu() - r).abs().max().item() for g, r in zip(got, ref)]))
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
    return pd.concat([errors_vs_float64(fns, batch, seq, d, dt, causal, device)
                      for dt, d in progress_bar(grid, "correctness", progress)], ignore_index=True)


# ----------------------------------------------------------------------------------------------------------
# Timing


def summarized(prefix: str, samples_ms: Sequence[float]) -> dict:
    """``{prefix}_ms`` (the median), ``{prefix}_spread_ms`` and ``{prefix}_n`` of ``samples_ms``."""
    s = summarize(samples_ms)
    return {f"{prefix}_ms": s.median, f"{prefix}_spread_ms": s.spread, f"{prefix}_n": s.n}


def time_passes(fn: AttentionFn, q, k, v, dout, causal: bool, device: torch.device, timer: dict,
                passes: Sequence[str] = PASSES, graph: bool = False) -> dict:
    """Row fields of each pass in ``passes`` timed by ``time_kernel(**timer)``: ``fwd`` (the forward), ``bwd``
    (the backward of one retained forward graph) and ``e2e`` (forward + backward in one call), each
    :func:`summarized`. With ``graph`` (CUDA only) also ``fwd_graph_*`` and ``e2e_graph_*``, the forward and
    forward + backward replayed from CUDA graphs, and ``bwd_graph_ms``, their difference: derived, not sampled,
    so it has no spread and ``bwd_graph_n`` 0 (autograd runs a backward on its forward's stream, so a backward
    alone cannot be captured). A step that cannot be captured keeps its eager times and says so in ``note``."""
    out = fn(q, k, v, causal) if "bwd" in passes else None
    steps = {"fwd": lambda: fn(q, k, v, causal),
             "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
             "e2e": lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)}
    row = {}
    for p in passes:
        row.update(summarized(p, time_kernel(steps[p], device, **timer).samples_ms))
        if p == "bwd":
            out = None  # frees the retained graph (the lambda holds it through this name) before e2e builds its own
    if graph:
        try:
            replays = {p: time_kernel(graph_replay(steps[p]), device, **timer).samples_ms for p in ("fwd", "e2e")}
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its eager times
            if is_oom(exc):
                raise
            row["note"] = "timed eagerly only: the step could not be captured in a CUDA graph"
        else:
            row.update(summarized("fwd_graph", replays["fwd"]), **summarized("e2e_graph", replays["e2e"]))
            row.update(bwd_graph_ms=row["e2e_graph_ms"] - row["fwd_graph_ms"], bwd_graph_spread_ms=math.nan,
                       bwd_graph_n=0)
    return row


def kernel_of(name: str, fn: AttentionFn, q, k, v, causal: bool, pass_: str = "fwd") -> str:
    """Which of our kernels runs these inputs' ``pass_`` (``"fwd"`` or ``"bwd"``) under implementation ``name``:
    the implementation's own answer where it carries one (a ``kernel(q, k, v, causal)`` attribute for the
    forward, ``bwd_kernel`` for the backward, as a dispatch between kernels does), else ``"triton"`` for
    :data:`OURS`; ``""`` for a peer's implementation."""
    if name not in OURS:
        return ""
    which = getattr(fn, "kernel" if pass_ == "fwd" else "bwd_kernel", None)
    return which(q, k, v, causal) if callable(which) else "triton"


def _measure(fn: AttentionFn, name: str, shape: Shape, dtype: str, device: torch.device, timer: dict,
             graph: bool, limit_gib: float) -> dict:
    """One configuration's row fields: its passes timed, or why it has none (out of memory, unsupported). A
    shape replayed from CUDA graphs keeps the replays as its times (``timing="graph"``), its eager times as
    ``<pass>_eager_*``."""
    empty_cache()
    try:
        q, k, v, dout = attention_inputs(shape.batch * shape.heads, shape.seq, shape.d, DTYPES[dtype], device)
        fields = {"kernel": kernel_of(name, fn, q, k, v, shape.causal),
                  "bwd_kernel": kernel_of(name, fn, q, k, v, shape.causal, "bwd")}
        fields.update(time_passes(fn, q, k, v, dout, shape.causal, device, timer, graph=graph))
        del q, k, v, dout
    except Exception as exc:  # noqa: BLE001 - out of memory and "cannot run" are rows, anything else a bug
        if is_oom(exc):
            return dict(status="oom", note="out of memory", limit_gib=limit_gib)
        reason = unsupported_reason(exc)
        if reason is None:
            raise
        return dict(status="unsupported", note=reason)
    finally:
        gc.collect()
        empty_cache()
    if "fwd_graph_ms" not in fields:
        return fields
    eager = {k.replace("_", "_eager_", 1): v for k, v in fields.items() if k[:3] in PASSES and "_graph" not in k}
    replayed = {k.replace("_graph", ""): v for k, v in fields.items() if "_graph" in k}
    return {"kernel": fields["kernel"], "bwd_kernel": fields["bwd_kernel"], **eager, **replayed, "timing": "graph"}


def time_attention_grid(impls: Sequence[str] | dict[str, AttentionFn] = ("triton", "pytorch_naive", "sdpa"),
                        shapes: Sequence[Shape] = (), dtypes: Sequence[str] = ("bf16",), warmup_ms: float = 5,
                        rep_ms: float = 20, cpu_steps: int = 5, min_samples: int = 5,
                        device: torch.device | str = "auto", memory_limit_gib: float | None = None,
                        skip: Callable[[str, Shape, str], str | None] | None = None, sweep: str = "",
                        progress: bool = True, graph_max_seq: int = 0) -> pd.DataFrame:
    """Forward, backward and end-to-end latency of each implementation on each shape and dtype, one row each.

    ``impls``: names for :func:`attention_impl` or a dict ``name -> fn(q, k, v, causal)``. Each pass is timed by
    :func:`time_passes` (``cpu_steps`` calls on the CPU; on a GPU do_bench's budgets, at least ``min_samples``
    samples however long a call). On a GPU, shapes of at most ``graph_max_seq`` tokens are timed as CUDA-graph
    replays too, which become their times (``timing="graph"``; the eager ones stay as ``<pass>_eager_*``);
    rows are compared only with rows timed alike. ``pytorch_naive`` configurations whose predicted peak exceeds
    ``memory_limit_gib`` (default 1.25x the GPU's memory) are not attempted (``status="oom"``, ``need_gib``);
    ``skip(impl, shape, dtype)`` may give a reason not to run one (``"skipped"``). Rows carry ``sweep``,
    ``impl``, ``kernel`` and ``bwd_kernel`` (:func:`kernel_of`: which forward and backward ran), the shape,
    ``gpu`` (``"cpu"`` on the CPU), ``timing``, ``status``, ``note``, the passes' times and TFLOP/s
    (:func:`add_tflops`), and for our kernels the backward launch the default config chose (``bwd_mode``: the
    portable kernel's, ``"gluon"`` where the Gluon backward ran) and the head-dimension columns their tiles
    compute (``fwd_columns``, ``bwd_columns``)."""
    device = resolve_device(device) if isinstance(device, str) else device
    fns = dict(impls) if isinstance(impls, dict) else {name: attention_impl(name, device) for name in impls}
    unknown = [dt for dt in dtypes if dt not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtype {unknown[0]!r}; choose one of {', '.join(DTYPES)}")
    limit_gib = available_memory_bytes(device) / 2**30
    if memory_limit_gib is None and device.type == "cuda":
        memory_limit_gib = 1.25 * limit_gib
    timer = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps, min_samples=min_samples)
    gpu = gpu_label() if device.type == "cuda" else "cpu"
    rows = []
    grid = [(dt, shape, name) for dt in dtypes for shape in shapes for name in fns]
    for dt, sh, name in progress_bar(grid, f"attention {sweep}".strip(), progress):
        bh = sh.batch * sh.heads
        row = dict(sweep=sweep, impl=name, kernel="", bwd_kernel="", dtype=dt, batch=sh.batch, heads=sh.heads,
                   seq_len=sh.seq, d=sh.d, causal=sh.causal, gpu=gpu, timing="eager", status="ok", note="")
        for p in PASSES:
            row.update(summarized(p, []))
        if name in OURS:
            row["bwd_mode"] = backward_plan(bh, sh.seq, sh.seq, sh.d, DTYPES[dt], device)[0]
            row.update({f"{p}_columns": sum(head_chunks(sh.d, DTYPES[dt], p, sh.seq, sh.seq)) for p in ("fwd", "bwd")})
        need = naive_attention_totals(bh, sh.seq, sh.d, dt, sh.causal)["peak"] / 2**30
        reason = skip(name, sh, dt) if skip else None
        if reason:
            row.update(status="skipped", note=reason)
        elif name == "pytorch_naive" and memory_limit_gib is not None and need > memory_limit_gib:
            row.update(status="oom", note="not attempted: its predicted peak exceeds the memory", need_gib=need,
                       limit_gib=limit_gib)
        else:
            graph = device.type == "cuda" and sh.seq <= graph_max_seq
            row.update(_measure(fns[name], name, sh, dt, device, timer, graph, limit_gib))
            if row["bwd_kernel"] == "gluon":  # no portable launch ran
                row["bwd_mode"] = "gluon"
        rows.append(row)
    return add_tflops(pd.DataFrame(rows))


def add_tflops(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``<pass>_tflops``: :func:`attention_flops` over the median time, in TFLOP/s, for the passes it
    has times of."""
    df = df.copy()
    for p in [p for p in PASSES if f"{p}_ms" in df.columns]:
        flops = [attention_flops(r.batch, r.seq_len, r.d, bool(r.causal), p, heads=r.heads) for r in df.itertuples()]
        df[f"{p}_tflops"] = np.asarray(flops, dtype=float) / (df[f"{p}_ms"].to_numpy(dtype=float) * 1e-3) / 1e12
    return df
