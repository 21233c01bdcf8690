"""The Triton FlashAttention kernels as ``torch.library`` operators, so that ``torch.compile`` sees them.

Dynamo cannot trace into a Triton launch (Python that reads data pointers and calls a CUDA driver), so a
call it meets inside a compiled function would break the graph in two. Registered as custom operators
with a fake (shape-only) implementation, the kernels are opaque nodes of known output shapes that dynamo,
AOTAutograd and Inductor pass through; Inductor calls the real implementation at run time.

* ``lab::flash_attention_forward(q, k, v, causal, *config) -> (out, lse)``;
* ``lab::flash_attention_backward(grad_out, q, k, v, out, lse, causal, *config) -> (dq, dk, dv)``;

where ``*config`` are the fields of :class:`~lab.kernels.flash_config.FlashConfig` as plain schema
arguments, in declaration order (``FlashConfig.op_args``). ``out`` and the gradients are tensors of their
input's shape, dtype and memory layout (``triton_env.empty_in_layout``), ``lse`` is fp32 of shape
``q.shape[:-1]``; inputs are (batch, seq, d) or (batch, heads, seq, d). The forward op is differentiable
on its own (``register_autograd``: its backward is the backward op);
``lab.kernels.flash_triton.FlashAttentionTriton`` calls both from an ``autograd.Function``, which dynamo
traces into a graph with these two ops.

With ``FlashConfig.compile_inline`` (on by default, see there), under ``torch.compile`` on a GPU
(:func:`~lab.kernels.flash_config.inlines`) both ops decompose while AOTAutograd functionalizes the graph:
their host function runs once on the traced tensors with every launch wrapped in
``torch.library.wrap_triton`` (``flash_launch.inline_launch``), so the graph Inductor compiles holds the
Triton kernels themselves, launched by Inductor's generated code without the op's Python (the custom-op
dispatch, the config, the checks, the tile tables, the launch arguments) on every call. That is what
``torch.library.triton_op`` does; it is done here by hand so that the same ops stay opaque where
decomposing is not possible (the interpreter, autotuning) and a dispatch mode (selective
activation checkpointing) still sees them by name.

:func:`attention_forward` / :func:`attention_backward` are what the autograd functions call: the ops when
anything traces, the host functions directly for eager calls on plain tensors (the dispatcher costs
~8 us of host time per call, on the critical path for small shapes).

(No ``from __future__ import annotations`` here: ``custom_op`` reads the schema from the annotations.)
"""

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lab.kernels.flash_config import FlashConfig, check_triton_inputs, inlines
from lab.kernels.flash_launch import inline_launch
from lab.kernels.flash_triton_backward import flash_backward
from lab.kernels.flash_triton_forward import flash_forward
from lab.kernels.triton_env import empty_in_layout


@torch.library.custom_op("lab::flash_attention_forward", mutates_args=())
def flash_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, autotune: bool, fast_launch: bool,
                               fp32_precision: str, fwd_tiles: list[int], backward_launch: str,
                               bwd_tiles: list[int], compile_inline: bool, split_d: str) -> tuple[Tensor, Tensor]:
    """FlashAttention forward: (output, fp32 logsumexp)."""
    config = FlashConfig(autotune, fast_launch, fp32_precision, fwd_tiles, backward_launch, bwd_tiles, compile_inline,
                         split_d)
    return flash_forward(q, k, v, causal, config)


@flash_attention_forward_op.register_fake
def _forward_fake(q, k, v, causal, *config):
    check_triton_inputs(q, k, v)  # the same one-line errors at trace time as in eager mode
    FlashConfig(*config)
    return empty_in_layout(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lab::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                causal: bool, autotune: bool, fast_launch: bool, fp32_precision: str,
                                fwd_tiles: list[int], backward_launch: str, bwd_tiles: list[int],
                                compile_inline: bool, split_d: str) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention backward: (dq, dk, dv)."""
    config = FlashConfig(autotune, fast_launch, fp32_precision, fwd_tiles, backward_launch, bwd_tiles, compile_inline,
                         split_d)
    return flash_backward(q, k, v, out, lse, grad_out, causal, config)


@flash_attention_backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, causal, *config):
    return empty_in_layout(q), empty_in_layout(k), empty_in_layout(v)


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


def _decomposes(types, q: Tensor, config: FlashConfig) -> bool:
    """Whether a call seen by the functionalization mode is traced into its kernel launches: plain, fake or
    functional tensors only (another subclass keeps the op), and :func:`inlines` for this config and device."""
    plain = all(t is Tensor or issubclass(t, (FakeTensor, FunctionalTensor)) for t in types)
    return plain and inlines(config, q.device)


def _functional_forward(mode, op, types, args, kwargs):
    q, k, v, causal, *fields = args
    config = FlashConfig(*fields)
    if kwargs or not _decomposes(types, q, config):
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        return flash_forward(q, k, v, causal, config, launcher=inline_launch)


def _functional_backward(mode, op, types, args, kwargs):
    grad_out, q, k, v, out, lse, causal, *fields = args
    config = FlashConfig(*fields)
    if kwargs or not _decomposes(types, q, config):
        return mode.__torch_dispatch__(op, types, args, kwargs)
    with mode:
        return flash_backward(q, k, v, out, lse, grad_out, causal, config, launcher=inline_launch)


flash_attention_forward_op.register_torch_dispatch(FunctionalTensorMode, _functional_forward)
flash_attention_backward_op.register_torch_dispatch(FunctionalTensorMode, _functional_backward)


def _eager(*tensors) -> bool:
    """True for an eager call on plain tensors with no dispatch mode active; False under torch.compile, for
    fake, meta or subclassed tensors, and inside a ``TorchDispatchMode`` (selective activation checkpointing
    saves an op's outputs by seeing the op), which must all see the registered ops."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(type(t) is torch.Tensor for t in tensors))


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, config: FlashConfig) -> tuple[Tensor, Tensor]:
    """(output, logsumexp): the host function for eager calls on plain tensors, else the forward op."""
    if _eager(q, k, v):
        return flash_forward(q, k, v, causal, config)
    return torch.ops.lab.flash_attention_forward(q, k, v, causal, *config.op_args())


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       config: FlashConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv): the host function for eager calls on plain tensors, else the backward op."""
    if _eager(grad_out, q, k, v, out, lse):
        return flash_backward(q, k, v, out, lse, grad_out, causal, config)
    return torch.ops.lab.flash_attention_backward(grad_out, q, k, v, out, lse, causal, *config.op_args())
