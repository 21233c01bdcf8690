"""GPU kernels and their PyTorch references: FlashAttention-2 (tiled PyTorch and Triton) and the fused
LM-head cross-entropy.

Each kernel file reads like a Triton tutorial: the kernel, its Python wrapper (an autograd function,
registered with ``torch.library`` so that ``torch.compile`` and FSDP see an ordinary operator), input
checks. Kernels run compiled on a CUDA GPU or interpreted on the CPU (``TRITON_INTERPRET=1``).

May import: torch, triton, numpy. Nothing else from ``lab``.
"""

import os as _os

import torch as _torch

# Triton compiles for GPUs only: on a machine without one, the kernels run in Triton's interpreter (slow,
# for small shapes: tests and the quick book). This must happen before any kernel is defined, i.e. here,
# before the first kernel module is imported; an explicit TRITON_INTERPRET wins.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")
