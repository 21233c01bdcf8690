"""The systems lab book: measure where a Transformer's training time and memory go.

Public names are imported lazily so that ``import lab`` works on a machine without Triton or a GPU.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "TransformerLM": "lab.model",
    "ModelConfig": "lab.model",
    "MODEL_SIZES": "lab.model",
    "FlashAttentionPytorch": "lab.flash_pytorch",
    "FlashAttentionTriton": "lab.flash_triton",
    "NaiveDDP": "lab.ddp",
    "FlatDDP": "lab.ddp",
    "DDPIndividualParameters": "lab.ddp",
    "DDPBucketed": "lab.ddp",
    "ShardedOptimizer": "lab.sharded_optimizer",
    "FSDP": "lab.fsdp",
    "ZeRO1Optimizer": "lab.zero1",
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
