"""Benchmarks of the LM-head loss: the fused op against materialized and chunked PyTorch, Liger and CCE.

The implementations (``impl`` column), each ``fn(hidden (N, D), weight (V, D), targets (N,)) -> mean loss``:

* ``fused``: :func:`lab.kernels.fused_cross_entropy.fused_linear_cross_entropy` (gradients in the forward,
  cuBLAS matmuls over token chunks: ``6 N D V`` FLOPs, one chunk of logits in memory); ``fused_chunk<C>``
  the same with ``chunk_tokens=C`` (the chunk size's trade of memory for time);
* ``fused_recompute``: the same op with ``grad_in_forward=False`` (Triton tiles, the logits recomputed in
  the backward: ``8 N D V``, the least memory);
* ``torch``: :func:`materialized_loss`, ``F.cross_entropy((hidden @ weight.T).float(), targets)`` in eager
  PyTorch: bf16 logits, their fp32 copy, the fp32 log-softmax and its gradient all exist at once;
* ``torch_compiled``: the same function through ``torch.compile`` (Inductor fuses the cross-entropy; the
  bf16 logits and their gradient remain);
* ``torch_chunked``: :class:`ChunkedLinearCrossEntropy`, Liger's approach in plain PyTorch: tokens in chunks,
  one chunk's logits materialized at a time, gradients computed in the forward and scaled in the backward;
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (the same approach, its Triton cross-entropy
  kernel), and ``cce``: Cut Cross-Entropy's ``linear_cross_entropy`` with its defaults (recompute in the
  backward, gradient entries below its ``filter_eps`` skipped: approximate). Both are optional: where they
  do not import, their rows say ``status="not installed"``; on the CPU ``"skipped"`` (CUDA kernels).

Every implementation is credited with the same useful work, ``6 N D V`` FLOPs (the three GEMMs of the
materialized loss), so ``tflops`` compares speed, not work done. Timing: ``triton.testing.do_bench`` median
on CUDA (L2 flushed between calls), the host timer of :mod:`lab.measure.timing` on the CPU. With ``check``
each row also gives its loss's and gradients' relative error against an fp32 reference.

Command line (one row per shape and implementation, a markdown table, optionally the CSV)::

    python -m lab.bench.fused_loss --shapes 151936x4096x32768 10000x2560x16384 --check --rep-ms 600 \
        --results-dir results
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from lab import cli
from lab.accounting.attention import DTYPES  # fp32, bf16, fp16 of the one dtype table
from lab.dtypes import element_size
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device, synchronize
from lab.measure.results import save_results
from lab.measure.timing import time_kernel
from lab.measure.verdicts import MIN_SAMPLES, summarize

IMPLS = ("fused", "fused_recompute", "torch", "torch_compiled", "torch_chunked", "liger", "cce")
#: Optional peers: impl -> the package that must import.
PEERS = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}
COLUMNS = ["impl", "vocab", "d_model", "tokens", "dtype", "fwdbwd_ms", "fwdbwd_spread_ms", "fwdbwd_n",
           "fwdbwd_samples_ms", "fwd_ms",
           "peak_extra_gib", "peak_with_grads_gib", "tflops", "loss_rel_err", "dh_rel_err", "dw_rel_err",
           "status", "error", "device"]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PeerUnavailable(RuntimeError):
    """An optional peer implementation that cannot run here; ``status`` is the row's status."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def loss_flops(tokens: int, d_model: int, vocab: int) -> float:
    """Useful matmul FLOPs of one forward+backward of the LM-head loss: ``6 N D V`` (logits 2, d_hidden 2,
    d_weight 2; multiply and add counted as 2). The fused recompute backward actually does ``8 N D V``."""
    return 6.0 * tokens * d_model * vocab


# ----------------------------------------------------------------------------------------- the baselines
def materialized_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                      ignore_index: int = -100) -> torch.Tensor:
    """The loss as ``lab.model.transformer.LMHead`` computes it without fusion: logits in the input dtype,
    cross-entropy on their fp32 copy. Returns the fp32 loss."""
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), targets, reduction=reduction, ignore_index=ignore_index)


def liger_chunk_tokens(tokens: int, d_model: int, vocab: int) -> int:
    """Liger-Kernel's chunk size: ``next_power_of_2(ceil(N / ceil(V / D)))`` tokens, so that one chunk's
    logits are about the size of the hidden states (1024 tokens at N = 32768, D = 4096, V = 151,936)."""
    chunks = math.ceil(vocab / d_model)
    return 1 << max(0, math.ceil(tokens / chunks) - 1).bit_length()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Liger-style chunked loss in plain PyTorch (cuBLAS GEMMs, eager elementwise ops).

    ``apply(hidden, weight, targets, reduction, ignore_index, chunk_tokens)`` with reduction "mean" or "sum".
    Forward, per chunk of ``chunk_tokens`` tokens: logits ``h_c @ W^T`` in the input dtype, their fp32 copy,
    logsumexp and target logit, then ``dZ = softmax - onehot`` (scaled for the reduction, 0 at ignored
    targets) cast to the input dtype, ``d_hidden[c] = dZ @ W`` and ``d_weight += dZ^T @ h_c``. Like Liger,
    ``d_weight`` is accumulated in the input dtype (one rounding per chunk, each chunk's product summed in
    fp32 by the GEMM). Backward multiplies the stored gradients by the upstream gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, reduction="mean", ignore_index=-100, chunk_tokens=None):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"the chunked loss supports reduction 'mean' or 'sum', got {reduction!r}")
        n, d = hidden.shape
        chunk = chunk_tokens or liger_chunk_tokens(n, d, weight.shape[0])
        valid = targets != ignore_index
        count = valid.sum()
        scale = 1.0 / count.clamp_min(1) if reduction == "mean" else torch.ones((), device=hidden.device)
        compute = torch.promote_types(hidden.dtype, torch.float32)  # fp32 for 16-bit inputs, as F.cross_entropy
        losses = torch.zeros(n, dtype=compute, device=hidden.device)
        d_hidden, d_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        for r0 in range(0, n, chunk):
            h, t, ok = hidden[r0:r0 + chunk], targets[r0:r0 + chunk], valid[r0:r0 + chunk]
            logits = (h @ weight.T).to(compute)
            lse = torch.logsumexp(logits, dim=1)
            safe_t = torch.where(ok, t, 0).unsqueeze(1)
            losses[r0:r0 + chunk] = torch.where(ok, lse - logits.gather(1, safe_t).squeeze(1), 0.0)
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the fp32 logits
            grad.scatter_add_(1, safe_t, -ok.to(compute).unsqueeze(1))
            grad.mul_((ok.to(compute) * scale).unsqueeze(1))
            grad = grad.to(hidden.dtype)
            d_hidden[r0:r0 + chunk] = grad @ weight
            d_weight.addmm_(grad.T, h)
        ctx.save_for_backward(d_hidden, d_weight)
        total = losses.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss):
        d_hidden, d_weight = ctx.saved_tensors
        return d_hidden * grad_loss, d_weight * grad_loss, None, None, None, None


def chunked_loss(hidden, weight, targets, reduction: str = "mean", ignore_index: int = -100,
                 chunk_tokens: int | None = None) -> torch.Tensor:
    """:class:`ChunkedLinearCrossEntropy` as a function (``chunk_tokens`` None: Liger's rule)."""
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, reduction, ignore_index, chunk_tokens)


def _peer(name: str, device: torch.device | None) -> LossFn:
    """Liger's or CCE's loss as ``fn(hidden, weight, targets)``; :class:`PeerUnavailable` where it cannot run."""
    if device is not None and device.type != "cuda":
        raise PeerUnavailable("skipped", f"{name} runs CUDA kernels only (device {device})")
    try:  # optional dependencies: imported only when asked for
        if name == "liger":
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            liger = LigerFusedLinearCrossEntropyLoss()
            return lambda h, w, t: liger(w, h, t)  # Liger takes the weight first
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, t: linear_cross_entropy(h, w, t)
    except ImportError as exc:
        raise PeerUnavailable("not installed", f"{PEERS[name]} is not installed ({exc})") from None


_COMPILED: dict[str, LossFn] = {}


def loss_impl(name: str, device: torch.device | None = None) -> LossFn:
    """The loss function ``fn(hidden, weight, targets)`` (mean reduction) called ``name`` in the tables: one
    of :data:`IMPLS` or ``fused_chunk<tokens>``. The Triton op and the peers are imported only when asked for;
    a peer that cannot run on ``device`` (or at all) raises :class:`PeerUnavailable`."""
    chunk = re.fullmatch(r"fused_chunk(\d+)", name)
    if name in ("fused", "fused_recompute") or chunk:
        # Triton, an optional dependency: only when asked for
        from lab.kernels.fused_cross_entropy import fused_linear_cross_entropy

        options = {"grad_in_forward": False} if name == "fused_recompute" else \
            {"chunk_tokens": int(chunk.group(1))} if chunk else {}
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, **options)
    if name == "torch":
        return materialized_loss
    if name == "torch_compiled":
        if name not in _COMPILED:
            # static shapes: each benchmarked shape gets its own specialised graph, as in a training run
            _COMPILED[name] = torch.compile(materialized_loss, dynamic=False)
        return _COMPILED[name]
    if name == "torch_chunked":
        return chunked_loss
    if name in PEERS:
        return _peer(name, device)
    raise ValueError(f"unknown loss implementation {name!r}; choose one of {', '.join(IMPLS)} or fused_chunk<N>")


# ------------------------------------------------------------------------------------------- measurement
def make_inputs(vocab: int, d_model: int, tokens: int, dtype: str = "bf16", device: torch.device | str = "cpu",
                seed: int = 0):
    """hidden (tokens, d_model) ~ N(0, 1), weight (vocab, d_model) ~ N(0, 1/d_model) (logits of std ~1), both
    requiring grad, and uniform random targets. Generated on ``device`` directly (no host copy of GBs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = DTYPES[dtype]
    hidden = torch.randn(tokens, d_model, generator=gen, device=device, dtype=dt).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=gen, device=device, dtype=dt) / d_model**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    return hidden, weight, targets


@contextlib.contextmanager
def _ieee_fp32_matmuls():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def reference_loss_and_grads(hidden, weight, targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 mean loss and fp32 (d_hidden, d_weight) of fp32 copies of the inputs, IEEE fp32 matmuls (no TF32),
    through :func:`chunked_loss` (one chunk of logits at a time, so it fits wherever the inputs do)."""
    with _ieee_fp32_matmuls():
        h = hidden.detach().float().requires_grad_()
        w = weight.detach().float().requires_grad_()
        loss = chunked_loss(h, w, targets)
        d_hidden, d_weight = torch.autograd.grad(loss, (h, w))
    return loss.detach(), d_hidden, d_weight


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` (Frobenius norms, fp32)."""
    return ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def peak_extra_bytes(fn: LossFn, hidden, weight, targets) -> tuple[int, int]:
    """Peak CUDA memory allocated during one forward+backward of ``fn`` beyond what existed before (the
    inputs): ``(beyond the inputs and the outputs d_hidden, d_weight, beyond the inputs only)`` in bytes."""
    device = hidden.device
    synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    grads = torch.autograd.grad(fn(hidden, weight, targets), (hidden, weight))
    synchronize(device)
    outputs = sum(g.numel() * g.element_size() for g in grads)
    with_grads = torch.cuda.max_memory_allocated(device) - base
    return int(with_grads - outputs), int(with_grads)


def benchmark_loss(impl: str, vocab: int, d_model: int, tokens: int, dtype: str = "bf16",
                   device: torch.device | str = "auto", fn: LossFn | None = None, warmup_ms: float = 25,
                   rep_ms: float = 100, cpu_steps: int = 5, seed: int = 0, record_errors: bool = False,
                   reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   timed: bool = True) -> dict:
    """One row: forward and forward+backward time of the loss ``impl`` (or ``fn``, named ``impl``) and its
    peak extra memory at one shape.

    ``fwd_ms``: median ms of the forward with autograd recording (what a training step pays; for ``fused``,
    ``torch_chunked`` and ``liger`` it includes the gradients). ``fwdbwd_ms``: median ms of forward +
    ``torch.autograd.grad`` for hidden and weight, with its spread, count and samples (a JSON list).
    ``timed=False`` measures no time: one forward+backward for the errors (where Triton runs interpreted on a
    CPU, a time says nothing and costs minutes). ``peak_extra_gib`` / ``peak_with_grads_gib``:
    :func:`peak_extra_bytes` in GiB (NaN on the CPU). ``tflops``: :func:`loss_flops` / ``fwdbwd_ms``.
    ``reference`` (:func:`reference_loss_and_grads` of the same inputs): the ``*_rel_err`` columns. One
    untimed forward+backward runs first (compilation, Triton JIT). Out-of-memory anywhere gives
    ``status="oom"``; a peer that cannot run its :class:`PeerUnavailable` status; other errors are raised, or
    recorded with ``status="error"`` when ``record_errors``.
    """
    device = resolve_device(device) if isinstance(device, str) else device
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    row = {c: math.nan for c in COLUMNS} | dict(impl=impl, vocab=vocab, d_model=d_model, tokens=tokens, dtype=dtype,
                                                status="ok", error="", device=str(device))
    hidden = weight = targets = None
    try:
        loss_fn = fn if fn is not None else loss_impl(impl, device)
        hidden, weight, targets = make_inputs(vocab, d_model, tokens, dtype, device, seed)

        def fwdbwd():
            return torch.autograd.grad(loss_fn(hidden, weight, targets), (hidden, weight))

        if timed:
            with warnings.catch_warnings():  # Inductor's notice that it split the compiled loss's reduction
                warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled", category=UserWarning)
                fwdbwd()  # compile / JIT / autotune outside the measurements
        if reference is not None:
            loss = loss_fn(hidden, weight, targets)
            d_hidden, d_weight = torch.autograd.grad(loss, (hidden, weight))
            row["loss_rel_err"] = abs(loss.item() - reference[0].item()) / abs(reference[0].item())
            row["dh_rel_err"], row["dw_rel_err"] = rel_err(d_hidden, reference[1]), rel_err(d_weight, reference[2])
            loss = d_hidden = d_weight = None
        if device.type == "cuda":
            extra, with_grads = peak_extra_bytes(loss_fn, hidden, weight, targets)
            row["peak_extra_gib"], row["peak_with_grads_gib"] = extra / 2**30, with_grads / 2**30
        if timed:
            # a loss of 200 ms in a 100 ms budget would give do_bench one sample: ask for the rule's minimum
            timer = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_warmup=1, cpu_steps=cpu_steps,
                         min_samples=MIN_SAMPLES)
            row["fwd_ms"] = time_kernel(lambda: loss_fn(hidden, weight, targets), device, **timer).median_ms
            timing = summarize(time_kernel(fwdbwd, device, **timer).samples_ms)
            row.update(fwdbwd_ms=timing.median, fwdbwd_spread_ms=timing.spread, fwdbwd_n=timing.n,
                       fwdbwd_samples_ms=json.dumps([round(x, 4) for x in timing.samples]))
            row["tflops"] = loss_flops(tokens, d_model, vocab) / (row["fwdbwd_ms"] * 1e-3) / 1e12
        else:
            row["status"] = "not timed"
    except PeerUnavailable as exc:
        row.update(status=exc.status, error=str(exc))
    except Exception as exc:
        if not (is_oom(exc) or record_errors):
            raise
        row.update(status="oom" if is_oom(exc) else "error", error=error_summary(exc))
    finally:
        hidden = weight = targets = None  # the closures above hold these cells: free the GBs before the next row
        empty_cache()
    return row


def sweep(impls: Sequence[str] = IMPLS, shapes: Iterable[tuple[int, int, int]] = ((10_000, 768, 4096),),
          dtypes: Sequence[str] = ("bf16",), device: torch.device | str = "auto", progress: bool = False,
          check: bool = False, untimed: Sequence[str] = (), **kwargs) -> pd.DataFrame:
    """:func:`benchmark_loss` for every ``(vocab, d_model, tokens)`` in ``shapes``, dtype and implementation.
    ``check``: each shape's :func:`reference_loss_and_grads` first, and every row's errors against it;
    ``untimed``: implementations measured for their errors only (``status`` "not timed").
    Returns a DataFrame with one row per measurement and the columns of :data:`COLUMNS`; keyword arguments go
    to :func:`benchmark_loss`."""
    device = resolve_device(device) if isinstance(device, str) else device
    rows = []
    for vocab, d_model, tokens in shapes:
        for dtype in dtypes:
            reference = None
            if check:
                reference = reference_loss_and_grads(*make_inputs(vocab, d_model, tokens, dtype, device,
                                                                  kwargs.get("seed", 0)))
            for impl in impls:
                rows.append(benchmark_loss(impl, vocab, d_model, tokens, dtype, device, reference=reference,
                                           timed=impl not in untimed, **kwargs))
                if progress:  # every number of the row: a run cut short still says what it measured
                    r = rows[-1]
                    print(f"{impl:>18} V={vocab} D={d_model} N={tokens} {dtype}: fwdbwd {r['fwdbwd_ms']:.2f} ms, "
                          f"fwd {r['fwd_ms']:.2f} ms, extra {r['peak_extra_gib']:.3f} GiB "
                          f"({r['peak_with_grads_gib']:.3f} with the gradients), errors loss {r['loss_rel_err']:.1e} "
                          f"dh {r['dh_rel_err']:.1e} dw {r['dw_rel_err']:.1e}, {r['status']} {r['error'][:200]}",
                          flush=True)
            reference = None
            empty_cache()
    return pd.DataFrame(rows, columns=COLUMNS)


def add_ratios(df: pd.DataFrame, baseline: str = "torch_compiled") -> pd.DataFrame:
    """Add ``time_vs_<baseline>`` (fwdbwd_ms / the baseline's at the same shape and dtype) and
    ``memory_vs_<baseline>`` (peak_extra_gib ratio) columns; NaN where the baseline has no ok row."""
    key = ["vocab", "d_model", "tokens", "dtype"]
    base = (df[(df["impl"] == baseline) & (df["status"] == "ok")].set_index(key)[["fwdbwd_ms", "peak_extra_gib"]]
            .add_suffix("_base"))
    out = df.join(base, on=key)
    df = df.copy()
    df[f"time_vs_{baseline}"] = out["fwdbwd_ms"] / out["fwdbwd_ms_base"]
    df[f"memory_vs_{baseline}"] = out["peak_extra_gib"] / out["peak_extra_gib_base"]
    return df


# ----------------------------------------------------------------------------------- closed-form memory
def fused_memory_model(tokens: int, d_model: int, vocab: int, dtype: str = "bf16",
                       grad_in_forward: bool = True) -> dict[str, float]:
    """Closed-form extra bytes of the fused loss on a GPU (its transient buffers with the current settings and
    compiled tile configs; the d_hidden/d_weight outputs not counted). Returns term -> bytes, with ``"peak"``
    the largest phase."""
    # Triton, an optional dependency: only when asked for
    from lab.kernels import fused_cross_entropy as fce
    from lab.kernels import fused_cross_entropy_kernels as K  # optional dependency (Triton)

    dt = DTYPES[dtype]
    e = element_size(dt)
    n, d, v = tokens, d_model, vocab
    if grad_in_forward:
        plan = fce.chunk_plan(n, d, v, dt)
        terms = {"logits chunk": min(plan.rows, n) * v * e,
                 "fp32 d_weight accumulator": v * d * 4 if plan.fp32_accumulator else 0,
                 "per-token vectors": 3 * n * 4}
        terms["peak"] = sum(terms.values())
        return terms
    tiles = math.ceil(v / K.config("lse", dt, interpret=False)["BLOCK_N"])
    width = fce.chunk_columns(n, v, dt, interpret=False)
    terms = {"forward partials": n * tiles * 4, "saved lse": n * 4, "dZ scratch": n * width * e,
             "fp32 d_hidden accumulator": n * d * 4 if v > width else 0, "per-token vectors": 4 * n * 4}
    terms["peak"] = max(terms["forward partials"] + terms["saved lse"],
                        terms["saved lse"] + terms["dZ scratch"] + terms["fp32 d_hidden accumulator"]
                        + terms["per-token vectors"])
    return terms


def materialized_memory_model(tokens: int, vocab: int, dtype: str = "bf16") -> dict[str, float]:
    """Closed-form extra bytes of eager :func:`materialized_loss` (its ``N x V`` tensors only). Forward: the
    logits, their fp32 copy and the fp32 log-softmax at once. Backward: while the log-softmax backward runs,
    its saved output, the NLL gradient and its own result (three fp32 ``N x V``)."""
    e = element_size(dtype)
    nv = tokens * vocab
    forward = nv * e + nv * 4 + nv * 4
    backward = 3 * nv * 4
    return {"forward": forward, "backward": backward, "peak": max(forward, backward)}


# ------------------------------------------------------------------------------------------ command line
def _shape(text: str) -> tuple[int, int, int]:
    try:
        vocab, d_model, tokens = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected VOCABxD_MODELxTOKENS, e.g. 151936x4096x32768, got {text!r}")
    return vocab, d_model, tokens


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m lab.bench.fused_loss",
                   description="Time the LM-head loss (forward+backward) and its peak extra memory: the fused op, "
                               "materialized PyTorch (eager, compiled), chunked PyTorch, Liger, CCE.")
    p.add_argument("--shapes", nargs="+", type=_shape, default=[(151_936, 4096, 32_768), (10_000, 2560, 16_384)],
                   metavar="VxDxN", help="vocabulary x width x tokens")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), help=f"{', '.join(IMPLS)} or fused_chunk<N>")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--check", action="store_true", help="errors against an fp32 reference (IEEE matmuls)")
    p.add_argument("--warmup-ms", type=float, default=25)
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:<index>")
    p.add_argument("--results-dir", default=None, help="also save the rows as <dir>/fused_loss.csv")
    p.add_argument("--source", default="lab.bench.fused_loss",
                   help="the source the saved rows are tagged with (10_fastest_step: the rows notebook 10 replays)")
    return p


def loss_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for impl in args.impls:
        if impl not in IMPLS and not re.fullmatch(r"fused_chunk\d+", impl):
            raise cli.UsageError(f"unknown --impls {impl!r}; choose from {', '.join(IMPLS)} or fused_chunk<N>")
    df = add_ratios(sweep(args.impls, args.shapes, (args.dtype,), args.device, progress=True, check=args.check,
                          warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, record_errors=True))
    shown = ["impl", "vocab", "d_model", "tokens", "fwdbwd_ms", "time_vs_torch_compiled", "peak_extra_gib",
             "peak_with_grads_gib", "loss_rel_err", "dh_rel_err", "dw_rel_err", "status"]
    print(df[shown].dropna(axis=1, how="all").to_markdown(index=False, floatfmt=".4g"))
    if args.results_dir:
        path = save_results(df, "fused_loss", args.results_dir, params={k: str(v) for k, v in vars(args).items()},
                            source=args.source)
        print(f"rows written to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.bench.fused_loss``: :func:`sweep` from the command line, with one-line errors."""
    return cli.run(loss_main, argv, prog="python -m lab.bench.fused_loss")


if __name__ == "__main__":
    raise SystemExit(main())
