"""What the Triton kernel families of :mod:`lab.kernels` (FlashAttention, the fused LM-head loss) share about
their environment: whether Triton runs interpreted, the dtypes the kernels take, the interpreter's bf16
workaround, whether PyTorch allows TF32, and the one layout requirement of their inputs.

Imports only torch, so both families (and their tests on the CPU) can use it without importing each other.
"""

from __future__ import annotations

import os

import torch

#: True when this process runs Triton kernels in the interpreter (``TRITON_INTERPRET=1``, which
#: :func:`lab.use_triton_interpreter` sets on a machine without a GPU); read once, before any ``@triton.jit``
#: function is defined.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreter_needs_fp32(dtype: torch.dtype) -> bool:
    """True for bf16 under ``TRITON_INTERPRET=1``: Triton 3.6's interpreter gets ``tl.dot`` of bf16 tiles wrong
    (a single 16x16 product is off by ~1e10; fp16 and fp32 are right), so there the bf16 kernels run on fp32
    copies of their inputs and cast the results back. Compiled on a GPU, bf16 runs natively."""
    return INTERPRET and dtype == torch.bfloat16


def tf32_allowed() -> bool:
    """True when PyTorch lets its own fp32 matmuls use TF32: ``torch.backends.cuda.matmul.fp32_precision``
    (torch >= 2.9) when set, else the legacy ``allow_tf32`` / ``torch.get_float32_matmul_precision()``."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if setting in ("tf32", "ieee"):
        return setting == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # torch refuses legacy queries once the new API has been used: treat as not allowed
        return False


def empty_in_layout(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape (and dtype unless given) in ``t``'s memory layout when that
    layout is dense with a unit last stride, else contiguous. A transposed view, such as the model's
    (batch, seq, heads, d) projection seen as (batch, heads, seq, d), then gets an output (or gradient) that
    transposes back into (batch, seq, heads * d) as a view, where a contiguous one would be copied."""
    if t.stride(-1) == 1:
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension without a stride: copy only when it is not contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()
