"""FlashAttention-2 forward in Triton: the kernel and its host function :func:`flash_forward`.

One program computes one query tile of one (batch, head): it keeps the tile of Q, an fp32 output
accumulator and the running row maximum and row sum of an online softmax, and streams the key/value tiles
of that head through them, so the ``n_queries x n_keys`` scores never exist in memory.

* Softmax in base 2: ``log2(e) / sqrt(d)`` is folded into one scale, so a score costs one fused
  multiply-add and one ``exp2`` instruction.
* Causal (top-left: query ``i`` sees keys ``j <= i``): key tiles entirely in the future are never visited,
  and the loop is split so that only the tiles crossing the diagonal, or the ragged last tile, pay for the
  mask (``-1e6`` added to masked scores).
* Any head dimension that is a multiple of 8 up to 256: tiles are ``BLOCK_D`` (a power of two) wide and the
  loads/stores mask columns ``HEAD_DIM..BLOCK_D`` (see ``flash_launch.load_tile``); nothing is copied. With
  ``BLOCK_D1 > 0`` the head dimension is two column chunks, ``[0, BLOCK_D)`` and ``[BLOCK_D, BLOCK_D +
  BLOCK_D1)`` (``flash_config.head_chunks``): ``S = Q0 K0^T + Q1 K1^T`` (the second product accumulates into
  the first) and the output has one accumulator per chunk, so at d = 80 the products run 64 + 16 columns
  wide instead of 128.
* Grid (query tiles, heads, batch); within a head the heaviest causal query tiles start first so the long
  rows do not start last, and heads run one after the other so the programs running together share one
  head's K/V in L2 (interleaving heads measured slower).
* (batch, seq, d) and (batch, heads, seq, d) inputs with any batch/head/sequence strides.

Saved for the backward: the output and the natural-log logsumexp ``L`` of every query row (fp32).

Tried and removed: issuing the next key tile's scores before this tile's softmax, so that a matrix product
could run under the exponentials (FlashAttention-3's overlap within one warp group). Triton's compiled code
waits for that product before the softmax all the same (:func:`lab.bench.flash_variants.product_wait_table`),
and the second score tile costs registers and shared memory: on the shapes measured it never beat the fastest
tiles without it (``results/flash_overlap_sweep``). The overlap needs control of when a product is waited for,
which ``tl.dot`` does not give. K/V tiles loaded through TMA descriptors and Triton's warp specialization of
the key loop were timed as sweep variants and never chosen by the tile tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.flash_config import (
    DEFAULT_CONFIG,
    INTERPRET,
    FlashConfig,
    autotunes,
    check_triton_inputs,
    dot_precision,
    forward_tiles,
    head_chunks,
    interpreter_needs_fp32,
    tune_batch,
)
from lab.kernels.flash_launch import (
    MASK_VALUE,
    TUNED_CONFIGS,
    as_bhsd,
    base2_scale,
    launch,
    load_tile,
    remember_tuning,
    store_tile,
    unit_last_stride,
)
from lab.kernels.triton_env import empty_in_layout

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_inner(acc, acc1, row_sum, row_max, q, q1, K, V, k_off, v_off, stride_ks, stride_vs, lo, hi,
               offs_m, n_k, qk_scale,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Stream key tiles [lo, hi) through the online softmax. MASKED tiles cross the diagonal or the end.
    ``q1``/``acc1``: the second column chunk (``BLOCK_D1 > 0``; otherwise unused placeholders)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = load_tile(K, k_off, start_n, n_k, stride_ks, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if BLOCK_D1 > 0:
            k1 = load_tile(K, k_off, start_n, n_k, stride_ks, BLOCK_N, BLOCK_D1, HEAD_DIM, MASKED,
                           BLOCK_D)
            s = tl.dot(q1, tl.trans(k1), s, input_precision=PRECISION)
        # Base-2 exponent s * log2(e) / sqrt(d) - max: one fused multiply-add per score.
        if MASKED:
            cols = start_n + offs_n
            keep = cols[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = s * qk_scale + tl.where(keep, 0.0, MASK_VALUE)
            new_max = tl.maximum(row_max, tl.max(s, 1))
            p = tl.math.exp2(s - new_max[:, None])
        else:
            new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)  # 0 on the first tile, where row_max = -inf
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None]
        v = load_tile(V, v_off, start_n, n_k, stride_vs, BLOCK_N, BLOCK_D, HEAD_DIM, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        if BLOCK_D1 > 0:
            acc1 = acc1 * rescale[:, None]
            v1 = load_tile(V, v_off, start_n, n_k, stride_vs, BLOCK_N, BLOCK_D1, HEAD_DIM, MASKED,
                           BLOCK_D)
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1, input_precision=PRECISION)
        row_max = new_max
    return acc, acc1, row_sum, row_max


@triton.jit(do_not_specialize=["tune_batch"])
def _flash_fwd_kernel(Q, K, V, O, L,
                      stride_qz, stride_qh, stride_qs, stride_kz, stride_kh, stride_ks,
                      stride_vz, stride_vh, stride_vs, stride_oz, stride_oh, stride_os,
                      n_q, n_k, qk_scale, tune_batch,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Grid (query tiles, heads, batch). ``tune_batch`` is unused: it only keys the autotuner."""
    # Inductor passes a Python float as fp64 (when it launches this kernel itself, FlashConfig.compile_inline):
    # in fp64 the scale would turn the whole softmax into fp64, which tl.dot's fp32 accumulator refuses.
    qk_scale = tl.cast(qk_scale, tl.float32)
    # Programs start in x-fastest order: within a head the heaviest causal query tile (the last) starts first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    z = tl.program_id(2)
    zh = z * tl.num_programs(1) + h
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_off = z.to(tl.int64) * stride_qz + h.to(tl.int64) * stride_qh
    k_off = z.to(tl.int64) * stride_kz + h.to(tl.int64) * stride_kh
    v_off = z.to(tl.int64) * stride_vz + h.to(tl.int64) * stride_vh
    q = load_tile(Q, q_off, start_m, n_q, stride_qs, BLOCK_M, BLOCK_D, HEAD_DIM, True)

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCK_D1 > 0:
        q1 = load_tile(Q, q_off, start_m, n_q, stride_qs, BLOCK_M, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        acc1 = tl.zeros([BLOCK_M, BLOCK_D1], dtype=tl.float32)
    else:  # placeholders the inner loop never touches
        q1 = q
        acc1 = acc

    # Key tiles [0, full_end) need no mask at all; [full_end, end) cross the diagonal or the end of K.
    whole_tiles_end = (n_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        # keys < full_end are <= start_m, the smallest query of the tile; keys >= start_m + BLOCK_M are
        # in the future of every query in the tile and are skipped.
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, whole_tiles_end)
        end = tl.minimum(start_m + BLOCK_M, n_k)
    else:
        full_end = whole_tiles_end
        end = n_k
    acc, acc1, row_sum, row_max = _fwd_inner(acc, acc1, row_sum, row_max, q, q1, K, V, k_off, v_off, stride_ks,
                                             stride_vs, 0, full_end, offs_m, n_k, qk_scale,
                                             BLOCK_N, BLOCK_D, BLOCK_D1, HEAD_DIM, False, IS_CAUSAL, PRECISION)
    acc, acc1, row_sum, row_max = _fwd_inner(acc, acc1, row_sum, row_max, q, q1, K, V, k_off, v_off, stride_ks,
                                             stride_vs, full_end, end, offs_m, n_k, qk_scale,
                                             BLOCK_N, BLOCK_D, BLOCK_D1, HEAD_DIM, True, IS_CAUSAL, PRECISION)

    o_off = z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh
    store_tile(O, o_off, start_m, n_q, stride_os, acc / row_sum[:, None], BLOCK_M, BLOCK_D, HEAD_DIM)
    if BLOCK_D1 > 0:
        store_tile(O, o_off, start_m, n_q, stride_os, acc1 / row_sum[:, None], BLOCK_M, BLOCK_D1, HEAD_DIM, BLOCK_D)
    # natural-log logsumexp of the scaled scores: (max + log2(sum)) is in base 2
    tl.store(L + zh.to(tl.int64) * n_q + offs_m, (row_max + tl.math.log2(row_sum)) * _LN2, mask=offs_m < n_q)


#: The forward kernel itself, for tools that compile it without launching it (:mod:`lab.kernels.flash_sm90`).
FORWARD_KERNEL = _flash_fwd_kernel


def _fwd_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    shapes = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
        (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
        (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 8, 3),
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


_flash_fwd_tuned = triton.autotune(
    configs=_fwd_configs(),
    key=["n_q", "n_k", "tune_batch", "HEAD_DIM", "BLOCK_D1", "IS_CAUSAL", "PRECISION"],
)(_flash_fwd_kernel)


def forward_launch_args(q, k, v, out, lse, is_causal: bool, config: FlashConfig) -> tuple[tuple, dict]:
    """Positional arguments and constexpr keywords (all but the tiles) of the forward kernel on
    (batch, heads, seq, d) tensors."""
    d = q.shape[-1]
    bd, bd1 = head_chunks(d, q.dtype, "fwd", q.shape[2], k.shape[2], config)
    args = (q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            q.shape[2], k.shape[2], base2_scale(d), tune_batch(q.shape[0] * q.shape[1]))
    meta = {"HEAD_DIM": d, "BLOCK_D": bd, "BLOCK_D1": bd1, "IS_CAUSAL": bool(is_causal),
            "PRECISION": dot_precision(q.dtype, config.fp32_precision)}
    return args, meta


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  config: FlashConfig = DEFAULT_CONFIG, launcher=launch) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Triton forward on (batch, seq, d) or (batch, heads, seq, d) tensors. Returns (output in q's
    dtype, shape and memory layout (:func:`empty_in_layout`); logsumexp fp32 of shape q.shape[:-1],
    contiguous). ``launcher`` launches the kernel (``flash_launch.launch``, or ``inline_launch`` when
    traced for Inductor; the autotuner always launches itself)."""
    check_triton_inputs(q, k, v)
    if interpreter_needs_fp32(q.dtype):
        out, lse = flash_forward(q.float(), k.float(), v.float(), is_causal, config, launcher)
        return out.to(q.dtype), lse
    out = empty_in_layout(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    q4, k4, v4, out4 = (as_bhsd(unit_last_stride(t)) for t in (q, k, v, out))
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    autotune = autotunes(config, q.dtype, n_q, n_k, config.fwd_tiles)
    if autotune:
        key = ("fwd", n_q, n_k, tune_batch(batch * heads), d, head_chunks(d, q.dtype, "fwd", n_q, n_k, config),
               bool(is_causal), q.dtype)
        tiles = TUNED_CONFIGS.get(key)
        if tiles is None:
            args, meta = forward_launch_args(q4, k4, v4, out4, lse, is_causal, config)
            _flash_fwd_tuned[lambda m: (triton.cdiv(n_q, m["BLOCK_M"]), heads, batch)](*args, **meta)
            remember_tuning(key, _flash_fwd_tuned)
            return out, lse
    else:
        tiles = forward_tiles(batch * heads, n_q, n_k, d, q.dtype, q.device, config, bool(is_causal))
    args, meta = forward_launch_args(q4, k4, v4, out4, lse, is_causal, config)
    launcher(_flash_fwd_kernel, (triton.cdiv(n_q, tiles["BLOCK_M"]), heads, batch), args, {**meta, **tiles},
             fast=config.fast_launch)
    return out, lse
