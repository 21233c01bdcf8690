"""Fused LM head + cross-entropy: the loss of ``hidden @ weight.T`` without the (tokens, vocab) logits in memory.

:func:`fused_linear_cross_entropy` ``(hidden (N, D), weight (V, D), targets (N,))`` returns
``F.cross_entropy((hidden @ weight.T).float(), targets, reduction=..., ignore_index=...)`` and its gradients
for hidden and weight. Notation: logits ``Z = H W^T``, ``lse`` the per-token logsumexp, ``g`` the loss's
gradient per token (``1/count`` for the mean over ``count`` non-ignored targets, 1 for the sum, 0 at ignored
ones), ``dZ = (softmax(Z) - onehot(target)) * g``. ``e`` is the input dtype's element size.

**Gradients in the forward** (the default whenever gradients are wanted and the reduction is "mean" or
"sum", :func:`loss_and_gradients`). The loss ends the graph, so its gradients can be computed while the
logits exist and the backward only scales them by the upstream gradient. Tokens are cut into chunks of
``C`` rows (:func:`chunk_plan`); per chunk, into one reused ``C x V`` buffer in the input dtype:

1. ``Z_c = H_c W^T`` (cuBLAS, ``torch.mm(out=)``), rounded to the input dtype as the materialized loss's
   logits are: ``2 C D V`` FLOPs;
2. one Triton kernel over the rows (:func:`lab.kernels.fused_cross_entropy_kernels.launch_rows`): ``lse``
   and the target logit of each row (online max and sum), then ``dZ_c`` written over ``Z_c`` in place;
   ``(2 or 3) C V e`` bytes of DRAM traffic (rows of up to 16,384 logits are read once);
3. ``dH_c = dZ_c W`` (cuBLAS): complete for these tokens (its sum over V is inside the GEMM); ``2 C D V``;
4. ``dW += dZ_c^T H_c`` (cuBLAS ``addmm``, ``beta = 1`` after the first chunk): ``2 C D V``, plus reading
   and writing dW once per chunk (``2 V D`` elements of the accumulator).

In all ``6 N D V`` FLOPs, the materialized loss's three GEMMs, with no recompute; the backward reads and
writes the two gradients once to multiply them by the upstream gradient, in place. Extra memory: the chunk
(``C V e`` bytes), per-token vectors (a few ``4 N`` bytes) and, when :func:`chunk_plan` picks it, an fp32
``V x D`` accumulator for dW. At V = 151,936, D = 4096, N = 32,768 in bf16 the eager materialized loss holds
``12 N V`` bytes = 55.6 GiB beyond its inputs (three fp32 ``N x V`` tensors in its backward) and the
compiled one the bf16 logits, ``2 N V`` = 9.3 GiB.

*Rounding of dW.* dH is rounded once. dW sums ``k = ceil(N / C)`` chunk products. With the fp32
accumulator the only rounding to the input dtype is the last, as in one GEMM. Accumulated in the weight's
dtype (each ``addmm`` adds a chunk's fp32 product to the stored sum and rounds), the error grows with the
number of roundings: at most ``k`` roundings of ``2**-8`` (bf16; ``2**-11`` fp16) of the largest partial
sum, about ``sqrt(k)`` of them for random rounding errors, against one for a single GEMM (tested).
:func:`chunk_plan` takes the fp32 accumulator only where it fits the memory budget beside a chunk of
:data:`MAX_CHUNK_TOKENS` rows, so that it costs no speed; otherwise it accumulates in the weight's dtype, as
Liger-Kernel does.

**Recompute backward** (``reduction="none"``, ``softmax_skip_threshold``, or ``grad_in_forward=False``;
the Triton kernels' tiles stay below cuBLAS's speed):

* forward (:func:`lse_and_target_logit`): tiles of logits (token tile x vocab tile, fp32 accumulation over
  D) reduced on chip to per-token logsumexp partials and the target logit; ``2 N D V`` FLOPs, extra memory
  ``N * cdiv(V, 128) * 4`` bytes of partials (148 MiB at the shape above); logits never leave the chip and
  are not rounded to the input dtype;
* backward (:func:`gradients_by_recompute`): the vocabulary is cut into chunks whose ``dZ`` (scaled by the
  per-token upstream gradients) fits :data:`SCRATCH_BYTES`; per chunk one kernel recomputes the logits tiles
  and writes dZ, then two GEMM kernels give ``dW[chunk] = dZ^T H`` (complete: its sum over all tokens is
  inside one GEMM) and ``dH += dZ W[chunk]`` (into an fp32 ``N x D`` accumulator, cast to the input dtype by
  the last chunk). ``6 N D V`` FLOPs, ``8 N D V`` with the forward; extra memory about 0.75 GiB at the shape
  above (scratch, the fp32 dH accumulator, the saved lse).

It is the one design for ``reduction="none"`` (the per-token upstream gradients are known only in the
backward) and holds nothing between forward and backward but the lse. A single kernel that recomputes each
(token tile, vocab tile) block once and adds both gradients with atomics was not taken: at D = 4096 neither a
row tile of dH nor of dW fits on chip, so every block would add a 128 x 4096 fp32 partial of each to global
memory, more traffic than the whole materialized loss unless most blocks are skipped (Cut Cross-Entropy's
gradient filter, exact only where the softmax is peaked).

Semantics (those of ``torch.nn.functional.cross_entropy`` on fp32 logits): ``reduction`` "mean" (over
non-ignored targets; NaN when all are ignored, with zero gradients), "sum" (0 when all are ignored) or
"none" (per-token losses, 0 at ignored targets). Targets outside ``[0, V)`` other than ``ignore_index`` give
a NaN loss (no device-side assert). ``softmax_skip_threshold`` (recompute mode only): backward tiles whose
softmax entries are all below it (and that hold no target) are left out of both gradient GEMMs, as in Cut
Cross-Entropy; ``None`` (default) is exact.

Registration: ``torch.library`` custom ops (``lab::fused_lce_loss_and_grads``, ``lab::fused_lce_forward``,
``lab::fused_lce_backward``) with fake (meta) kernels and autograd formulas, so ``torch.compile(fullgraph=True)``
keeps them as single graph nodes; the reductions of the recompute path are ordinary PyTorch ops around them.
The weight is an ordinary input, so FSDP-style wrappers that gather it around the calling module see an
ordinary use. Under autocast both inputs are cast to the autocast dtype (as ``F.linear`` would). The Triton
kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (``torch.mm`` then runs on the CPU).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lab.kernels import fused_cross_entropy_kernels as K
from lab.kernels.triton_env import SUPPORTED_DTYPES, unit_last_stride

#: Bytes of the dZ scratch buffer of one vocabulary chunk in the recompute backward (N x chunk columns in
#: the input dtype): 256 MiB -> 4096 columns at N = 32768 in bf16. Larger chunks mean fewer passes over the
#: fp32 d_hidden accumulator (N * D * 8 bytes of traffic per chunk).
SCRATCH_BYTES = 256 * 2**20
#: Bytes per logit of the eager materialized loss beyond its inputs: in its backward the saved fp32
#: log-softmax, the NLL gradient and the log-softmax gradient, three fp32 N x V tensors.
MATERIALIZED_BYTES_PER_LOGIT = 12
#: Memory budget of the gradients-in-forward path (token chunk, optional fp32 dW accumulator) as a share of
#: the eager materialized loss's ``12 N V`` bytes: the goal is 5%; the rest is room for the per-token
#: vectors and the allocator's rounding.
EXTRA_MEMORY_SHARE = 0.045
#: Token chunks hold at most this many rows: each chunk adds one read and write of dW (``2 V D`` elements)
#: to its ``6 C D V`` FLOPs, a time share of about ``e * peak FLOP/s / (3 C * DRAM bytes/s)``, ~140 / C in
#: bf16 on an H100 (3.4% at 4096 rows, 1.7% at 8192); beyond 8192 the gain is below 1%.
MAX_CHUNK_TOKENS = 8192
#: Token chunks hold at least this many rows (where N has them), whatever the budget: below it the per-chunk
#: dW pass costs > 13% and the chunk's GEMMs run below cuBLAS's peak. Only N < ~3800 tokens exceed the
#: budget with it (the chunk is then at most 1024 x V x e bytes, 0.29 GiB at V = 151,936 in bf16).
MIN_CHUNK_TOKENS = 1024
#: Chunk rows are rounded to this multiple (whole 128-row GEMM tiles).
CHUNK_ALIGN = 128
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


class ChunkPlan(NamedTuple):
    """How :func:`loss_and_gradients` cuts the tokens: ``rows`` per chunk (the last may hold fewer) and
    whether dW is summed in an fp32 accumulator (else in the weight's dtype)."""
    rows: int
    fp32_accumulator: bool


def chunk_plan(n: int, d: int, v: int, dtype: torch.dtype, need_weight: bool = True,
               chunk_tokens: int | None = None) -> ChunkPlan:
    """Token chunking of the gradients-in-forward path for ``n`` tokens, width ``d``, vocabulary ``v``.

    The budget is :data:`EXTRA_MEMORY_SHARE` of the eager materialized loss's ``12 n v`` bytes. The largest
    chunk it holds is clamped to [:data:`MIN_CHUNK_TOKENS`, :data:`MAX_CHUNK_TOKENS`] and evened out (``k``
    chunks of ``ceil(n / k)`` rows rounded up to :data:`CHUNK_ALIGN`), or is ``chunk_tokens`` when given.
    One chunk needs no accumulator. With several, dW is summed in fp32 when the inputs are 16-bit, dW is
    wanted and the budget holds the ``v x d`` fp32 accumulator beside a chunk of :data:`MAX_CHUNK_TOKENS`
    rows (so it costs no speed); otherwise in the weight's dtype."""
    e = torch.empty((), dtype=dtype).element_size()
    budget = EXTRA_MEMORY_SHARE * MATERIALIZED_BYTES_PER_LOGIT * n * v
    if chunk_tokens is not None:
        rows = max(1, min(chunk_tokens, n))
    else:
        largest = _round_down(int(budget // max(1, v * e)), CHUNK_ALIGN)
        largest = min(max(largest, MIN_CHUNK_TOKENS), MAX_CHUNK_TOKENS)
        chunks = max(1, math.ceil(n / largest))
        rows = min(n, _round_up(math.ceil(n / chunks), CHUNK_ALIGN)) if n else 1
    several = n > rows
    fp32 = (several and need_weight and e < 4 and v * d * 4 + MAX_CHUNK_TOKENS * v * e <= budget)
    return ChunkPlan(rows, fp32)


def _accumulate_d_weight(d_weight, acc, dz, h, first: bool) -> None:
    """``dW (+)= dZ^T H`` for one chunk: into ``d_weight`` (``beta = 0`` for the first chunk, then 1), or into
    the fp32 accumulator ``acc`` (zero-initialised)."""
    if acc is None:
        if first:
            torch.mm(dz.t(), h, out=d_weight)
        else:
            d_weight.addmm_(dz.t(), h)
    elif acc.device.type == "cuda":  # 16-bit operands, fp32 output: one cuBLAS call, no fp32 copies
        torch.addmm(acc, dz.t(), h, out_dtype=torch.float32, out=acc)
    else:  # the CPU has no mixed-dtype addmm (interpreter tests): fp32 copies of the small operands
        acc.addmm_(dz.t().float(), h.float())


def loss_and_gradients(hidden, weight, targets, ignore_index: int, mean: bool, need_hidden: bool = True,
                       need_weight: bool = True, chunk_tokens: int | None = None):
    """Gradients-in-forward path (see the module docstring): returns ``(loss, d_hidden, d_weight)`` with the
    loss reduced ("mean" or "sum") and the gradients of that loss (upstream gradient 1) in the input dtype;
    a gradient that is not needed comes back as an empty tensor and costs no GEMM (neither: only the
    logits GEMM and the lse)."""
    (n, d), v = hidden.shape, weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    targets = targets.contiguous()
    valid = targets != ignore_index
    count = valid.sum()
    # the per-token gradient scale stays on the device: no host sync for the count
    scale = (1.0 / count.clamp_min(1).float() if mean else torch.ones((), device=device)).reshape(1)
    plan = chunk_plan(n, d, v, dtype, need_weight, chunk_tokens)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    target_logit = torch.empty(n, dtype=torch.float32, device=device)
    d_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    d_weight = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    acc = torch.zeros(v, d, dtype=torch.float32, device=device) if need_weight and plan.fp32_accumulator else None
    if need_weight and n == 0:
        d_weight.zero_()
    logits = torch.empty(min(plan.rows, n), v, dtype=dtype, device=device)
    for r0 in range(0, n, plan.rows):
        h = hidden[r0:r0 + plan.rows]
        m = h.shape[0]
        z = logits[:m]
        torch.mm(h, weight.t(), out=z)
        K.launch_rows(z, targets[r0:r0 + m], scale, lse[r0:r0 + m], target_logit[r0:r0 + m], ignore_index,
                      write_grad=need_hidden or need_weight)
        if need_hidden:  # complete for these tokens: the sum over the vocabulary is inside the GEMM
            torch.mm(z, weight, out=d_hidden[r0:r0 + m])
        if need_weight:
            _accumulate_d_weight(d_weight, acc, z, h, first=r0 == 0)
    if acc is not None:
        d_weight.copy_(acc)
    total = _token_losses(lse, target_logit, targets, valid, v).sum()
    return (total / count if mean else total), d_hidden, d_weight


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
                       mean: bool, need_hidden: bool, need_weight: bool,
                       chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d_hidden, d_weight): the reduced loss and its gradients for an upstream gradient of 1 (empty
    where not needed); ``chunk_tokens`` 0 lets :func:`chunk_plan` choose."""
    check_inputs(hidden, weight, targets)
    with _no_autocast(hidden.device):
        return loss_and_gradients(hidden, weight, targets, ignore_index, mean, need_hidden, need_weight,
                                  chunk_tokens or None)


@_loss_and_grads_op.register_fake
def _(hidden, weight, targets, ignore_index, mean, need_hidden, need_weight, chunk_tokens):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0))


def _grads_setup(ctx, inputs, output):
    ctx.need = inputs[5], inputs[6]
    ctx.save_for_backward(output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    # the gradient outputs get no gradient: without this, autograd would fill two tensors of their size with
    # zeros for the backward (as much memory as the gradients themselves, and a memset)
    ctx.set_materialize_grads(False)


def _scaled(grad: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``grad * factor``, in place on real tensors: a copy would hold both gradients twice at the backward's
    start, and a second backward through the same graph (retain_graph) then fails autograd's check that saved
    tensors are unmodified. Traced (fake or functional tensors under torch.compile): out of place, which
    AOTAutograd needs where the op's gradient outputs are visible. A 0-dim fp32 factor keeps the 16-bit dtype."""
    return grad.mul_(factor) if type(grad) is torch.Tensor else grad * factor


def _grads_backward(ctx, grad_loss, _grad_dh, _grad_dw):
    d_hidden, d_weight = ctx.saved_tensors
    grads = [_scaled(g, grad_loss) if need else None for g, need in zip((d_hidden, d_weight), ctx.need)]
    return grads[0], grads[1], None, None, None, None, None, None


_loss_and_grads_op.register_autograd(_grads_backward, setup_context=_grads_setup)


# ------------------------------------------------------------------------------------------ public entry
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               reduction: str = "mean", ignore_index: int = -100,
                               softmax_skip_threshold: float | None = None, grad_in_forward: bool | None = None,
                               chunk_tokens: int | None = None) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, never materializing the logits.

    ``hidden`` (..., D) and ``weight`` (V, D) in one of fp32/fp16/bf16, ``targets`` (...) int64. Returns the
    fp32 loss: a scalar for ``reduction`` "mean"/"sum", per-token losses (shape of ``targets``) for "none".
    Differentiable in ``hidden`` and ``weight`` (gradients in their dtype).

    ``grad_in_forward``: None (default) computes "mean"/"sum" losses and their gradients in the forward
    (``6 N D V`` FLOPs, cuBLAS matmuls, token chunks of ``chunk_tokens`` rows or :func:`chunk_plan`'s) and
    takes the recompute backward (``8 N D V``, Triton matmuls, the least memory) for "none" and with
    ``softmax_skip_threshold``; False always takes the recompute backward; True insists on gradients in the
    forward (an error for "none" or a skip threshold). ``softmax_skip_threshold``: skip backward tiles whose
    softmax entries are all below it (approximate; ``None`` is exact). Without gradients (``torch.no_grad()``
    or inputs that do not require grad) only the forward's work runs.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    recompute_only = reduction == "none" or softmax_skip_threshold is not None
    if grad_in_forward and recompute_only:
        raise ValueError("grad_in_forward needs reduction 'mean' or 'sum' and no softmax_skip_threshold")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}")
    if torch.is_autocast_enabled(hidden.device.type):  # as F.linear would: both operands in the autocast dtype
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    shape = targets.shape
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not recompute_only and grad_in_forward is not False:
        grad = torch.is_grad_enabled()
        return _loss_and_grads_op(hidden, weight, targets, ignore_index, reduction == "mean",
                                  grad and hidden.requires_grad, grad and weight.requires_grad, chunk_tokens or 0)[0]
    threshold = None if softmax_skip_threshold is None else float(softmax_skip_threshold)
    lse, target_logit = _forward_op(hidden, weight, targets, threshold)
    valid = targets != ignore_index
    losses = _token_losses(lse, target_logit, targets, valid, weight.shape[0])
    if reduction == "none":
        return losses.reshape(shape)
    total = losses.sum()
    return total / valid.sum() if reduction == "mean" else total
