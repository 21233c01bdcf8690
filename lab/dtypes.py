"""The one dtype table: names the book uses for floating-point formats, and what each name means where.

A *name* (``"fp32"``, ``"bf16"``, ...) means one ``torch.dtype`` everywhere (:data:`DTYPES`). Two questions
are asked of it in different places, each answered by one function here:

* as a tensor's dtype (attention inputs, accumulation experiments): :func:`torch_dtype`;
* as a training precision (``lab.bench``'s ``dtype="bf16"``: fp32 master weights with matmuls under
  autocast; ``"fp32"``: no autocast): :func:`autocast_dtype` and :func:`autocast`.

Leaf module: imports nothing from ``lab``.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES: dict[str, torch.dtype] = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16,
                                   "bf16": torch.bfloat16}
#: Names accepted as a training precision (``fp32``: no autocast; ``bf16``/``fp16``: autocast to it).
TRAINING_DTYPES = ("fp32", "bf16", "fp16")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The ``torch.dtype`` called ``name`` (a dtype passes through); a clear error for an unknown name."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | str) -> str:
    """The book's short name of ``dtype`` (``torch.bfloat16`` -> ``"bf16"``); other dtypes by torch's name."""
    if isinstance(dtype, str):
        torch_dtype(dtype)
        return dtype
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def element_size(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype`` (a name or a ``torch.dtype``)."""
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def autocast_dtype(name: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in for training precision ``name``: None for ``fp32`` (no autocast)."""
    if name not in TRAINING_DTYPES:
        raise ValueError(f"unknown training dtype {name!r}; choose one of {', '.join(TRAINING_DTYPES)}")
    return None if name == "fp32" else DTYPES[name]


def autocast(device: torch.device | str, name: str):
    """``torch.autocast`` to ``name``'s dtype on ``device``; a no-op context for ``fp32``."""
    dtype = autocast_dtype(name)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
