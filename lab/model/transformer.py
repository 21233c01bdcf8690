"""The Transformer language model: pre-norm RMSNorm, RoPE, SwiGLU, causal multi-head attention.

Plain PyTorch in one file (nanoGPT style). The model knows nothing of benchmarking, checkpointing or
parallelism; those are applied from outside. The attention implementation is switchable by name.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

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
    attention: str = "sdpa"

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError("RoPE needs an even head dimension")
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "context_length", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

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
# Attention implementations: fn(q, k, v, causal) on (batch, heads, seq, head_dim) tensors.


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Scores, softmax and the weighted sum as three separate ops, each inside a profiler/NVTX range."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    with _range("attention/scores"):
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            n_q, n_k = q.shape[-2], k.shape[-2]
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
            scores = scores.masked_fill(~mask, float("-inf"))
    with _range("attention/softmax"):
        probs = torch.softmax(scores, dim=-1)
    with _range("attention/final_matmul"):
        return probs @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """PyTorch's fused scaled-dot-product attention (FlashAttention/cuDNN/efficient kernels on GPU)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class _range:
    """A ``torch.profiler.record_function`` range that is also an NVTX range on CUDA (for nsys users)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        # Under torch.compile the ranges would break the graph; the compiled kernels carry no such ranges.
        self._active = not torch.compiler.is_compiling()
        if not self._active:
            return
        self._rf = torch.profiler.record_function(self.name)
        self._rf.__enter__()
        self._nvtx = torch.cuda.is_available()
        if self._nvtx:
            torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc):
        if not self._active:
            return
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._rf.__exit__(*exc)


_ATTENTION: dict[str, Callable] = {"naive": naive_attention, "sdpa": sdpa_attention}
# Implementations that live in modules needing Triton: imported only when asked for.
_LAZY_ATTENTION = {"flash_triton": "lab.kernels.flash_triton", "flash_pytorch": "lab.kernels.flash_pytorch"}


def register_attention(name: str, fn: Callable) -> None:
    """Make ``fn(q, k, v, causal)`` on (batch, heads, seq, d) tensors selectable as ``attention=name``."""
    _ATTENTION[name] = fn


def get_attention(name: str) -> Callable:
    """The attention function registered under ``name``."""
    if name not in _ATTENTION and name in _LAZY_ATTENTION:
        _ATTENTION[name] = importlib.import_module(_LAZY_ATTENTION[name]).flash_attention_bhsd
    if name not in _ATTENTION:
        raise ValueError(f"unknown attention {name!r}; choose one of "
                         f"{', '.join(sorted(set(_ATTENTION) | set(_LAZY_ATTENTION)))}")
    return _ATTENTION[name]


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
        get_attention(cfg.attention)  # fail at construction on an unknown name
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


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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


class TransformerLM(nn.Module):
    """Decoder-only LM: token embedding, ``num_layers`` pre-norm blocks, final RMSNorm, untied LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_final = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = math.sqrt(2.0 / (module.in_features + module.out_features))
            nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        elif isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=1.0, a=-3, b=3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for integer tokens of shape (batch, seq)."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm_final(x))

    def num_parameters(self, include_embedding: bool = True) -> int:
        """Number of parameters (each shared parameter counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n if include_embedding else n - self.embedding.weight.numel()

    @classmethod
    def from_size(cls, size: str, **overrides) -> "TransformerLM":
        return cls(config_for(size, **overrides))

