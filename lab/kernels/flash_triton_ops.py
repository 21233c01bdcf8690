"""The Triton FlashAttention kernels as ``torch.library`` operators, so that ``torch.compile`` sees them.

Dynamo cannot trace into a Triton launch (Python that reads data pointers and calls a CUDA driver), so a
call it meets inside a compiled function would break the graph in two. Registered as operators with a fake
(shape-only) implementation, the kernels are nodes of known output shapes that dynamo, AOTAutograd and
Inductor pass through.

* ``lab::flash_attention_forward(q, k, v, causal, *config) -> (out, lse)``;
* ``lab::flash_attention_backward(grad_out, q, k, v, out, lse, causal, *config) -> (dq, dk, dv)``;

where ``*config`` are the fields of :class:`~lab.kernels.flash_config.FlashConfig` as plain schema
arguments, in declaration order (``FlashConfig.op_args``). ``out`` and the gradients are tensors of their
input's shape, dtype and memory layout (``triton_env.empty_in_layout``), ``lse`` is fp32 of shape
``q.shape[:-1]``; inputs are (batch, seq, d) or (batch, heads, seq, d). The forward op is differentiable
on its own (``register_autograd``: its backward is the backward op);
``lab.kernels.flash_triton.FlashAttentionTriton`` calls both from an ``autograd.Function``, which dynamo
traces into a graph with these two ops.

Both are ``torch.library.triton_op`` operators: while AOTAutograd functionalizes a graph (``torch.compile``) they
decompose into their implementation. With ``FlashConfig.compile_inline`` (on by default, see there) on a
GPU (:func:`~lab.kernels.flash_config.inlines`) that is the host function with every launch wrapped in
``torch.library.wrap_triton`` (``flash_launch.inline_launch``), so the graph Inductor compiles holds the
Triton kernels themselves, launched by Inductor's generated code without the op's Python (the custom-op
dispatch, the config, the checks, the tile tables, the launch arguments) on every call. Where the launches
cannot be traced (the interpreter, whose kernels run on the host's data; the autotuner, which times
candidates on real data) the decomposition is one call of an opaque twin,
``lab::flash_attention_forward_opaque`` / ``lab::flash_attention_backward_opaque`` (``torch.library.custom_op``,
the same schema), which Inductor calls at run time as it would any custom op. The forward decomposes into
that opaque twin as well where it runs the Gluon kernel (``FlashConfig.forward_kernel``,
:func:`~lab.kernels.flash_dispatch.which_forward`: Inductor traces Triton-language launches, not Gluon ones);
the backward likewise where it runs the Gluon backward (``FlashConfig.backward_kernel``,
:func:`~lab.kernels.flash_dispatch.which_backward`), each op on its own choice: a Gluon forward with the portable
backward still inlines the backward's launches. On real tensors (an eager call, or the op's kernel below a
dispatch mode) both ops run their host function with the fast launcher,
:func:`~lab.kernels.flash_dispatch.forward` and :func:`~lab.kernels.flash_dispatch.backward`, which run the
kernels ``which_forward`` and ``which_backward`` pick.

:func:`attention_forward` / :func:`attention_backward` are what the autograd functions call: the ops when
anything traces or a dispatch mode is active (selective activation checkpointing saves an op's outputs by
seeing the op), the host functions directly for eager calls on plain tensors (the dispatcher's host time
per call is on the critical path for small shapes).

(No ``from __future__ import annotations`` here: ``custom_op`` and ``triton_op`` read the schema from the
annotations.)
"""

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lab.kernels.flash_config import FlashConfig, check_triton_inputs, inlines
from lab.kernels.flash_dispatch import backward, forward, which_backward, which_forward
from lab.kernels.flash_launch import inline_launch
from lab.kernels.flash_triton_backward import flash_backward
from lab.kernels.flash_triton_forward import flash_forward
from lab.kernels.triton_env import empty_in_layout


def _plain(*tensors) -> bool:
    """True for real tensors (not fake, functional or another subclass): the call runs the kernels now."""
    return all(type(t) is Tensor for t in tensors)


# ------------------------------------------------------------------------------------------------ forward
def _forward_fake(q, k, v, causal, *config):
    check_triton_inputs(q, k, v)  # the same one-line errors at trace time as in eager mode
    which_forward(q, k, v, causal, FlashConfig(*config))  # forward_kernel="gluon" where Gluon cannot run: an error
    return empty_in_layout(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lab::flash_attention_forward_opaque", mutates_args=())
def _forward_opaque(q: Tensor, k: Tensor, v: Tensor, causal: bool, autotune: bool, fast_launch: bool,
                    fp32_precision: str, fwd_tiles: list[int], backward_launch: str, bwd_tiles: list[int],
                    compile_inline: bool, split_d: str,
                    forward_kernel: str, backward_kernel: str) -> tuple[Tensor, Tensor]:
    """The forward's kernels as one opaque node, for traced calls whose launches cannot be traced."""
    config = FlashConfig(autotune, fast_launch, fp32_precision, fwd_tiles, backward_launch, bwd_tiles, compile_inline,
                         split_d, forward_kernel, backward_kernel)
    return forward(q, k, v, causal, config)


_forward_opaque.register_fake(_forward_fake)


@torch.library.triton_op("lab::flash_attention_forward", mutates_args=())
def flash_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, autotune: bool, fast_launch: bool,
                               fp32_precision: str, fwd_tiles: list[int], backward_launch: str,
                               bwd_tiles: list[int], compile_inline: bool, split_d: str,
                               forward_kernel: str, backward_kernel: str) -> tuple[Tensor, Tensor]:
    """FlashAttention forward: (output, fp32 logsumexp)."""
    config = FlashConfig(autotune, fast_launch, fp32_precision, fwd_tiles, backward_launch, bwd_tiles, compile_inline,
                         split_d, forward_kernel, backward_kernel)
    if _plain(q, k, v):
        return forward(q, k, v, causal, config)
    # Inductor traces the launches of Triton-language kernels (wrap_triton), not those of Gluon kernels
    if inlines(config, q.device) and which_forward(q, k, v, causal, config) == "triton":
        return flash_forward(q, k, v, causal, config, launcher=inline_launch)
    return _forward_opaque(q, k, v, causal, *config.op_args())


# triton_op's own fake runs the implementation on fake tensors, which an interpreted kernel cannot take
flash_attention_forward_op.register_fake(_forward_fake)


# ----------------------------------------------------------------------------------------------- backward
def _backward_fake(grad_out, q, k, v, out, lse, causal, *config):
    which_backward(q, k, v, causal, FlashConfig(*config))  # backward_kernel="gluon" where Gluon cannot run: an error
    return empty_in_layout(q), empty_in_layout(k), empty_in_layout(v)


@torch.library.custom_op("lab::flash_attention_backward_opaque", mutates_args=())
def _backward_opaque(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                     autotune: bool, fast_launch: bool, fp32_precision: str, fwd_tiles: list[int],
                     backward_launch: str, bwd_tiles: list[int], compile_inline: bool, split_d: str,
                     forward_kernel: str, backward_kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's kernels as one opaque node, for traced calls whose launches cannot be traced."""
    config = FlashConfig(autotune, fast_launch, fp32_precision, fwd_tiles, backward_launch, bwd_tiles, compile_inline,
                         split_d, forward_kernel, backward_kernel)
    return backward(q, k, v, out, lse, grad_out, causal, config)


_backward_opaque.register_fake(_backward_fake)


@torch.library.triton_op("lab::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                causal: bool, autotune: bool, fast_launch: bool, fp32_precision: str,
                                fwd_tiles: list[int], backward_launch: str, bwd_tiles: list[int],
                                compile_inline: bool, split_d: str,
                                forward_kernel: str, backward_kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention backward: (dq, dk, dv)."""
    config = FlashConfig(autotune, fast_launch, fp32_precision, fwd_tiles, backward_launch, bwd_tiles, compile_inline,
                         split_d, forward_kernel, backward_kernel)
    if _plain(grad_out, q, k, v, out, lse):
        return backward(q, k, v, out, lse, grad_out, causal, config)
    # as in the forward: only the portable kernels' launches can be handed to Inductor
    if inlines(config, q.device) and which_backward(q, k, v, causal, config) == "triton":
        return flash_backward(q, k, v, out, lse, grad_out, causal, config, launcher=inline_launch)
    return _backward_opaque(grad_out, q, k, v, out, lse, causal, *config.op_args())


flash_attention_backward_op.register_fake(_backward_fake)


# ----------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    q, k, v, causal, *config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)
    ctx.causal = causal
    ctx.config = config


def _forward_op_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grads = torch.ops.lab.flash_attention_backward(grad_out, q, k, v, out, lse, ctx.causal, *ctx.config)
    return (*grads, *(None for _ in range(1 + len(ctx.config))))


flash_attention_forward_op.register_autograd(_forward_op_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ entry points
def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is active (selective activation checkpointing, ``FlopCounterMode``).

    PyTorch has no public query for it: this reads ``torch.utils._python_dispatch``, the one private call left
    in these ops, kept for the eager shortcut of :func:`attention_forward` (a mode must see the op, so the
    shortcut may only skip the dispatcher where none is active). If it moved, dropping the shortcut (always
    calling the ops) would stay correct at the dispatcher's cost; ``tests/kernels/test_flash_compile.py``
    checks both sides."""
    return _get_current_dispatch_mode() is not None


def _eager(*tensors) -> bool:
    """True for an eager call on plain tensors with no dispatch mode active; False under torch.compile, for
    fake, meta or subclassed tensors, and inside a ``TorchDispatchMode``, which must all see the registered
    ops."""
    return not torch.compiler.is_compiling() and not dispatch_mode_active() and _plain(*tensors)


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, config: FlashConfig) -> tuple[Tensor, Tensor]:
    """(output, logsumexp): the host function for eager calls on plain tensors, else the forward op."""
    if _eager(q, k, v):
        return forward(q, k, v, causal, config)
    return torch.ops.lab.flash_attention_forward(q, k, v, causal, *config.op_args())


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       config: FlashConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the host function for eager calls on plain tensors, else the backward op."""
    if _eager(grad_out, q, k, v, out, lse):
        return backward(q, k, v, out, lse, grad_out, causal, config)
    return torch.ops.lab.flash_attention_backward(grad_out, q, k, v, out, lse, causal, *config.op_args())
