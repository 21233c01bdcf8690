"""Benchmarks of the LM-head loss: fused Triton kernels against materialized and chunked PyTorch.

The implementations (``impl`` column), each ``fn(hidden (N, D), weight (V, D), targets (N,)) -> mean loss``:

* ``fused``: :func:`lab.kernels.fused_cross_entropy.fused_linear_cross_entropy` (tiled forward, recompute
  backward: ``8 N D V`` matmul FLOPs, no logits in memory);
* ``fused_grad_in_forward``: the same with ``grad_in_forward=True`` (``6 N D V``, gradients held from the
  forward to the backward, an fp32 ``V x D`` accumulator during the forward);
* ``torch``: :func:`materialized_loss`, ``F.cross_entropy((hidden @ weight.T).float(), targets)`` in eager
  PyTorch: bf16 logits, their fp32 copy, the fp32 log-softmax and its gradient all exist at once;
* ``torch_compiled``: the same function through ``torch.compile`` (Inductor fuses the cross-entropy; the
  bf16 logits and their gradient remain);
* ``torch_chunked``: :class:`ChunkedLinearCrossEntropy`, Liger's approach in plain PyTorch: tokens in chunks,
  one chunk's logits materialized at a time, gradients computed in the forward and scaled in the backward.

Every implementation is credited with the same useful work, ``6 N D V`` FLOPs (the three GEMMs of the
materialized loss), so ``tflops`` compares speed, not work done. Timing: ``triton.testing.do_bench`` median
on CUDA (L2 flushed between calls), the host timer of :mod:`lab.measure.timing` on the CPU.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Iterable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from lab.bench.attention_costs import DTYPES  # fp32, bf16, fp16 of the one dtype table
from lab.dtypes import element_size
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device, synchronize

IMPLS = ("fused", "fused_grad_in_forward", "torch", "torch_compiled", "torch_chunked")
COLUMNS = ["impl", "vocab", "d_model", "tokens", "dtype", "fwdbwd_ms", "fwd_ms", "peak_extra_gib", "tflops",
           "status", "error", "device"]
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


_COMPILED: dict[str, LossFn] = {}


def loss_impl(name: str) -> LossFn:
    """The loss function ``fn(hidden, weight, targets)`` (mean reduction) called ``name`` in the tables
    (one of :data:`IMPLS`). The Triton op is imported only when asked for."""
    if name in ("fused", "fused_grad_in_forward"):
        from lab.kernels.fused_cross_entropy import fused_linear_cross_entropy

        grad_in_forward = name == "fused_grad_in_forward"
        return lambda h, w, t: fused_linear_cross_entropy(h, w, t, grad_in_forward=grad_in_forward)
    if name == "torch":
        return materialized_loss
    if name == "torch_compiled":
        if name not in _COMPILED:
            _COMPILED[name] = torch.compile(materialized_loss)
        return _COMPILED[name]
    if name == "torch_chunked":
        return chunked_loss
    raise ValueError(f"unknown loss implementation {name!r}; choose one of {', '.join(IMPLS)}")


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


def time_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_steps: int = 3) -> float:
    """Median milliseconds per call of ``fn`` (:func:`lab.measure.timing.time_kernel`: do_bench on CUDA, the
    host timer with one warm-up and ``cpu_steps`` timed calls on the CPU)."""
    from lab.measure.timing import time_kernel

    return time_kernel(fn, device, warmup_ms, rep_ms, cpu_warmup=1, cpu_steps=cpu_steps).median_ms


def peak_extra_bytes(fn: LossFn, hidden, weight, targets) -> int:
    """Peak CUDA memory allocated during one forward+backward of ``fn`` beyond what existed before (the
    inputs) and beyond its outputs (d_hidden, d_weight; the loss is a scalar). Returns bytes."""
    device = hidden.device
    synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    grads = torch.autograd.grad(fn(hidden, weight, targets), (hidden, weight))
    synchronize(device)
    outputs = sum(g.numel() * g.element_size() for g in grads)
    return int(torch.cuda.max_memory_allocated(device) - base - outputs)


def benchmark_loss(impl: str, vocab: int, d_model: int, tokens: int, dtype: str = "bf16",
                   device: torch.device | str = "auto", fn: LossFn | None = None, warmup_ms: float = 25,
                   rep_ms: float = 100, cpu_steps: int = 3, seed: int = 0, record_errors: bool = False) -> dict:
    """One row: forward and forward+backward time of the loss ``impl`` (or ``fn``, named ``impl``) and its
    peak extra memory at one shape.

    ``fwd_ms``: median ms of the forward with autograd recording (what a training step pays; for
    ``fused_grad_in_forward`` and ``torch_chunked`` it includes the gradients). ``fwdbwd_ms``: median ms of
    forward + ``torch.autograd.grad`` for hidden and weight. ``peak_extra_gib``: :func:`peak_extra_bytes` in
    GiB (NaN on the CPU). ``tflops``: :func:`loss_flops` / ``fwdbwd_ms``. One untimed forward+backward runs
    first (compilation, Triton JIT). Out-of-memory anywhere gives ``status="oom"`` and the error in ``error``;
    other errors are raised, or recorded with ``status="error"`` when ``record_errors``.
    """
    device = resolve_device(device) if isinstance(device, str) else device
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    row = dict(impl=impl, vocab=vocab, d_model=d_model, tokens=tokens, dtype=dtype, fwdbwd_ms=math.nan,
               fwd_ms=math.nan, peak_extra_gib=math.nan, tflops=math.nan, status="ok", error="", device=str(device))
    hidden = weight = targets = None
    try:
        loss_fn = fn if fn is not None else loss_impl(impl)
        hidden, weight, targets = make_inputs(vocab, d_model, tokens, dtype, device, seed)

        def fwdbwd():
            return torch.autograd.grad(loss_fn(hidden, weight, targets), (hidden, weight))

        with warnings.catch_warnings():  # Inductor's notice that it split the compiled loss's reduction
            warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled", category=UserWarning)
            fwdbwd()  # compile / JIT / autotune outside the measurements
        if device.type == "cuda":
            row["peak_extra_gib"] = peak_extra_bytes(loss_fn, hidden, weight, targets) / 2**30
        timer = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps)
        row["fwd_ms"] = time_ms(lambda: loss_fn(hidden, weight, targets), device, **timer)
        row["fwdbwd_ms"] = time_ms(fwdbwd, device, **timer)
        row["tflops"] = loss_flops(tokens, d_model, vocab) / (row["fwdbwd_ms"] * 1e-3) / 1e12
    except Exception as exc:
        if not (is_oom(exc) or record_errors):
            raise
        row.update(status="oom" if is_oom(exc) else "error", error=error_summary(exc))
    finally:
        hidden = weight = targets = None  # the closures above hold these cells: free the GBs before the next row
        empty_cache()
    return row


def sweep(impls: Sequence[str] = ("fused", "torch", "torch_compiled", "torch_chunked"),
          shapes: Iterable[tuple[int, int, int]] = ((10_000, 768, 4096),), dtypes: Sequence[str] = ("bf16",),
          device: torch.device | str = "auto", progress: bool = False, **kwargs) -> pd.DataFrame:
    """:func:`benchmark_loss` for every ``(vocab, d_model, tokens)`` in ``shapes``, dtype and implementation.
    Returns a DataFrame with one row per measurement and the columns of :data:`COLUMNS`; keyword arguments go
    to :func:`benchmark_loss`."""
    rows = []
    for vocab, d_model, tokens in shapes:
        for dtype in dtypes:
            for impl in impls:
                rows.append(benchmark_loss(impl, vocab, d_model, tokens, dtype, device, **kwargs))
                if progress:
                    r = rows[-1]
                    print(f"{impl:>22} V={vocab} D={d_model} N={tokens} {dtype}: {r['fwdbwd_ms']:.2f} ms "
                          f"{r['peak_extra_gib']:.3f} GiB {r['status']}", flush=True)
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


def fused_memory_model(tokens: int, d_model: int, vocab: int, dtype: str = "bf16",
                       grad_in_forward: bool = False) -> dict[str, float]:
    """Closed-form extra bytes of the fused loss on a GPU (the transient buffers of
    :mod:`lab.kernels.fused_cross_entropy` with its current settings and compiled tile configs; the
    d_hidden/d_weight outputs not counted). Returns term -> bytes, with ``"peak"`` the largest phase."""
    from lab.kernels import fused_cross_entropy as fce
    from lab.kernels import fused_cross_entropy_kernels as K

    dt = DTYPES[dtype]
    e = element_size(dt)
    n, d, v = tokens, d_model, vocab
    lse_cfg = K.config("lse", dt, interpret=False)
    tiles = math.ceil(v / lse_cfg["BLOCK_N"])
    if grad_in_forward:
        rows = min(n, max(lse_cfg["BLOCK_M"], fce.FORWARD_GRAD_CHUNK_TOKENS // lse_cfg["BLOCK_M"] * lse_cfg["BLOCK_M"]))
        terms = {"logits chunk": rows * v * e, "partials": rows * tiles * 4,
                 "fp32 d_weight accumulator": v * d * 4 if n > rows else 0, "per-token vectors": 6 * n * 4}
        terms["peak"] = sum(terms.values())
        return terms
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
