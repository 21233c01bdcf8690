"""Fused LM head + cross-entropy: the loss of ``hidden @ weight.T`` without the (tokens, vocab) logits in memory.

:func:`fused_linear_cross_entropy` ``(hidden (N, D), weight (V, D), targets (N,))`` returns
``F.cross_entropy((hidden @ weight.T).float(), targets, reduction=..., ignore_index=...)`` and its gradients
for hidden and weight, computed by the Triton kernels of :mod:`lab.kernels.fused_cross_entropy_kernels`:

* **forward** (:func:`lse_and_target_logit`): tiles of logits ``Z = H W^T`` (token tile x vocab tile, fp32
  accumulation over D) reduced on chip to per-token logsumexp partials and the target logit;
  ``2 N D V`` FLOPs, extra memory ``N * cdiv(V, 128) * 4`` bytes of partials (155 MB at the goal shape);
* **backward** (:func:`gradients_by_recompute`, the default): the vocabulary is cut into chunks whose
  ``dZ = softmax - onehot`` (scaled by the upstream gradient) fits :data:`SCRATCH_BYTES`; per chunk, one
  kernel recomputes the logits tiles and writes dZ, then two GEMM kernels give ``dW[chunk] = dZ^T H``
  (complete: its sum over all tokens is inside one GEMM) and ``dH += dZ W[chunk]`` (into an fp32 ``N x D``
  accumulator, cast to the input dtype by the last chunk). ``6 N D V`` FLOPs; 8 in all with the forward;
* **gradients in the forward** (``grad_in_forward=True``, :func:`loss_and_gradients`): tokens in chunks of
  :data:`FORWARD_GRAD_CHUNK_TOKENS`; per chunk the logits are stored once (in the input dtype), reduced to
  logsumexps, turned into dZ in place, and both gradients are taken from them: ``6 N D V`` FLOPs in all, no
  recompute, but an fp32 ``V x D`` accumulator for dW lives through the forward (2.5 GB at V = 151,936,
  D = 4096) and the gradients are held from the forward to the backward, where they are only scaled.

The design, FLOP and byte counts and measurements: ``notes/fused_loss.md``.

Semantics (those of ``torch.nn.functional.cross_entropy`` on fp32 logits): ``reduction`` "mean" (over
non-ignored targets; NaN when all are ignored, with zero gradients), "sum" (0 when all are ignored) or
"none" (per-token losses, 0 at ignored targets). Targets outside ``[0, V)`` other than ``ignore_index`` give
a NaN loss (no device-side assert). ``softmax_skip_threshold`` (recompute mode only): backward tiles whose
softmax entries are all below it (and that hold no target) are left out of both gradient GEMMs, as in Cut
Cross-Entropy; ``None`` (default) is exact.

Registration: the kernels run inside ``torch.library`` custom ops (``lab::fused_lce_forward``,
``lab::fused_lce_backward``, ``lab::fused_lce_loss_and_grads``) with fake (meta) kernels and autograd
formulas, so ``torch.compile(fullgraph=True)`` keeps them as single graph nodes; the reductions are ordinary
PyTorch ops around them. The weight is an ordinary input, so FSDP-style wrappers that gather it around the
calling module see an ordinary use. Under autocast both inputs are cast to the autocast dtype (as
``F.linear`` would). Kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from lab.kernels import fused_cross_entropy_kernels as K
from lab.kernels.triton_env import SUPPORTED_DTYPES, unit_last_stride

#: Bytes of the dZ scratch buffer of one vocabulary chunk in the recompute backward (N x chunk columns in
#: the input dtype): 256 MiB -> 4096 columns at N = 32768 in bf16. Larger chunks mean fewer passes over the
#: fp32 d_hidden accumulator (N * D * 8 bytes of traffic per chunk).
SCRATCH_BYTES = 256 * 2**20
#: Tokens per chunk with gradients in the forward: the stored logits are chunk x V in the input dtype
#: (1.2 GB at 4096 x 151,936 bf16); fewer tokens mean more passes over the fp32 dW accumulator
#: (V * D * 8 bytes of traffic per chunk).
FORWARD_GRAD_CHUNK_TOKENS = 4096
REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------------------------- checks
def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise a clear error for input the kernels cannot take: shapes, dtypes, devices."""
    if hidden.ndim != 2 or weight.ndim != 2 or targets.ndim != 1:
        raise ValueError(f"expected hidden (N, D), weight (V, D), targets (N,); got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"shapes do not match: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"targets {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"hidden and weight must share one of fp32/fp16/bf16; got {hidden.dtype} and {weight.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"hidden, weight and targets are on different devices: {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    if hidden.device.type == "cuda":
        return
    if not K.INTERPRET:
        raise RuntimeError(f"the fused cross-entropy kernels need CUDA tensors (got {hidden.device}); without a GPU "
                           "set TRITON_INTERPRET=1 before importing lab.kernels.fused_cross_entropy")
    if hidden.device.type != "cpu":
        raise RuntimeError(f"under TRITON_INTERPRET=1 the kernels run on CPU tensors, got {hidden.device}")


def _round_down(x: int, multiple: int) -> int:
    return x // multiple * multiple


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# --------------------------------------------------------------------------------------------- the math
def lse_and_target_logit(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Forward kernels: returns ``(lse, target_logit)``, both fp32 of shape (N,): the logsumexp over the
    vocabulary of each token's logits and its target's logit (0 where the target is outside [0, V))."""
    if K.interpreter_needs_fp32(hidden.dtype):
        return lse_and_target_logit(hidden.float(), weight.float(), targets)
    hidden, weight = unit_last_stride(hidden), unit_last_stride(weight)
    n, v = hidden.shape[0], weight.shape[0]
    target_logit = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if n == 0:
        return torch.empty_like(target_logit), target_logit
    cfg = K.config("lse", hidden.dtype)
    partial = torch.empty(n, -(-v // cfg["BLOCK_N"]), dtype=torch.float32, device=hidden.device)
    K.launch_lse(hidden, weight, targets, partial, target_logit, cfg)
    return torch.logsumexp(partial, dim=1), target_logit


def chunk_columns(n: int, v: int, dtype: torch.dtype, interpret: bool | None = None) -> int:
    """Vocabulary columns per backward chunk: as many as :data:`SCRATCH_BYTES` holds for ``n`` tokens, a
    multiple of the tile widths (so that every chunk but the last needs no K mask), at least one tile, at
    most the (rounded up) vocabulary. ``interpret``: as in :func:`fused_cross_entropy_kernels.config`."""
    align = max(K.config("dlogits", dtype, interpret)["BLOCK_N"], K.config("matmul", dtype, interpret)["BLOCK_K"])
    element_size = torch.empty((), dtype=dtype).element_size()
    columns = _round_down(SCRATCH_BYTES // max(1, n * element_size), align)
    return min(max(columns, align), _round_up(v, align))


def gradients_by_recompute(hidden, weight, targets, lse, grad_lse, grad_target, skip_threshold=None,
                           need_hidden: bool = True, need_weight: bool = True):
    """Backward kernels (see the module docstring): returns ``(d_hidden, d_weight)`` in the input dtype for
    ``dZ = softmax * grad_lse[:, None] + onehot(targets) * grad_target[:, None]``; a gradient that is not
    needed comes back as an empty tensor and costs no GEMM."""
    dtype = hidden.dtype
    if K.interpreter_needs_fp32(dtype):
        dh, dw = gradients_by_recompute(hidden.float(), weight.float(), targets, lse, grad_lse, grad_target,
                                        skip_threshold, need_hidden, need_weight)
        return dh.to(dtype), dw.to(dtype)
    hidden, weight = unit_last_stride(hidden), unit_last_stride(weight)
    (n, d), v = hidden.shape, weight.shape[0]
    device = hidden.device
    d_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    d_weight = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    if n == 0 or not (need_hidden or need_weight):
        return d_hidden.zero_(), d_weight.zero_()
    grad_lse, grad_target = grad_lse.float().contiguous(), grad_target.float().contiguous()
    dl_cfg, mm_cfg = K.config("dlogits", dtype), K.config("matmul", dtype)
    width_max = chunk_columns(n, v, dtype)
    scratch = torch.empty(n, width_max, dtype=dtype, device=device)
    chunks = [(v0, min(width_max, v - v0)) for v0 in range(0, v, width_max)]
    # d_hidden sums over every chunk: fp32 accumulator unless one chunk does it all
    acc = torch.empty(n, d, dtype=torch.float32, device=device) if need_hidden and len(chunks) > 1 else None
    flags = None
    if skip_threshold is not None:
        flags = torch.empty(-(-n // dl_cfg["BLOCK_M"]), -(-width_max // dl_cfg["BLOCK_N"]), dtype=torch.int32,
                            device=device)
    tile_m, tile_n = dl_cfg["BLOCK_M"], dl_cfg["BLOCK_N"]
    for i, (v0, width) in enumerate(chunks):
        w_chunk = weight[v0:v0 + width]
        K.launch_dlogits(hidden, w_chunk, targets, lse, grad_lse, grad_target, scratch, v0, dl_cfg, flags,
                         skip_threshold or 0.0)
        dz = scratch[:, :width]
        if need_weight:  # dW[chunk] = dZ^T H, complete in one GEMM (K = all tokens)
            K.launch_matmul(dz.t(), hidden, d_weight[v0:v0 + width], mm_cfg, flags=flags,
                            flag_block=(tile_n, tile_m), flag_strides=(1, flags.stride(0) if flags is not None else 0))
        if need_hidden:  # dH += dZ W[chunk]; the first chunk overwrites, the last one casts
            last = i == len(chunks) - 1
            out = d_hidden if last else acc
            K.launch_matmul(dz, w_chunk, out, mm_cfg, c_in=acc if i > 0 else None, flags=flags,
                            flag_block=(tile_m, tile_n), flag_strides=(flags.stride(0) if flags is not None else 0, 1))
    return d_hidden, d_weight


def loss_and_gradients(hidden, weight, targets, ignore_index: int, mean: bool):
    """Gradients-in-forward kernels: returns ``(loss, d_hidden, d_weight)`` with the loss reduced ("mean" or
    "sum") and the gradients of that loss (upstream gradient 1) in the input dtype."""
    dtype = hidden.dtype
    if K.interpreter_needs_fp32(dtype):
        loss, dh, dw = loss_and_gradients(hidden.float(), weight.float(), targets, ignore_index, mean)
        return loss, dh.to(dtype), dw.to(dtype)
    hidden, weight = unit_last_stride(hidden), unit_last_stride(weight)
    (n, d), v = hidden.shape, weight.shape[0]
    device = hidden.device
    valid = targets != ignore_index
    count = valid.sum()
    # dLoss/dlse and dLoss/dtarget_logit per token (for an upstream gradient of 1)
    grad_lse = valid.float() / (count.clamp_min(1).float() if mean else 1.0)
    grad_target = -grad_lse
    lse = torch.empty(n, dtype=torch.float32, device=device)
    target_logit = torch.zeros(n, dtype=torch.float32, device=device)
    d_hidden, d_weight = torch.empty_like(hidden), torch.empty_like(weight)
    lse_cfg, mm_cfg = K.config("lse", dtype), K.config("matmul", dtype)
    rows = max(lse_cfg["BLOCK_M"], _round_down(FORWARD_GRAD_CHUNK_TOKENS, lse_cfg["BLOCK_M"]))
    chunks = [(r0, min(rows, n - r0)) for r0 in range(0, n, rows)]
    if not chunks:
        d_weight.zero_()
    logits = torch.empty(min(rows, n), v, dtype=dtype, device=device)
    partial = torch.empty(min(rows, n), -(-v // lse_cfg["BLOCK_N"]), dtype=torch.float32, device=device)
    acc = torch.empty(v, d, dtype=torch.float32, device=device) if len(chunks) > 1 else None
    for i, (r0, m) in enumerate(chunks):
        h, t = hidden[r0:r0 + m], targets[r0:r0 + m]
        z = logits[:m]
        K.launch_lse(h, weight, t, partial[:m], target_logit[r0:r0 + m], lse_cfg, logits=z)
        lse[r0:r0 + m] = torch.logsumexp(partial[:m], dim=1)
        K.launch_softmax_grad(z, lse[r0:r0 + m], t, grad_lse[r0:r0 + m], grad_target[r0:r0 + m])
        K.launch_matmul(z, weight, d_hidden[r0:r0 + m], mm_cfg)  # dH[chunk] = dZ W, complete (K = V)
        last = i == len(chunks) - 1
        K.launch_matmul(z.t(), h, d_weight if last else acc, mm_cfg, c_in=acc if i > 0 else None)
    loss = _token_losses(lse, target_logit, targets, valid, v).sum()
    return (loss / count if mean else loss), d_hidden, d_weight


def _token_losses(lse, target_logit, targets, valid, vocab: int) -> torch.Tensor:
    """``lse - target_logit`` per token: 0 where the target is ignored, NaN where it is outside [0, V)."""
    losses = torch.where(valid, lse - target_logit, 0.0)
    return torch.where(valid & ((targets < 0) | (targets >= vocab)), float("nan"), losses)


# ------------------------------------------------------------------------------------ torch.library ops
def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


@torch.library.custom_op("lab::fused_lce_forward", mutates_args=())
def _forward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                skip_threshold: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target_logit) per token; ``skip_threshold`` only travels to the backward."""
    check_inputs(hidden, weight, targets)
    with _no_autocast(hidden.device):
        return lse_and_target_logit(hidden, weight, targets)


@_forward_op.register_fake
def _(hidden, weight, targets, skip_threshold):
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("lab::fused_lce_backward", mutates_args=())
def _backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                 grad_lse: torch.Tensor, grad_target: torch.Tensor, skip_threshold: float | None,
                 need_hidden: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with _no_autocast(hidden.device):
        return gradients_by_recompute(hidden, weight, targets, lse, grad_lse, grad_target, skip_threshold,
                                      need_hidden, need_weight)


@_backward_op.register_fake
def _(hidden, weight, targets, lse, grad_lse, grad_target, skip_threshold, need_hidden, need_weight):
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _forward_setup(ctx, inputs, output):
    hidden, weight, targets, skip_threshold = inputs
    ctx.save_for_backward(hidden, weight, targets, output[0])
    ctx.skip_threshold = skip_threshold


def _forward_backward(ctx, grad_lse, grad_target):
    hidden, weight, targets, lse = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_target is None:
        grad_target = torch.zeros_like(lse)
    d_hidden, d_weight = _backward_op(hidden, weight, targets, lse, grad_lse, grad_target, ctx.skip_threshold,
                                      need_hidden, need_weight)
    return (d_hidden if need_hidden else None), (d_weight if need_weight else None), None, None


_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


@torch.library.custom_op("lab::fused_lce_loss_and_grads", mutates_args=())
def _loss_and_grads_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                       mean: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d_hidden, d_weight): the reduced loss and its gradients for an upstream gradient of 1."""
    check_inputs(hidden, weight, targets)
    with _no_autocast(hidden.device):
        return loss_and_gradients(hidden, weight, targets, ignore_index, mean)


@_loss_and_grads_op.register_fake
def _(hidden, weight, targets, ignore_index, mean):
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), torch.empty_like(weight)


def _grads_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _grads_backward(ctx, grad_loss, _grad_dh, _grad_dw):
    d_hidden, d_weight = ctx.saved_tensors
    # a 0-dim fp32 factor keeps the 16-bit dtype of the gradients
    return d_hidden * grad_loss, d_weight * grad_loss, None, None, None


_loss_and_grads_op.register_autograd(_grads_backward, setup_context=_grads_setup)


# ------------------------------------------------------------------------------------------ public entry
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               reduction: str = "mean", ignore_index: int = -100,
                               softmax_skip_threshold: float | None = None,
                               grad_in_forward: bool = False) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, never materializing the logits.

    ``hidden`` (..., D) and ``weight`` (V, D) in one of fp32/fp16/bf16, ``targets`` (...) int64. Returns the
    fp32 loss: a scalar for ``reduction`` "mean"/"sum", per-token losses (shape of ``targets``) for "none".
    Differentiable in ``hidden`` and ``weight`` (gradients in their dtype, accumulated in fp32).

    ``softmax_skip_threshold``: skip backward tiles whose softmax entries are all below it (approximate;
    ``None`` is exact). ``grad_in_forward``: compute the gradients during the forward (``6 N D V`` FLOPs
    instead of 8, but an fp32 V x D accumulator during the forward and the gradients held until the
    backward; "mean"/"sum" only). Off by default: the point of the op is memory (see the module docstring).
    Without gradients (``torch.no_grad()`` or inputs that do not require grad) it only runs the forward.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if grad_in_forward and (reduction == "none" or softmax_skip_threshold is not None):
        raise ValueError("grad_in_forward needs reduction 'mean' or 'sum' and no softmax_skip_threshold")
    if torch.is_autocast_enabled(hidden.device.type):  # as F.linear would: both operands in the autocast dtype
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if grad_in_forward and wants_grad:
        return _loss_and_grads_op(hidden, weight, targets, ignore_index, reduction == "mean")[0]
    threshold = None if softmax_skip_threshold is None else float(softmax_skip_threshold)
    lse, target_logit = _forward_op(hidden, weight, targets, threshold)
    valid = targets != ignore_index
    losses = _token_losses(lse, target_logit, targets, valid, weight.shape[0])
    if reduction == "none":
        return losses.reshape(shape)
    total = losses.sum()
    return total / valid.sum() if reduction == "mean" else total
