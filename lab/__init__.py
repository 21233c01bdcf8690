"""The systems lab book: measure where a Transformer's training time and memory go.

Public names are imported lazily so that ``import lab`` works on a machine without Triton or a GPU.
"""

from __future__ import annotations

import importlib
import os

import torch

__version__ = "0.1.0"

# Triton compiles for GPUs only; without one, the book's kernels run in Triton's interpreter (slow, for
# small shapes: the tests and the quick book). Triton reads the switch when it is first imported (its own
# library functions, tl.max and tl.sum among them, are defined then), and torch imports Triton as soon as
# torch.compile's machinery loads, so it must be set here, before anything else in lab runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# public name -> module that defines it
_LAZY = {
    "TransformerLM": "lab.model.transformer",
    "ModelConfig": "lab.model.transformer",
    "MODEL_SIZES": "lab.model.transformer",
    "FlashAttentionPytorch": "lab.kernels.flash_pytorch",
    "FlashAttentionTriton": "lab.kernels.flash_triton",
    "NaiveDDP": "lab.parallel.ddp",
    "FlatDDP": "lab.parallel.ddp",
    "DDPIndividualParameters": "lab.parallel.ddp",
    "DDPBucketed": "lab.parallel.ddp",
    "ShardedOptimizer": "lab.parallel.sharded_optimizer",
    "FSDP": "lab.parallel.fsdp",
    "ZeRO1Optimizer": "lab.parallel.zero1",
    "fused_linear_cross_entropy": "lab.kernels.fused_cross_entropy",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lab' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
