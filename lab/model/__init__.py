"""The Transformer language model (one readable file, ``transformer.py``), its size table, the attention
registry, and activation checkpointing applied from outside.

The model knows nothing of benchmarking, profiling or parallelism: those take any ``nn.Module`` and are
applied from outside (torchtitan style).

May import: torch, ``lab.kernels`` (lazily: its kernels need Triton, an optional dependency), the leaf ``lab.units``.
"""

from lab.model.transformer import (
    MODEL_SIZES,
    QUICK_SIZES,
    LMHead,
    ModelConfig,
    RMSNorm,
    TransformerBlock,
    TransformerLM,
    config_for,
)

__all__ = ["LMHead", "MODEL_SIZES", "QUICK_SIZES", "ModelConfig", "RMSNorm", "TransformerBlock", "TransformerLM",
           "config_for"]
