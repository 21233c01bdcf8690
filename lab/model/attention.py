"""The one attention registry: every implementation the book compares, behind one signature and one
causal convention.

An implementation is ``fn(q, k, v, causal) -> out`` on ``(batch, heads, seq, head_dim)`` tensors. Causal
masking is **top-left aligned**, as in ``torch.nn.functional.scaled_dot_product_attention``: query ``i``
attends to keys ``j <= i``, indices counted from the start of both sequences, also when
``n_queries != n_keys`` (a query beyond the last key sees every key; with ``n_queries > n_keys`` nothing is
hidden, with ``n_queries < n_keys`` the later keys are never seen).

* ``naive``: scores, softmax and the weighted sum as three separate ops, each inside a profiler/NVTX range
  (``attention/scores``, ``attention/softmax``, ``attention/final_matmul``), so a profile can split them;
  the ranges step aside under ``torch.compile``, so the same function is the compiled baseline too;
* ``sdpa``: PyTorch's fused scaled-dot-product attention (cuDNN/FlashAttention-2/efficient on a GPU);
* ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``, ``sdpa_math``: SDPA restricted to one backend;
* ``flash_triton`` and ``flash_pytorch``: the book's own FlashAttention-2 (``lab.kernels``), imported only
  when asked for (they need Triton).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


class profiler_range:
    """A ``torch.profiler.record_function`` range that is also an NVTX range on CUDA (for nsys users).

    Under ``torch.compile`` it does nothing: the range would break the graph, and compiled kernels carry
    no such ranges anyway.
    """

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
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


def causal_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``(n_queries, n_keys)`` mask, True where query ``i`` may attend key ``j`` (``j <= i``, top-left)."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril()


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """``softmax(Q Kᵀ / sqrt(d)) V`` as three ops that materialize the ``(n_q, n_k)`` scores, each in a range.

    Works on any leading dimensions ``(..., seq, d)``. Query rows with no visible key (none, with the
    top-left convention, since key 0 is always visible) would be NaN as in SDPA.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    with profiler_range("attention/scores"):
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    with profiler_range("attention/softmax"):
        probs = torch.softmax(scores, dim=-1)
    with profiler_range("attention/final_matmul"):
        return probs @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """PyTorch's fused scaled-dot-product attention with its default backend choice."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_backend(backend_name: str) -> AttentionFn:
    def fn(q, k, v, causal=True):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    fn.__name__ = f"sdpa_{backend_name.lower()}"
    fn.__doc__ = f"SDPA restricted to its {backend_name} backend (an error where that backend cannot run)."
    return fn


ATTENTION: dict[str, AttentionFn] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "sdpa_flash": _sdpa_backend("FLASH_ATTENTION"),
    "sdpa_cudnn": _sdpa_backend("CUDNN_ATTENTION"),
    "sdpa_efficient": _sdpa_backend("EFFICIENT_ATTENTION"),
    "sdpa_math": _sdpa_backend("MATH"),
}
# Implementations in modules that need Triton: imported on first use.
_LAZY = {"flash_triton": "lab.kernels.flash_triton", "flash_pytorch": "lab.kernels.flash_pytorch"}


def attention_names() -> list[str]:
    """Every name :func:`get_attention` accepts."""
    return sorted(set(ATTENTION) | set(_LAZY))


def get_attention(name: str) -> AttentionFn:
    """The attention function registered under ``name`` (see the module docstring for the names)."""
    if name not in ATTENTION and name in _LAZY:
        ATTENTION[name] = importlib.import_module(_LAZY[name]).flash_attention_bhsd
    if name not in ATTENTION:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(attention_names())}")
    return ATTENTION[name]
