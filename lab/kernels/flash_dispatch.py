"""Which FlashAttention forward runs: the Gluon kernel on Hopper, the portable Triton-language kernel elsewhere.

The Gluon forward (:mod:`lab.kernels.flash_gluon_forward`) states FlashAttention-3's schedule (a TMA ring fed by
a producer warp, asynchronous warp-group products waited for explicitly, ping-pong consumer warp groups), which
the Triton language leaves to its compiler; it runs on sm_90 GPUs only, on bf16/fp16 inputs with head dimension
64 or 128. The portable forward (:mod:`lab.kernels.flash_triton_forward`) runs everywhere: other GPUs, fp32, any
head dimension that is a multiple of 8 up to 256, and the CPU interpreter the tests use.

Both save what the backward reads: the output, in the layout of q (:func:`~lab.kernels.triton_env.empty_in_layout`),
and the natural-log logsumexp of every query row, fp32 of shape ``q.shape[:-1]`` (each kernel works in base 2
and converts on the way out). So the backward, always the portable Triton one, takes either forward's results.

``FlashConfig.forward_kernel`` chooses (``"auto"``: Gluon where it can run on the inputs as they lie in memory);
:func:`which_forward` answers which kernel a call runs without running it, in plain Python (also on fake tensors
while ``torch.compile`` traces, where the choice decides whether the op can hand Inductor its kernel launches:
Inductor traces Triton kernels, not Gluon ones), and :func:`forward` runs it.
"""

from __future__ import annotations

import torch

from lab.kernels.flash_config import DEFAULT_CONFIG, INTERPRET, FlashConfig
from lab.kernels.flash_gluon import gluon_supported
from lab.kernels.flash_gluon_forward import gluon_forward
from lab.kernels.flash_launch import launch
from lab.kernels.flash_triton_forward import flash_forward
from lab.kernels.triton_env import empty_in_layout

__all__ = ["auto_declines_gluon", "forward", "gluon_refusal", "which_forward"]


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, d) view of a (batch, seq, d) tensor (one batch of ``batch`` heads: the Gluon kernel
    walks batch x heads as one index), a 4-D tensor as it is."""
    return t.unsqueeze(0) if t.dim() == 3 else t


def gluon_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """Why the Gluon forward cannot run these inputs here, in one line (the input's shape, dtype or head
    dimension, the GPU, the interpreter); None where it can."""
    if INTERPRET:
        return "Triton runs interpreted (TRITON_INTERPRET=1), and the Gluon kernels compile for sm_90 GPUs only"
    if q.dim() != k.dim() or q.dim() not in (3, 4):
        return "needs (batch, seq, d) or (batch, heads, seq, d) tensors"
    return gluon_supported(_heads_view(q), _heads_view(k), _heads_view(v), causal)


def auto_declines_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: FlashConfig) -> str | None:
    """Why ``forward_kernel="auto"`` keeps the portable forward on inputs the Gluon one could run, in one line;
    None where it takes Gluon.

    * ``config.fwd_tiles``: the caller fixed the portable forward's tiles (a sweep timing them);
    * strided q, k or v, such as the model's (batch, seq, heads, d) projections seen as (batch, heads, seq, d):
      the Gluon kernel reads each head's rows as one block through its TMA descriptors, so it would copy them
      first, and the copies cost more than its schedule saves; the portable kernel reads any strides."""
    if config.fwd_tiles:
        return "the config fixes the portable forward's tiles (fwd_tiles)"
    if not all(t.is_contiguous() for t in (q, k, v)):
        return "q, k or v is strided (the Gluon forward would copy it first)"
    return None


def which_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  config: FlashConfig = DEFAULT_CONFIG) -> str:
    """``"gluon"`` or ``"triton"``: the forward kernel that ``FlashAttentionTriton`` runs on these tensors under
    ``config.forward_kernel``: ``"triton"``; ``"gluon"`` (a ValueError, saying why, where it cannot run:
    :func:`gluon_refusal`); ``"auto"``: Gluon where it can run and :func:`auto_declines_gluon` has no objection.
    Runs nothing; real, fake and meta tensors alike."""
    if config.forward_kernel == "triton":
        return "triton"
    refusal = gluon_refusal(q, k, v, causal)
    if config.forward_kernel == "gluon":
        if refusal is not None:
            raise ValueError(f"forward_kernel='gluon', but the Gluon forward cannot run these inputs ({refusal})")
        return "gluon"
    return "gluon" if refusal is None and auto_declines_gluon(q, k, v, config) is None else "triton"


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
