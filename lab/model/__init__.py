"""The Transformer language model (one readable file, ``transformer.py``), its size table, the attention
registry, and activation checkpointing and offloading applied from outside.

The model knows nothing of benchmarking, profiling or parallelism: those take any ``nn.Module`` and are
applied from outside (torchtitan style).

May import: torch, ``lab.kernels`` (lazily: its kernels need Triton, an optional dependency), the leaf ``lab.units``.
"""

from lab.model.offload import ActivationOffloader, OffloadStats, activation_offloading, offload_cost_model
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

__all__ = ["ActivationOffloader", "LMHead", "MODEL_SIZES", "OffloadStats", "QUICK_SIZES", "ModelConfig", "RMSNorm",
           "TransformerBlock", "TransformerLM", "activation_offloading", "config_for", "offload_cost_model"]
