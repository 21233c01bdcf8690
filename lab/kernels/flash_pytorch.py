"""FlashAttention-2 written in plain PyTorch: the algorithm, tile by tile, before it becomes a kernel.

Nothing here is fast. The point is to see the algorithm with nothing else in the way:

* the forward walks query tiles, and for each one streams key/value tiles through an *online softmax*
  (a running row maximum ``m``, a running denominator ``l`` and an unnormalised output ``acc``), so the
  ``n_queries x n_keys`` score matrix never exists in memory;
* it saves only Q, K, V, the output O and the logsumexp ``L`` of every query row;
* the backward recomputes the probabilities tile by tile from ``L`` (``P = exp(S - L)``) and uses
  ``D = rowsum(dO * O)`` in place of the row sums of ``P * dP``.

Causal masking follows the convention of ``torch.nn.functional.scaled_dot_product_attention``: query ``i``
attends to keys ``j <= i`` (indices counted from the start of both sequences, also when
``n_queries != n_keys``). Masked scores get ``-1e6`` added rather than ``-inf`` so that arithmetic on
them stays finite.

The same file holds :func:`attention_reference` (the textbook computation, used by the tests in float64
and by the benchmarks as "naive PyTorch") and :func:`attention_backward_recompute` (the untiled
recomputation backward that :mod:`lab.kernels.flash_triton` compiles with ``torch.compile``).
"""

from __future__ import annotations

import math

import torch

#: Added to the scores of masked (future) keys. Large enough that ``exp`` of it is exactly zero in every
#: floating-point type used here, small enough that ``masked - max`` never overflows.
MASK_VALUE = -1.0e6

#: Default tile sizes (rows of Q, rows of K/V) of the PyTorch implementation.
DEFAULT_Q_TILE = 64
DEFAULT_K_TILE = 64


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error unless q, k, v are (batch, seq, d) floating tensors that fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape (batch, seq, d); got {t.dim()} dimensions {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of keys; got {k.shape[1]} and {v.shape[1]}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"head dimension d differs: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError("attention needs at least one query and one key")


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16/fp32 inputs accumulate in fp32; float64 inputs stay float64 (for reference checks)."""
    return torch.promote_types(dtype, torch.float32)


def causal_mask_bias(q_index: torch.Tensor, k_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias (queries x keys): 0 where key <= query, ``MASK_VALUE`` where the key is in the future."""
    future = k_index[None, :] > q_index[:, None]
    return torch.where(future, MASK_VALUE, 0.0).to(dtype)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention ``softmax(Q K^T / sqrt(d)) V`` on (batch, seq, d) tensors, in their own dtype.

    Materialises the full (batch, n_queries, n_keys) score matrix: the memory cost FlashAttention
    removes. Differentiable with ordinary autograd. Returns ``(output, logsumexp)`` where logsumexp has
    shape (batch, n_queries) and is taken over the scaled, masked scores.
    """
    check_attention_inputs(q, k, v)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        idx_q = torch.arange(q.shape[1], device=q.device)
        idx_k = torch.arange(k.shape[1], device=q.device)
        scores = scores + causal_mask_bias(idx_q, idx_k, scores.dtype)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def attention_backward_recompute(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    grad_o: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dQ, dK, dV) of attention from the FlashAttention-2 recomputation equations, untiled.

    ``P = exp(S - L)`` is rebuilt from the saved logsumexp ``lse``; ``D = rowsum(dO * O)``;
    ``dS = P * (dO V^T - D)``; ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)``, ``dV = P^T dO``.
    Matrix products run in the input dtype (tensor cores on a GPU), the softmax algebra in fp32 (or
    float64 for float64 inputs). Written without tiles so that ``torch.compile`` can fuse the elementwise
    work; it does materialise (batch, n_queries, n_keys) matrices.
    """
    acc = _accumulator_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)).to(acc) * scale
    if is_causal:
        idx_q = torch.arange(q.shape[1], device=q.device)
        idx_k = torch.arange(k.shape[1], device=q.device)
        scores = scores + causal_mask_bias(idx_q, idx_k, acc)
    p = torch.exp(scores - lse.to(acc)[..., None])
    delta = (grad_o.to(acc) * o.to(acc)).sum(dim=-1)
    grad_v = p.to(v.dtype).transpose(-1, -2) @ grad_o
    grad_p = (grad_o @ v.transpose(-1, -2)).to(acc)
    grad_s = (p * (grad_p - delta[..., None]) * scale).to(q.dtype)
    grad_q = grad_s @ k
    grad_k = grad_s.transpose(-1, -2) @ q
    return grad_q, grad_k, grad_v


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 as a ``torch.autograd.Function`` in pure PyTorch (tiled forward and backward).

    ``FlashAttentionPytorch.apply(q, k, v, is_causal=False[, q_tile, k_tile])`` on (batch, seq, d) tensors
    returns the attention output (batch, n_queries, d) in the input dtype. Tiles are at least 16 x 16;
    sequence lengths need not be multiples of them (the last tile is simply shorter). Saved for backward:
    q, k, v, o and the logsumexp L of shape (batch, n_queries), nothing else.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, q_tile=DEFAULT_Q_TILE, k_tile=DEFAULT_K_TILE):
        check_attention_inputs(q, k, v)
        if q_tile < 16 or k_tile < 16:
            raise ValueError(f"tiles must be at least 16 x 16, got {q_tile} x {k_tile}")
        batch, n_q, d = q.shape
        n_k = k.shape[1]
        acc = _accumulator_dtype(q.dtype)
        scale = 1.0 / math.sqrt(d)
        out = torch.empty_like(q)
        lse = torch.empty(batch, n_q, dtype=acc, device=q.device)
        idx = torch.arange(max(n_q, n_k), device=q.device)

        for qs in range(0, n_q, q_tile):
            qe = min(qs + q_tile, n_q)
            q_i = q[:, qs:qe].to(acc)
            row_max = torch.full((batch, qe - qs), -math.inf, dtype=acc, device=q.device)
            row_sum = torch.zeros(batch, qe - qs, dtype=acc, device=q.device)
            out_i = torch.zeros(batch, qe - qs, d, dtype=acc, device=q.device)
            # Causal: keys at or beyond the tile's last query + 1 are masked for every row, so skip them.
            k_end = min(qe, n_k) if is_causal else n_k
            for ks in range(0, k_end, k_tile):
                ke = min(ks + k_tile, k_end)
                scores = q_i @ k[:, ks:ke].to(acc).transpose(-1, -2) * scale
                if is_causal and ke - 1 > qs:  # only tiles that cross the diagonal need the mask
                    scores = scores + causal_mask_bias(idx[qs:qe], idx[ks:ke], acc)
                new_max = torch.maximum(row_max, scores.amax(dim=-1))
                p = torch.exp(scores - new_max[..., None])
                rescale = torch.exp(row_max - new_max)  # exp(-inf) = 0 on the first tile
                row_sum = rescale * row_sum + p.sum(dim=-1)
                out_i = rescale[..., None] * out_i + p @ v[:, ks:ke].to(acc)
                row_max = new_max
            out[:, qs:qe] = (out_i / row_sum[..., None]).to(q.dtype)
            lse[:, qs:qe] = row_max + torch.log(row_sum)

        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = bool(is_causal)
        ctx.tiles = (q_tile, k_tile)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        q_tile, k_tile = ctx.tiles
        batch, n_q, d = q.shape
        n_k = k.shape[1]
        acc = _accumulator_dtype(q.dtype)
        scale = 1.0 / math.sqrt(d)
        idx = torch.arange(max(n_q, n_k), device=q.device)
        grad_out = grad_out.to(acc)
        delta = (grad_out * out.to(acc)).sum(dim=-1)  # D = rowsum(dO * O)
        grad_q = torch.zeros(batch, n_q, d, dtype=acc, device=q.device)
        grad_k = torch.zeros(batch, n_k, d, dtype=acc, device=q.device)
        grad_v = torch.zeros(batch, n_k, d, dtype=acc, device=q.device)

        # Key tiles outside, query tiles inside: dK_j and dV_j accumulate locally, as in the GPU kernel.
        for ks in range(0, n_k, k_tile):
            ke = min(ks + k_tile, n_k)
            k_j, v_j = k[:, ks:ke].to(acc), v[:, ks:ke].to(acc)
            # Causal: queries before ks see none of these keys; start at the tile holding query ks.
            q_start = (ks // q_tile) * q_tile if ctx.is_causal else 0
            for qs in range(q_start, n_q, q_tile):
                qe = min(qs + q_tile, n_q)
                q_i, do_i = q[:, qs:qe].to(acc), grad_out[:, qs:qe]
                scores = q_i @ k_j.transpose(-1, -2) * scale
                if ctx.is_causal and ke - 1 > qs:
                    scores = scores + causal_mask_bias(idx[qs:qe], idx[ks:ke], acc)
                p = torch.exp(scores - lse[:, qs:qe, None])
                grad_v[:, ks:ke] += p.transpose(-1, -2) @ do_i
                grad_p = do_i @ v_j.transpose(-1, -2)
                grad_s = p * (grad_p - delta[:, qs:qe, None]) * scale
                grad_q[:, qs:qe] += grad_s @ k_j
                grad_k[:, ks:ke] += grad_s.transpose(-1, -2) @ q_i
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None


def check_bhsd(q, k, v) -> None:
    """Refuse q, k, v that are not 4-D (batch, heads, seq, d) tensors, naming the first that is not."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape (batch, heads, seq, d); got {shape}")


def fold_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Reshape (batch, heads, seq, d) q, k, v to (batch * heads, seq, d), checking that they fit together."""
    check_bhsd(q, k, v)
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
        raise ValueError(f"batch and heads differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return tuple(t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))


def flash_attention_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """:class:`FlashAttentionPytorch` on (batch, heads, seq, d) tensors, as the attention registry
    (``lab.model.attention``) expects: heads are folded into the batch. Returns (batch, heads, n_queries, d)."""
    folded = fold_heads(q, k, v)
    b, h, n_q, d = q.shape
    return FlashAttentionPytorch.apply(*folded, causal).reshape(b, h, n_q, d)
