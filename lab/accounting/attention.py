"""Closed forms of attention's costs: matmul FLOPs (causal attention counted pair by pair), the memory naive
attention keeps for backward (the ``batch x seq x seq`` probability matrix) term by term, what FlashAttention
saves instead, and the power-law fit of memory against length. The tests check them against what autograd
really saves (:func:`lab.measure.saved_tensors.saved_tensor_bytes`) and against PyTorch's FLOP counter.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
import torch

from lab.dtypes import DTYPES as ALL_DTYPES
from lab.dtypes import element_size

#: The attention benchmarks' dtypes: a subset of the one table, :data:`lab.dtypes.DTYPES`.
DTYPES = {name: ALL_DTYPES[name] for name in ("fp32", "bf16", "fp16")}
PASSES = ("fwd", "bwd", "e2e")


# ----------------------------------------------------------------------------------------------------------
# FLOPs


def attention_pairs(seq_q: int, seq_k: int | None = None, causal: bool = False) -> int:
    """Number of (query, key) pairs whose score is used: ``seq_q * seq_k``, or with the causal mask
    (top-left aligned, as every implementation of ``lab.model.attention``: query i sees keys 0..i) the
    lower triangle."""
    seq_k = seq_q if seq_k is None else seq_k
    if seq_q < 1 or seq_k < 1:
        raise ValueError(f"sequence lengths must be positive, got {seq_q} and {seq_k}")
    if not causal:
        return seq_q * seq_k
    # row i keeps min(seq_k, i + 1) keys
    return int(np.minimum(np.arange(1, seq_q + 1, dtype=np.int64), seq_k).sum())


def attention_flops(batch: int, seq: int, d: int, causal: bool = False, pass_: str = "fwd",
                    heads: int = 1, seq_k: int | None = None) -> float:
    """Matmul FLOPs of attention (multiply and add counted as 2), summed over ``batch * heads``.

    Forward: ``S = Q K^T`` and ``O = P V`` are 2 FLOPs per (pair, feature) each, so ``4 * pairs * d``.
    Backward: ``dV = P^T dO``, ``dP = dO V^T``, ``dS -> dQ = dS K`` and ``dK = dS^T Q`` are four more
    matmuls, plus the recomputation of ``S`` that FlashAttention-2 does: ``10 * pairs * d``, i.e. 2.5x the
    forward (the convention of the FlashAttention papers' benchmarks). End-to-end is their sum, 3.5x.
    Causal attention counts only the unmasked pairs, ``seq * (seq + 1) / 2``, not ``seq^2 / 2`` (the
    papers' rounding; the two differ by ``1/seq``). Softmax exponentials and masking are not counted.
    The same count is used for every implementation, so TFLOP/s compares speed, not work done: the naive
    version computes the masked half too and does not recompute, yet is credited with these FLOPs.
    """
    factor = {"fwd": 4.0, "bwd": 10.0, "e2e": 14.0}
    if pass_ not in factor:
        raise ValueError(f"pass_ must be one of {', '.join(factor)}, got {pass_!r}")
    if min(batch, heads, d) < 1:
        raise ValueError("batch, heads and d must be positive")
    return factor[pass_] * batch * heads * attention_pairs(seq, seq_k, causal) * d


# ----------------------------------------------------------------------------------------------------------
# Memory: closed forms and what autograd really saves


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype given as ``"fp32"``/``"bf16"``/``"fp16"`` or a ``torch.dtype``."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return element_size(dtype)


def naive_attention_memory(batch: int, seq: int, d: int, dtype: str | torch.dtype = "fp32",
                           causal: bool = False) -> pd.DataFrame:
    """Closed-form memory of :func:`lab.model.attention.naive_attention` with gradients, term by term, in bytes.

    Rows (``term``, ``formula``, ``bytes``, ``when``):

    * ``saved`` terms are what autograd keeps between forward and backward beyond the inputs: the softmax
      output ``P`` (saved once, used by both softmax's backward and ``P @ V``'s), and for causal attention
      the boolean mask (``seq^2`` bytes, not per batch element). ``Q K^T`` saves its inputs (views of q
      and k, no new memory) and the scalar scale saves nothing.
    * ``live`` terms are the other tensors allocated when backward starts: q, k, v, the upstream gradient
      dO and the output.
    * ``peak`` terms are transient: in the forward two score-sized tensors coexist at every step (``Q K^T``
      and its scaled copy, then the masked copy, then the scores and ``P``), with the causal ``mask`` and
      its negation beside them; in the backward ``P`` (retained), ``dP`` and ``dS`` (3 score-sized).
    """
    e = dtype_bytes(dtype)
    sq = batch * seq * seq * e
    sd = batch * seq * d * e
    mask = seq * seq if causal else 0
    rows = [
        ("probabilities P (saved)", "batch*seq^2*bytes", sq, "saved"),
        ("causal mask (saved)", "seq^2 * 1 byte", mask, "saved"),
        ("q, k, v", "3*batch*seq*d*bytes", 3 * sd, "live"),
        ("upstream gradient dO", "batch*seq*d*bytes", sd, "live"),
        ("output O", "batch*seq*d*bytes", sd, "live"),
        ("forward transient: scores beside P (+ the mask before ~)", "batch*seq^2*bytes (+ seq^2)",
         sq + mask, "peak_forward"),
        ("backward transient: dP and dS", "2*batch*seq^2*bytes", 2 * sq, "peak_backward"),
    ]
    return pd.DataFrame(rows, columns=["term", "formula", "bytes", "when"])


def naive_attention_totals(batch: int, seq: int, d: int, dtype: str | torch.dtype = "fp32",
                           causal: bool = False) -> dict[str, int]:
    """Sums of :func:`naive_attention_memory` in bytes: ``saved`` (kept for backward beyond the inputs),
    ``before_backward`` (everything allocated when backward starts: saved + live), ``peak`` (the larger
    of the forward and backward peaks, a lower bound on what the run needs)."""
    t = naive_attention_memory(batch, seq, d, dtype, causal).groupby("when")["bytes"].sum()
    saved, live = int(t.get("saved", 0)), int(t.get("live", 0))
    peak = saved + live + max(int(t.get("peak_forward", 0)), int(t.get("peak_backward", 0)))
    return {"saved": saved, "before_backward": saved + live, "peak": peak}


def flash_attention_saved_bytes(batch: int, seq: int, d: int, dtype: str | torch.dtype = "fp32",
                                heads: int = 1) -> int:
    """Bytes FlashAttention saves for backward: Q, K, V, O (``4 * batch*heads*seq*d`` elements) and the
    fp32 logsumexp L (``batch*heads*seq``): linear in ``seq``, where naive attention's P is quadratic."""
    bh = batch * heads
    return 4 * bh * seq * d * dtype_bytes(dtype) + bh * seq * 4


def fit_power_law(x: Iterable[float], y: Iterable[float]) -> tuple[float, float]:
    """Least-squares fit of ``y = c * x**p`` in log-log space; returns ``(p, c)``."""
    x, y = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    if keep.sum() < 2:
        raise ValueError("need at least two positive points to fit a power law")
    p, logc = np.polyfit(np.log(x[keep]), np.log(y[keep]), 1)
    return float(p), float(np.exp(logc))
