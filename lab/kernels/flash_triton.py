"""FlashAttention-2 in Triton: the public interface (autograd Functions and the model registry's entry point).

Two ``torch.autograd.Function`` classes share the forward and differ only in the backward. The forward is the
Gluon kernel for Hopper (:mod:`lab.kernels.flash_gluon_forward`) where it can run (an sm_90 GPU, bf16/fp16, d 64
or 128) and the portable Triton-language kernel (:mod:`lab.kernels.flash_triton_forward`) elsewhere, as
``FlashConfig.forward_kernel`` chooses; :func:`which_forward` says which runs. Both save the same output and
logsumexp, which either backward takes:

* :class:`FlashAttentionTriton`: backward in Triton, by the same choice (``FlashConfig.backward_kernel``,
  :func:`which_backward`): the Gluon backward (:mod:`lab.kernels.flash_gluon_backward`) where it can run, the
  portable one (:mod:`lab.kernels.flash_triton_backward`) elsewhere;
* :class:`FlashAttentionTritonCompiledBackward`: backward = ``torch.compile`` of the untiled recomputation
  equations (:func:`lab.kernels.flash_pytorch.attention_backward_recompute`), eager if compiling fails.

Both take ``apply(q, k, v, is_causal=False, config=None)``:

* q, k, v of shape (batch, seq, d), or (batch, heads, seq, d), all alike; any sequence lengths,
  ``n_queries != n_keys`` allowed; causal means query ``i`` attends keys ``j <= i`` (indices from the
  start of both sequences, as in ``torch.nn.functional.scaled_dot_product_attention``);
* d any multiple of 8 from 8 to 256; dtypes fp32, fp16, bf16 (all three of q, k, v alike);
* ``config``: a :class:`FlashConfig` (None: the defaults), how the kernels are launched;
* tensors whose last dimension is not contiguous are copied; batch, head and sequence strides are passed
  to the portable kernels as they are (no copy), while the Gluon kernels read contiguous copies of strided
  inputs (their TMA descriptors cover each head's rows as one block); outputs and gradients come in their
  input's layout either way;
* the kernels run on a CUDA GPU, or on the CPU under ``TRITON_INTERPRET=1`` (slow; for tests).

Saved for backward: q, k, v, the output and the fp32 logsumexp of shape ``q.shape[:-1]``.

Under ``torch.compile`` the Functions trace into the ``torch.library`` ops of
:mod:`lab.kernels.flash_triton_ops` (no graph break, ``fullgraph=True`` works). :func:`flash_attention_bhsd`
is the model registry's entry point on (batch, heads, seq, d) tensors.

Where things live: the forward kernel in :mod:`~lab.kernels.flash_triton_forward`, the backward kernels in
:mod:`~lab.kernels.flash_triton_backward`, tile loads and the launcher in :mod:`~lab.kernels.flash_launch`,
the configuration, input checks and tile tables in :mod:`~lab.kernels.flash_config`. The tables are
re-measured with ``python -m lab.bench.flash_sweep sweep`` (every variant next to SDPA and FlexAttention).
"""

from __future__ import annotations

import warnings

import torch

from lab.kernels.flash_config import DEFAULT_CONFIG, FlashConfig
from lab.kernels.flash_dispatch import which_backward, which_forward
from lab.kernels.flash_pytorch import attention_backward_recompute, check_bhsd
from lab.kernels.flash_triton_backward import flash_backward
from lab.kernels.flash_triton_forward import flash_forward
from lab.kernels.flash_triton_ops import attention_backward, attention_forward

__all__ = [
    "DEFAULT_CONFIG", "FlashAttentionTriton", "FlashAttentionTritonCompiledBackward", "FlashConfig",
    "compiled_backward",
    "flash_attention_bhsd", "flash_backward", "flash_forward", "which_backward", "which_forward",
]


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention: the forward and the backward :func:`which_forward` and :func:`which_backward` pick (Gluon
    on Hopper, else the portable Triton kernels).

    ``FlashAttentionTriton.apply(q, k, v, is_causal=False, config=None)`` on (batch, seq, d) or
    (batch, heads, seq, d) tensors returns the attention output of q's shape in the input dtype. Saved for
    backward: q, k, v, the output and the fp32 logsumexp of shape ``q.shape[:-1]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, config=None):
        config = DEFAULT_CONFIG if config is None else config
        if not isinstance(config, FlashConfig):
            raise TypeError(f"config must be a FlashConfig or None, got {type(config).__name__}")
        out, lse = attention_forward(q, k, v, bool(is_causal), config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = bool(is_causal)
        ctx.config = config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = attention_backward(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.config)
        return grad_q, grad_k, grad_v, None, None


_compiled_backward = None
_compile_failed = False


def compiled_backward(q, k, v, out, lse, grad_out, is_causal):
    """:func:`attention_backward_recompute` through ``torch.compile`` (traced inline when already compiling;
    eager, with one warning, if compiling is not possible here). Returns (dQ, dK, dV)."""
    global _compiled_backward, _compile_failed
    if q.dim() == 4:  # the recomputation equations take (batch, seq, d): fold the heads into the batch
        grads = compiled_backward(*(t.flatten(0, 1) for t in (q, k, v, out, lse, grad_out)), is_causal)
        return tuple(g.unflatten(0, t.shape[:2]) for g, t in zip(grads, (q, k, v)))
    if torch.compiler.is_compiling():
        return attention_backward_recompute(q, k, v, out, lse, grad_out, is_causal)
    if not _compile_failed:
        try:
            if _compiled_backward is None:
                _compiled_backward = torch.compile(attention_backward_recompute)
            return _compiled_backward(q, k, v, out, lse, grad_out, is_causal)
        except Exception as exc:  # a missing compiler, an unsupported backend, ...
            if isinstance(exc, torch.OutOfMemoryError):
                raise
            _compile_failed = True
            warnings.warn(f"torch.compile of the attention backward failed ({type(exc).__name__}: {exc}); "
                          "using the eager backward instead", RuntimeWarning, stacklevel=2)
    return attention_backward_recompute(q, k, v, out, lse, grad_out, is_causal)


class FlashAttentionTritonCompiledBackward(FlashAttentionTriton):
    """FlashAttention-2 with the forward of :class:`FlashAttentionTriton` and the backward as compiled PyTorch
    (recomputation equations through ``torch.compile``, eager when compiling is unavailable). Same interface as
    :class:`FlashAttentionTriton`, whose forward it shares."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = compiled_backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return grad_q, grad_k, grad_v, None, None


BACKWARDS = {"triton": FlashAttentionTriton, "compiled": FlashAttentionTritonCompiledBackward}


def flash_attention_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         backward: str = "triton", config: FlashConfig | None = None) -> torch.Tensor:
    """Triton FlashAttention-2 on (batch, heads, seq, d) tensors, for ``lab.model.attention``'s registry.
    The kernels index batch and heads with their own strides, so head-strided views (as the model's
    ``transpose(1, 2)`` makes) are not copied; the output and the gradients come in their input's layout,
    so the model's ``transpose(1, 2).reshape(...)`` of the output (and its backward) is a view, not a
    copy. ``backward`` is ``"triton"`` or ``"compiled"``; ``config`` a :class:`FlashConfig` (None: the
    defaults). Returns (batch, heads, n_queries, d)."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {sorted(BACKWARDS)}, got {backward!r}")
    check_bhsd(q, k, v)
    return BACKWARDS[backward].apply(q, k, v, causal, config)
