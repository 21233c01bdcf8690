"""GPU kernels and their PyTorch references: FlashAttention-2 (tiled PyTorch and Triton, with forward and backward
kernels for Hopper in Triton's Gluon layer; ``flash_dispatch`` says which forward runs) and the fused LM-head
cross-entropy.

Each kernel file reads like a Triton tutorial: the kernel, its Python wrapper (an autograd function,
registered with ``torch.library`` so that ``torch.compile`` and FSDP see an ordinary operator), input
checks. Kernels run compiled on a CUDA GPU or interpreted on the CPU (``TRITON_INTERPRET=1``).

May import: torch, triton, numpy. Nothing else from ``lab``.
"""
