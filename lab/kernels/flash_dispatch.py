"""Which FlashAttention kernels run: the Gluon kernels on Hopper, the portable Triton-language kernels elsewhere.

The Gluon kernels (:mod:`lab.kernels.flash_gluon_forward`, :mod:`lab.kernels.flash_gluon_backward`) state
FlashAttention-3's schedules (TMA rings fed by a producer warp, asynchronous warp-group products waited for
explicitly, two consumer warp groups; the backward computes five products a tile pair where the portable one
computes seven, and sums dQ over key tiles in device memory), which the Triton language leaves to its compiler;
they run on sm_90 GPUs only, on bf16/fp16 inputs with head dimension 64 or 128. The portable kernels
(:mod:`lab.kernels.flash_triton_forward`, :mod:`lab.kernels.flash_triton_backward`) run everywhere: other GPUs,
fp32, any head dimension that is a multiple of 8 up to 256, and the CPU interpreter the tests use.

Both forwards save what both backwards read: the output, in the layout of q
(:func:`~lab.kernels.triton_env.empty_in_layout`), and the natural-log logsumexp of every query row, fp32 of shape
``q.shape[:-1]`` (each kernel works in base 2 and converts on the way out). So the forward and the backward are
chosen apart, and both backwards return gradients in the layout of their input.

``FlashConfig.forward_kernel`` and ``FlashConfig.backward_kernel`` choose (``"auto"``: Gluon where it can run on
the inputs as they lie in memory); :func:`which_forward` and :func:`which_backward` answer which kernel a call
runs without running it, in plain Python (also on fake tensors while ``torch.compile`` traces, where the choice
decides whether the op can hand Inductor its kernel launches: Inductor traces Triton kernels, not Gluon ones, and
on the result tables, which say which kernels ran), and :func:`forward` and :func:`backward` run them.
"""

from __future__ import annotations

import warnings

import torch

from lab.kernels.flash_config import DEFAULT_CONFIG, INTERPRET, FlashConfig
from lab.kernels.flash_gluon import gluon_supported
from lab.kernels.flash_gluon_backward import gluon_backward
from lab.kernels.flash_gluon_forward import gluon_forward
from lab.kernels.flash_launch import launch
from lab.kernels.flash_triton_backward import flash_backward
from lab.kernels.flash_triton_forward import flash_forward
from lab.kernels.triton_env import empty_in_layout

#: Why the backward is the portable one under ``torch.use_deterministic_algorithms(True)``.
DETERMINISTIC = ("deterministic algorithms on (torch.use_deterministic_algorithms): the Gluon backward's dQ is not "
                 "bitwise reproducible, the portable backward's is")

__all__ = ["auto_declines_gluon", "backward", "forward", "gluon_refusal", "which_backward", "which_forward"]


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, d) view of a (batch, seq, d) tensor (one batch of ``batch`` heads: the Gluon kernel
    walks batch x heads as one index), a 4-D tensor as it is."""
    return t.unsqueeze(0) if t.dim() == 3 else t


def gluon_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """Why the Gluon kernels (forward and backward alike) cannot run these inputs here, in one line (the input's
    shape, dtype or head dimension, the GPU, the interpreter); None where they can."""
    if INTERPRET:
        return "Triton runs interpreted (TRITON_INTERPRET=1), and the Gluon kernels compile for sm_90 GPUs only"
    if q.dim() != k.dim() or q.dim() not in (3, 4):
        return "needs (batch, seq, d) or (batch, heads, seq, d) tensors"
    return gluon_supported(_heads_view(q), _heads_view(k), _heads_view(v), causal)


def auto_declines_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: FlashConfig,
                        direction: str = "fwd") -> str | None:
    """Why ``forward_kernel="auto"`` (``direction`` ``"fwd"``) or ``backward_kernel="auto"`` (``"bwd"``) keeps the
    portable kernel on inputs the Gluon one could run, in one line; None where it takes Gluon.

    * the config fixes the portable kernel's launch (a sweep timing it): ``fwd_tiles`` for the forward,
      ``bwd_tiles`` or ``backward_launch`` for the backward;
    * strided q, k or v, such as the model's (batch, seq, heads, d) projections seen as (batch, heads, seq, d):
      the Gluon kernels read each head's rows as one block through their TMA descriptors, so they would copy
      them first (the backward its gradients back out too), and for the forward the copies were measured to
      cost more than its schedule saves; the portable kernels read and write any strides. The backward decides
      on q, k and v alone, as the forward does, so that a table can say which backward runs before the output
      and its gradient exist (a strided output or gradient is copied);
    * the backward under ``torch.use_deterministic_algorithms(True)``: the Gluon backward adds dQ's shares in
      an order that varies from run to run, the portable one gives the same bits on every run."""
    if direction == "bwd" and torch.are_deterministic_algorithms_enabled():
        return DETERMINISTIC
    if direction == "fwd" and config.fwd_tiles:
        return "the config fixes the portable forward's tiles (fwd_tiles)"
    if direction == "bwd" and (config.bwd_tiles or config.backward_launch != "auto"):
        return "the config fixes the portable backward's launch (bwd_tiles or backward_launch)"
    if not all(t.is_contiguous() for t in (q, k, v)):
        return f"q, k or v is strided (the Gluon {'forward' if direction == 'fwd' else 'backward'} would copy it first)"
    return None


def _which(q, k, v, causal, config, direction: str) -> str:
    setting = config.forward_kernel if direction == "fwd" else config.backward_kernel
    if setting == "triton":
        return "triton"
    refusal = gluon_refusal(q, k, v, causal)
    if setting == "gluon":
        name = "forward" if direction == "fwd" else "backward"
        if refusal is not None:
            raise ValueError(f"{name}_kernel='gluon', but the Gluon {name} cannot run these inputs ({refusal})")
        if direction == "bwd" and torch.are_deterministic_algorithms_enabled():
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(f"backward_kernel='gluon' with {DETERMINISTIC}: choose 'auto' or 'triton'")
            warnings.warn(f"backward_kernel='gluon' with {DETERMINISTIC}", stacklevel=3)
        return "gluon"
    return "gluon" if refusal is None and auto_declines_gluon(q, k, v, config, direction) is None else "triton"


def which_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  config: FlashConfig = DEFAULT_CONFIG) -> str:
    """``"gluon"`` or ``"triton"``: the forward kernel that ``FlashAttentionTriton`` runs on these tensors under
    ``config.forward_kernel``: ``"triton"``; ``"gluon"`` (a ValueError, saying why, where it cannot run:
    :func:`gluon_refusal`); ``"auto"``: Gluon where it can run and :func:`auto_declines_gluon` has no objection.
    Runs nothing; real, fake and meta tensors alike."""
    return _which(q, k, v, causal, config, "fwd")


def which_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   config: FlashConfig = DEFAULT_CONFIG) -> str:
    """``"gluon"`` or ``"triton"``: the backward kernel that ``FlashAttentionTriton`` runs for these q, k, v
    under ``config.backward_kernel``, by the forward's rules (:func:`which_forward`; the forward's choice does not
    enter: both forwards save what both backwards read). Runs nothing; real, fake and meta tensors alike."""
    return _which(q, k, v, causal, config, "bwd")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, config: FlashConfig = DEFAULT_CONFIG,
            launcher=launch) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward :func:`which_forward` picks, on real tensors: (output of q's shape, dtype and memory layout;
    natural-log logsumexp, fp32 of shape ``q.shape[:-1]``, contiguous), the same from either kernel.
    ``launcher``: how the portable kernel is launched (``flash_forward``'s)."""
    if which_forward(q, k, v, causal, config) == "triton":
        return flash_forward(q, k, v, causal, config, launcher)
    out = empty_in_layout(q)
    _, lse = gluon_forward(_heads_view(q), _heads_view(k), _heads_view(v), causal, out=_heads_view(out))
    return out, lse.view(q.shape[:-1])


def _layout_of(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``grad``, contiguous of ``t``'s shape, in the layout the portable backward gives ``t``'s gradient
    (:func:`~lab.kernels.triton_env.empty_in_layout`, which the op's fake promises): itself where the two agree,
    else a copy."""
    if grad.stride() == t.stride():  # contiguous inputs: the common case, decided without a meta tensor
        return grad
    layout = empty_in_layout(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
    return grad if layout.stride() == grad.stride() else empty_in_layout(t).copy_(grad)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             grad_out: torch.Tensor, causal: bool, config: FlashConfig = DEFAULT_CONFIG,
             launcher=launch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward :func:`which_backward` picks, on real tensors: (dq, dk, dv) in the dtype, shape and memory
    layout of q, k, v (``flash_backward``'s contract), from either kernel. ``lse``: either forward's natural-log
    logsumexp, fp32 of shape ``q.shape[:-1]``. ``launcher``: how the portable kernels are launched."""
    if which_backward(q, k, v, causal, config) == "triton":
        return flash_backward(q, k, v, out, lse, grad_out, causal, config, launcher)
    q4, k4, v4, out4, grad4 = (_heads_view(t) for t in (q, k, v, out, grad_out))
    grads = gluon_backward(q4, k4, v4, out4, lse.reshape(q4.shape[:-1]), grad4, causal)
    return tuple(_layout_of(g.view(t.shape), t) for g, t in zip(grads, (q, k, v)))
