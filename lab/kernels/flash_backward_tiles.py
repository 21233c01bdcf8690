"""The two programs of the FlashAttention-2 backward (:mod:`lab.kernels.flash_triton_backward` launches them),
as Triton device functions: each one owns the rows it writes.

* :func:`dkdv_tile`: one key/value tile kept in registers, looping over query tiles (causal: from the tile
  holding query ``start_n`` on, since earlier queries never see these keys; only the first few query tiles,
  which cross the diagonal, are masked). Per tile pair it computes ``S``, ``dV += P^T dO``, ``dP = dO V^T``
  and ``dK += dS^T Q`` (transposed, so no ``P^T`` is formed);
* :func:`dq_tile`: one query tile kept in registers, looping over key tiles up to the diagonal (an unmasked
  part, then the masked diagonal tiles, as in the forward), recomputing ``S`` and ``dP`` for ``dQ += dS K``.

Both recompute ``P = exp2(S * log2(e) / sqrt(d) - L * log2(e))`` from the saved logsumexp ``L`` and load
``D = rowsum(dO * O)`` (the preprocess kernel's). With ``BLOCK_D1 > 0`` the head dimension is two column
chunks (``flash_config.head_chunks``): both chunks' products sum into ``S`` and ``dP``, and dK, dV, dQ keep
one accumulator per chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lab.kernels.flash_launch import LOG2E, MASK_VALUE, load_tile, store_tile

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _dkdv_inner(dk, dv, dk1, dv1, k, v, k1, v1, Q, DO, q_off, do_off, l_base, delta_base, stride_qs, stride_dos,
                lo, hi, offs_n, n_q, qk_scale,
                BLOCK_M1: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi); transposed so no P^T is formed.
    ``dk1, dv1, k1, v1``: the second column chunk (``BLOCK_D1 > 0``; otherwise unused placeholders)."""
    offs_m0 = tl.arange(0, BLOCK_M1)
    for start_m in range(lo, hi, BLOCK_M1):
        rows = start_m + offs_m0
        inside = rows < n_q
        q = load_tile(Q, q_off, start_m, n_q, stride_qs, BLOCK_M1, BLOCK_D, HEAD_DIM, True)
        do = load_tile(DO, do_off, start_m, n_q, stride_dos, BLOCK_M1, BLOCK_D, HEAD_DIM, True)
        if BLOCK_D1 > 0:
            q1 = load_tile(Q, q_off, start_m, n_q, stride_qs, BLOCK_M1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
            do1 = load_tile(DO, do_off, start_m, n_q, stride_dos, BLOCK_M1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        # Rows past n_q are zeros (masked loads), so their dO, dS and their share of dV, dK are 0 already.
        lse2 = tl.load(l_base + rows, mask=inside, other=0.0) * _LOG2E
        delta = tl.load(delta_base + rows, mask=inside, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (keys, queries)
        if BLOCK_D1 > 0:
            s_t = tl.dot(k1, tl.trans(q1), s_t, input_precision=PRECISION)
        # P^T = exp2(s * log2(e) / sqrt(d) - L * log2(e)): one fused multiply-add per score
        if MASKED:  # causal tiles on the diagonal
            s_t = s_t * qk_scale + tl.where(rows[None, :] >= offs_n[:, None], 0.0, MASK_VALUE)
            p_t = tl.math.exp2(s_t - lse2[None, :])
        else:
            p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if BLOCK_D1 > 0:
            dv1 = tl.dot(p_t.to(do1.dtype), do1, dv1, input_precision=PRECISION)
            dp_t = tl.dot(v1, tl.trans(do1), dp_t, input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
        if BLOCK_D1 > 0:
            dk1 = tl.dot(ds_t.to(q1.dtype), q1, dk1, input_precision=PRECISION)
    return dk, dv, dk1, dv1


@triton.jit
def dkdv_tile(K, V, DK, DV, Q, DO, L, Delta, k_off, v_off, dk_off, dv_off, q_off, do_off, zh,
              stride_ks, stride_vs, stride_qs, stride_dos, stride_dks, stride_dvs, start_n, n_q, n_k, qk_scale,
              sm_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr):
    """dK and dV of keys ``[start_n, start_n + BLOCK_N1)`` of one head, stored into DK and DV (dK scaled by
    ``sm_scale``)."""
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    k = load_tile(K, k_off, start_n, n_k, stride_ks, BLOCK_N1, BLOCK_D, HEAD_DIM, True)
    v = load_tile(V, v_off, start_n, n_k, stride_vs, BLOCK_N1, BLOCK_D, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    if BLOCK_D1 > 0:
        k1 = load_tile(K, k_off, start_n, n_k, stride_ks, BLOCK_N1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        v1 = load_tile(V, v_off, start_n, n_k, stride_vs, BLOCK_N1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        dk1 = tl.zeros([BLOCK_N1, BLOCK_D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N1, BLOCK_D1], dtype=tl.float32)
    else:  # placeholders the loops never touch
        k1, v1, dk1, dv1 = k, v, dk, dv
    l_base = L + zh.to(tl.int64) * n_q
    delta_base = Delta + zh.to(tl.int64) * n_q
    if IS_CAUSAL:
        # Queries < start_n see none of these keys. Query tiles starting at or after the tile's last key
        # see all of them; the ones in between cross the diagonal and are masked.
        lo = (start_n // BLOCK_M1) * BLOCK_M1
        full_lo = ((start_n + BLOCK_N1 - 1 + BLOCK_M1 - 1) // BLOCK_M1) * BLOCK_M1
        dk, dv, dk1, dv1 = _dkdv_inner(dk, dv, dk1, dv1, k, v, k1, v1, Q, DO, q_off, do_off, l_base, delta_base,
                                       stride_qs, stride_dos, lo, tl.minimum(full_lo, n_q), offs_n, n_q, qk_scale,
                                       BLOCK_M1, BLOCK_D, BLOCK_D1, HEAD_DIM, True, PRECISION)
    else:
        full_lo = 0
    dk, dv, dk1, dv1 = _dkdv_inner(dk, dv, dk1, dv1, k, v, k1, v1, Q, DO, q_off, do_off, l_base, delta_base,
                                   stride_qs, stride_dos, full_lo, n_q, offs_n, n_q, qk_scale,
                                   BLOCK_M1, BLOCK_D, BLOCK_D1, HEAD_DIM, False, PRECISION)
    store_tile(DK, dk_off, start_n, n_k, stride_dks, dk * sm_scale, BLOCK_N1, BLOCK_D, HEAD_DIM)
    store_tile(DV, dv_off, start_n, n_k, stride_dvs, dv, BLOCK_N1, BLOCK_D, HEAD_DIM)
    if BLOCK_D1 > 0:
        store_tile(DK, dk_off, start_n, n_k, stride_dks, dk1 * sm_scale, BLOCK_N1, BLOCK_D1, HEAD_DIM, BLOCK_D)
        store_tile(DV, dv_off, start_n, n_k, stride_dvs, dv1, BLOCK_N1, BLOCK_D1, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, K, V, k_off, v_off, stride_ks, stride_vs, lo, hi, rows, n_k,
              qk_scale, BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr,
              HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi). ``dq1, q1, do1``: the second column chunk
    (``BLOCK_D1 > 0``; otherwise unused placeholders)."""
    offs_n0 = tl.arange(0, BLOCK_N2)
    for start_n in range(lo, hi, BLOCK_N2):
        k = load_tile(K, k_off, start_n, n_k, stride_ks, BLOCK_N2, BLOCK_D, HEAD_DIM, MASKED)
        v = load_tile(V, v_off, start_n, n_k, stride_vs, BLOCK_N2, BLOCK_D, HEAD_DIM, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if BLOCK_D1 > 0:
            k1 = load_tile(K, k_off, start_n, n_k, stride_ks, BLOCK_N2, BLOCK_D1, HEAD_DIM, MASKED, BLOCK_D)
            v1 = load_tile(V, v_off, start_n, n_k, stride_vs, BLOCK_N2, BLOCK_D1, HEAD_DIM, MASKED, BLOCK_D)
            s = tl.dot(q1, tl.trans(k1), s, input_precision=PRECISION)
        if MASKED:
            cols = start_n + offs_n0
            keep = cols[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            s = s * qk_scale + tl.where(keep, 0.0, MASK_VALUE)
            p = tl.math.exp2(s - lse2[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if BLOCK_D1 > 0:
            dp = tl.dot(do1, tl.trans(v1), dp, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        if BLOCK_D1 > 0:
            dq1 = tl.dot(ds.to(k1.dtype), k1, dq1, input_precision=PRECISION)
    return dq, dq1


@triton.jit
def dq_tile(Q, DO, L, Delta, DQ, K, V, q_off, do_off, dq_off, k_off, v_off, zh,
            stride_qs, stride_dos, stride_dqs, stride_ks, stride_vs, start_m, n_q, n_k, qk_scale, sm_scale,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
            PRECISION: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    """dQ of queries ``[start_m, start_m + BLOCK_M2)`` of one head, scaled by ``sm_scale`` and stored into DQ."""
    rows = start_m + tl.arange(0, BLOCK_M2)
    inside = rows < n_q
    q = load_tile(Q, q_off, start_m, n_q, stride_qs, BLOCK_M2, BLOCK_D, HEAD_DIM, True)
    do = load_tile(DO, do_off, start_m, n_q, stride_dos, BLOCK_M2, BLOCK_D, HEAD_DIM, True)
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    if BLOCK_D1 > 0:
        q1 = load_tile(Q, q_off, start_m, n_q, stride_qs, BLOCK_M2, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        do1 = load_tile(DO, do_off, start_m, n_q, stride_dos, BLOCK_M2, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        dq1 = tl.zeros([BLOCK_M2, BLOCK_D1], dtype=tl.float32)
    else:  # placeholders the loop never touches
        q1, do1, dq1 = q, do, dq
    lse2 = tl.load(L + zh.to(tl.int64) * n_q + rows, mask=inside, other=0.0) * _LOG2E  # rows past n_q: never stored
    delta = tl.load(Delta + zh.to(tl.int64) * n_q + rows, mask=inside, other=0.0)
    whole_tiles_end = (n_k // BLOCK_N2) * BLOCK_N2
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N2) * BLOCK_N2, whole_tiles_end)
        end = tl.minimum(start_m + BLOCK_M2, n_k)
    else:
        full_end = whole_tiles_end
        end = n_k
    dq, dq1 = _dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, K, V, k_off, v_off, stride_ks, stride_vs,
                        0, full_end, rows, n_k, qk_scale, BLOCK_N2, BLOCK_D, BLOCK_D1, HEAD_DIM, False, IS_CAUSAL,
                        PRECISION)
    dq, dq1 = _dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, K, V, k_off, v_off, stride_ks, stride_vs,
                        full_end, end, rows, n_k, qk_scale, BLOCK_N2, BLOCK_D, BLOCK_D1, HEAD_DIM, True, IS_CAUSAL,
                        PRECISION)
    store_tile(DQ, dq_off, start_m, n_q, stride_dqs, dq * sm_scale, BLOCK_M2, BLOCK_D, HEAD_DIM)
    if BLOCK_D1 > 0:
        store_tile(DQ, dq_off, start_m, n_q, stride_dqs, dq1 * sm_scale, BLOCK_M2, BLOCK_D1, HEAD_DIM, BLOCK_D)
