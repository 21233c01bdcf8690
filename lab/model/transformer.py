"""The Transformer language model: pre-norm RMSNorm, RoPE, SwiGLU, causal multi-head attention.

Plain PyTorch in one file (nanoGPT style). The model knows nothing of benchmarking, checkpointing or
parallelism; those are applied from outside. The attention implementation is switchable by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab.model.attention import attention_names, get_attention

# Sizes from the spec; batch 4 and vocabulary 10,000 throughout. (Some courses call the 2560-wide model
# "xl"; here "xl" is the 1600-wide one and the 2560-wide one is "2.7B".)
MODEL_SIZES: dict[str, dict[str, int]] = {
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
}
SIZE_ALIASES = {"2.7b": "2.7B", "10b": "10B"}
# Toy sizes for the quick (CPU) profile of the notebooks; not part of the spec's table.
QUICK_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "mini": dict(d_model=128, d_ff=512, num_layers=4, num_heads=4),
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of :class:`TransformerLM`."""

    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    context_length: int = 512
    vocab_size: int = 10_000
    rope_theta: float = 10_000.0
    attention: str = "sdpa"  # a name of lab.model.attention's registry
    fused_loss: bool = False  # loss through lab.kernels' fused LM head + cross-entropy (no logits in memory)

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError("RoPE needs an even head dimension")
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "context_length", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention not in attention_names():
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {', '.join(attention_names())}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def config_for(size: str, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a named size (``small`` ... ``10B``), with any field overridden."""
    key = SIZE_ALIASES.get(size, size)
    table = {**MODEL_SIZES, **QUICK_SIZES}
    if key not in table:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(table)}")
    return ModelConfig(**table[key], **overrides)


# ----------------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics are computed in fp32 whatever the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate pairs of query/key features by position-dependent angles (tables precomputed once)."""

    def __init__(self, head_dim: int, context_length: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        if seq > self.cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds the context length {self.cos.shape[0]}")
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.attention = cfg.attention
        # resolved (its module imported) here, not in forward: torch.compile cannot trace a first call's import,
        # and a compiled forward that met it would break its graph around every layer's attention
        get_attention(cfg.attention)
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y):
            return y.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = self.rope(q), self.rope(k)
        y = get_attention(self.attention)(q, k, v, True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class SiLUGate(nn.Module):
    """``silu(a) * b``, SwiGLU's gate: a module of its own (no parameters) so that it can be compiled from
    outside without the matrices around it."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.gate = SiLUGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = RMSNorm(cfg.d_model)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class LMHead(nn.Linear):
    """The output projection (an ``nn.Linear`` without bias) that can also return the next-token loss.

    ``head(x)`` gives logits. ``head(x, targets)`` gives the cross-entropy of those logits: materialized
    (``F.cross_entropy`` on fp32 logits) or, with ``fused=True``, through
    ``lab.kernels.fused_linear_cross_entropy``, which never holds the ``(tokens, vocab)`` logits in memory.
    The loss is computed *inside* this module's call so that wrappers that gather the weight around a
    module call (``lab.FSDP``, FSDP2) see it like any other use of the weight.
    """

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, fused: bool = False,
                reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        hidden, flat_targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        if fused:
            # optional dependency: Triton (Linux only), imported only when the fused loss is asked for
            from lab.kernels.fused_cross_entropy import fused_linear_cross_entropy

            return fused_linear_cross_entropy(hidden, self.weight, flat_targets, reduction=reduction,
                                              ignore_index=ignore_index)
        logits = super().forward(hidden)
        return F.cross_entropy(logits.float(), flat_targets, reduction=reduction, ignore_index=ignore_index)


class TransformerLM(nn.Module):
    """Decoder-only LM: token embedding, ``num_layers`` pre-norm blocks, final RMSNorm, untied LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_final = RMSNorm(cfg.d_model)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = math.sqrt(2.0 / (module.in_features + module.out_features))
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        elif isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=1.0, a=-3, b=3)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for integer ``tokens`` ``(batch, seq)``; with ``targets``
        ``(batch, seq)``, the next-token cross-entropy instead (``reduction`` "mean" or "sum"), through the
        fused kernel when ``cfg.fused_loss``. The logits and the loss do not depend on ``fused_loss``."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm_final(x)
        if targets is None:
            return self.lm_head(x)
        return self.lm_head(x, targets, fused=self.cfg.fused_loss, reduction=reduction)

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Number of parameters (each shared parameter counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_embedding else n - self.embedding.weight.numel()
