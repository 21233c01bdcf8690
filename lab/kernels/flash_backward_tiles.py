"""The two programs of the FlashAttention-2 backward (:mod:`lab.kernels.flash_triton_backward` launches them),
as Triton device functions: each one owns the rows it writes.

* :func:`dkdv_tile`: one key/value tile kept in registers, looping over query tiles (causal: from the tile
  holding query ``start_n`` on, since earlier queries never see these keys; only the first few query tiles,
  which cross the diagonal, are masked). Per tile pair it computes ``S``, ``dV += P^T dO``, ``dP = dO V^T``
  and ``dK += dS^T Q`` (transposed, so no ``P^T`` is formed), and with ``ATOMIC_DQ`` also adds ``dS K`` into
  an fp32 dQ buffer (with ``ORDERED_DQ`` in descending key-tile order: the same sums on every run);
* :func:`dq_tile`: one query tile kept in registers, looping over key tiles up to the diagonal (an unmasked
  part, then the masked diagonal tiles, as in the forward), recomputing ``S`` and ``dP`` for ``dQ += dS K``.

Both recompute ``P = exp2(S * log2(e) / sqrt(d) - L * log2(e))`` from the saved logsumexp ``L`` and use
``D = rowsum(dO * O)`` (loaded, or with ``DELTA_FROM_O`` computed from O and dO). With ``BLOCK_D1 > 0`` the
head dimension is two column chunks (``flash_config.head_chunks``): both chunks' products sum into ``S``
and ``dP``, and dK, dV, dQ keep one accumulator per chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lab.kernels.flash_launch import LOG2E, MASK_VALUE, load_tile, store_tile

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _add_dq_in_turn(DQ, dq_off, stride_dqs, rows, inside, dq, dq1, turn, key_tile, first,
                    BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Add one key tile's dQ share into the fp32 rows ``rows`` of DQ in descending key-tile order, so that every
    run sums in the same order (``backward_launch="ordered"``). The key tiles that see a query tile are
    ``0 .. first`` (causal: every key tile before one that sees it sees it too); ``turn`` counts those already
    added: key tile ``j`` waits until it reads ``first - j``, reads, adds and writes the rows (no other program
    holds them meanwhile), then hands the turn on, or, as key tile 0, the last, sets the counter back to 0 for
    the next launch (and the autotuner's next trial). Descending, because key tile ``j + 1`` (launched before
    ``j``) starts its causal loop at a later query tile: it reaches each query tile first, so in the steady
    state nobody waits (ascending, each key tile would wait for the one before it to reach its first query
    tile, a wavefront through the whole head)."""
    while tl.atomic_add(turn, 0, sem="acquire") != first - key_tile:
        pass
    cols = tl.arange(0, BLOCK_D)
    ptrs = DQ + dq_off + rows[:, None] * stride_dqs + cols[None, :]
    keep = inside[:, None] & (cols[None, :] < HEAD_DIM)
    # .cg: read from L2, where the previous key tile's program (another SM) wrote; this SM's L1 may be stale
    tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0, cache_modifier=".cg") + dq, mask=keep)
    if BLOCK_D1 > 0:
        cols1 = BLOCK_D + tl.arange(0, BLOCK_D1)
        ptrs1 = DQ + dq_off + rows[:, None] * stride_dqs + cols1[None, :]
        keep1 = inside[:, None] & (cols1[None, :] < HEAD_DIM)
        tl.store(ptrs1, tl.load(ptrs1, mask=keep1, other=0.0, cache_modifier=".cg") + dq1, mask=keep1)
    tl.debug_barrier()  # every thread's rows are written before the turn is handed on
    tl.atomic_xchg(turn, tl.where(key_tile == 0, 0, first - key_tile + 1), sem="release")


@triton.jit
def _dkdv_inner(dk, dv, dk1, dv1, k, v, k1, v1, q_src, do_src, O, DQ, q_off, do_off, o_off, dq_off, q_row0, l_base,
                delta_base, stride_qs, stride_dos, stride_os, stride_dqs, lo, hi, offs_n, n_q, qk_scale, zh,
                turns, key_tile, last_key_tile,
                BLOCK_M1: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASKED: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr,
                ORDERED_DQ: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N1: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi); transposed so no P^T is formed.
    ``dk1, dv1, k1, v1``: the second column chunk (``BLOCK_D1 > 0``; otherwise unused placeholders).
    ``ORDERED_DQ``: ``turns`` holds this head's counter per query tile (see :func:`_add_dq_in_turn`)."""
    offs_m0 = tl.arange(0, BLOCK_M1)
    cols = tl.arange(0, BLOCK_D)
    for start_m in range(lo, hi, BLOCK_M1):
        rows = start_m + offs_m0
        inside = rows < n_q
        q = load_tile(q_src, q_off, q_row0, start_m, n_q, stride_qs, BLOCK_M1, BLOCK_D, HEAD_DIM, True)
        do = load_tile(do_src, do_off, q_row0, start_m, n_q, stride_dos, BLOCK_M1, BLOCK_D, HEAD_DIM, True)
        if BLOCK_D1 > 0:
            q1 = load_tile(q_src, q_off, q_row0, start_m, n_q, stride_qs, BLOCK_M1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
            do1 = load_tile(do_src, do_off, q_row0, start_m, n_q, stride_dos, BLOCK_M1, BLOCK_D1, HEAD_DIM, True,
                            BLOCK_D)
        if isinstance(q_src, tl.tensor_descriptor):  # then dO is a descriptor too (backward_launch_args)
            # Rows past n_q hold the next head's Q and dO: an infinite logsumexp makes their P exactly 0.
            lse2 = tl.load(l_base + rows, mask=inside, other=float("inf")) * _LOG2E
        else:
            # Rows past n_q are zeros (masked loads), so their dO, dS and their share of dV, dK are 0 already.
            # (An infinite fill here costs ~40 registers a thread at d=64: ptxas, sm_90a.)
            lse2 = tl.load(l_base + rows, mask=inside, other=0.0) * _LOG2E
        if DELTA_FROM_O:
            o = load_tile(O, o_off, 0, start_m, n_q, stride_os, BLOCK_M1, BLOCK_D, HEAD_DIM, True)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
            if BLOCK_D1 > 0:
                o1 = load_tile(O, o_off, 0, start_m, n_q, stride_os, BLOCK_M1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
                delta += tl.sum(o1.to(tl.float32) * do1.to(tl.float32), axis=1)
        else:
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
        if ATOMIC_DQ:  # this key tile's share of dQ (unscaled; the host multiplies by 1/sqrt(d) once)
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=PRECISION)
            dq1 = dq  # the second column chunk's share (a placeholder without one)
            if BLOCK_D1 > 0:
                dq1 = tl.dot(tl.trans(ds_t.to(k1.dtype)), k1, input_precision=PRECISION)
        if ATOMIC_DQ and ORDERED_DQ:  # added after the higher key tiles' shares, in turn
            # causal: the last key tile this query tile sees, the first to add into it
            first = tl.minimum((start_m + BLOCK_M1 - 1) // BLOCK_N1, last_key_tile) if IS_CAUSAL else last_key_tile
            _add_dq_in_turn(DQ, dq_off, stride_dqs, rows, inside, dq, dq1, turns + start_m // BLOCK_M1, key_tile,
                            first, BLOCK_D, BLOCK_D1, HEAD_DIM)
        elif ATOMIC_DQ:
            if isinstance(DQ, tl.tensor_descriptor):
                # One bulk reduction by the copy engine (a (heads, n_q, d) descriptor: rows past n_q and
                # columns past d are clipped) instead of BLOCK_M1 x BLOCK_D single atomics from the threads.
                DQ.atomic_add([zh, start_m, 0], dq.reshape(1, BLOCK_M1, BLOCK_D))
            else:
                tl.atomic_add(DQ + dq_off + rows[:, None] * stride_dqs + cols[None, :], dq,
                              mask=inside[:, None] & (cols[None, :] < HEAD_DIM), sem="relaxed")
            if BLOCK_D1 > 0:  # DQ is a pointer here (atomic_target)
                cols1 = BLOCK_D + tl.arange(0, BLOCK_D1)
                tl.atomic_add(DQ + dq_off + rows[:, None] * stride_dqs + cols1[None, :], dq1,
                              mask=inside[:, None] & (cols1[None, :] < HEAD_DIM), sem="relaxed")
    return dk, dv, dk1, dv1


@triton.jit
def dkdv_tile(K, V, O, DQ, DK, DV, q_src, do_src, L, Delta, DQ_TURN, k_off, v_off, o_off, dq_off, dk_off, dv_off,
               q_off, do_off, zh, stride_ks, stride_vs, stride_qs, stride_dos, stride_os, stride_dqs, stride_dks,
               stride_dvs, start_n, n_q, n_k, qk_scale, sm_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
               PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, DELTA_FROM_O: tl.constexpr,
               BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, ORDERED_DQ: tl.constexpr = False):
    """dK and dV of keys ``[start_n, start_n + BLOCK_N1)`` of one head, stored into DK and DV (dK scaled by
    ``sm_scale``); with ``ATOMIC_DQ`` each query tile's dQ share is added into DQ (unscaled, fp32), with
    ``ORDERED_DQ`` in descending key-tile order, turn by turn through the int32 counters ``DQ_TURN`` (one per head and
    query tile of ``BLOCK_M1`` rows, 0 before the launch and after it)."""
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    k = load_tile(K, k_off, 0, start_n, n_k, stride_ks, BLOCK_N1, BLOCK_D, HEAD_DIM, True)
    v = load_tile(V, v_off, 0, start_n, n_k, stride_vs, BLOCK_N1, BLOCK_D, HEAD_DIM, True)
    dk = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, BLOCK_D], dtype=tl.float32)
    if BLOCK_D1 > 0:
        k1 = load_tile(K, k_off, 0, start_n, n_k, stride_ks, BLOCK_N1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        v1 = load_tile(V, v_off, 0, start_n, n_k, stride_vs, BLOCK_N1, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        dk1 = tl.zeros([BLOCK_N1, BLOCK_D1], dtype=tl.float32)
        dv1 = tl.zeros([BLOCK_N1, BLOCK_D1], dtype=tl.float32)
    else:  # placeholders the loops never touch
        k1, v1, dk1, dv1 = k, v, dk, dv
    l_base = L + zh.to(tl.int64) * n_q
    delta_base = Delta + zh.to(tl.int64) * n_q
    q_row0 = zh * n_q
    turns = DQ_TURN + zh.to(tl.int64) * tl.cdiv(n_q, BLOCK_M1)
    key_tile = start_n // BLOCK_N1
    last_key_tile = tl.cdiv(n_k, BLOCK_N1) - 1
    if IS_CAUSAL:
        # Queries < start_n see none of these keys. Query tiles starting at or after the tile's last key
        # see all of them; the ones in between cross the diagonal and are masked.
        lo = (start_n // BLOCK_M1) * BLOCK_M1
        full_lo = ((start_n + BLOCK_N1 - 1 + BLOCK_M1 - 1) // BLOCK_M1) * BLOCK_M1
        dk, dv, dk1, dv1 = _dkdv_inner(dk, dv, dk1, dv1, k, v, k1, v1, q_src, do_src, O, DQ, q_off, do_off, o_off,
                                       dq_off, q_row0, l_base, delta_base, stride_qs, stride_dos, stride_os,
                                       stride_dqs, lo, tl.minimum(full_lo, n_q), offs_n, n_q, qk_scale, zh,
                                       turns, key_tile, last_key_tile, BLOCK_M1, BLOCK_D, BLOCK_D1, HEAD_DIM, True,
                                       PRECISION, ATOMIC_DQ, DELTA_FROM_O, ORDERED_DQ, IS_CAUSAL, BLOCK_N1)
    else:
        full_lo = 0
    dk, dv, dk1, dv1 = _dkdv_inner(dk, dv, dk1, dv1, k, v, k1, v1, q_src, do_src, O, DQ, q_off, do_off, o_off, dq_off,
                                   q_row0, l_base, delta_base, stride_qs, stride_dos, stride_os, stride_dqs, full_lo,
                                   n_q, offs_n, n_q, qk_scale, zh, turns, key_tile, last_key_tile, BLOCK_M1, BLOCK_D,
                                   BLOCK_D1, HEAD_DIM, False, PRECISION, ATOMIC_DQ, DELTA_FROM_O, ORDERED_DQ,
                                   IS_CAUSAL, BLOCK_N1)
    store_tile(DK, dk_off, start_n, n_k, stride_dks, dk * sm_scale, BLOCK_N1, BLOCK_D, HEAD_DIM)
    store_tile(DV, dv_off, start_n, n_k, stride_dvs, dv, BLOCK_N1, BLOCK_D, HEAD_DIM)
    if BLOCK_D1 > 0:
        store_tile(DK, dk_off, start_n, n_k, stride_dks, dk1 * sm_scale, BLOCK_N1, BLOCK_D1, HEAD_DIM, BLOCK_D)
        store_tile(DV, dv_off, start_n, n_k, stride_dvs, dv1, BLOCK_N1, BLOCK_D1, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, k_src, v_src, k_off, v_off, k_row0, stride_ks, stride_vs, lo, hi,
              rows, n_k, qk_scale,
              BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi). ``dq1, q1, do1``: the second column chunk
    (``BLOCK_D1 > 0``; otherwise unused placeholders)."""
    offs_n0 = tl.arange(0, BLOCK_N2)
    for start_n in range(lo, hi, BLOCK_N2):
        k = load_tile(k_src, k_off, k_row0, start_n, n_k, stride_ks, BLOCK_N2, BLOCK_D, HEAD_DIM, MASKED)
        v = load_tile(v_src, v_off, k_row0, start_n, n_k, stride_vs, BLOCK_N2, BLOCK_D, HEAD_DIM, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if BLOCK_D1 > 0:
            k1 = load_tile(k_src, k_off, k_row0, start_n, n_k, stride_ks, BLOCK_N2, BLOCK_D1, HEAD_DIM, MASKED,
                           BLOCK_D)
            v1 = load_tile(v_src, v_off, k_row0, start_n, n_k, stride_vs, BLOCK_N2, BLOCK_D1, HEAD_DIM, MASKED,
                           BLOCK_D)
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
def dq_tile(Q, DO, O, L, Delta, DQ, k_src, v_src, q_off, do_off, o_off, dq_off, k_off, v_off, zh,
             stride_qs, stride_dos, stride_os, stride_dqs, stride_ks, stride_vs,
             start_m, n_q, n_k, qk_scale, sm_scale,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
             PRECISION: tl.constexpr, DELTA_FROM_O: tl.constexpr, STORE_DELTA: tl.constexpr,
             BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    """dQ of queries ``[start_m, start_m + BLOCK_M2)`` of one head, scaled by ``sm_scale`` and stored into DQ;
    with ``STORE_DELTA`` also the rows' ``D`` (computed from O and dO) into Delta."""
    rows = start_m + tl.arange(0, BLOCK_M2)
    inside = rows < n_q
    q = load_tile(Q, q_off, 0, start_m, n_q, stride_qs, BLOCK_M2, BLOCK_D, HEAD_DIM, True)
    do = load_tile(DO, do_off, 0, start_m, n_q, stride_dos, BLOCK_M2, BLOCK_D, HEAD_DIM, True)
    dq = tl.zeros([BLOCK_M2, BLOCK_D], dtype=tl.float32)
    if BLOCK_D1 > 0:
        q1 = load_tile(Q, q_off, 0, start_m, n_q, stride_qs, BLOCK_M2, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        do1 = load_tile(DO, do_off, 0, start_m, n_q, stride_dos, BLOCK_M2, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
        dq1 = tl.zeros([BLOCK_M2, BLOCK_D1], dtype=tl.float32)
    else:  # placeholders the loop never touches
        q1, do1, dq1 = q, do, dq
    lse2 = tl.load(L + zh.to(tl.int64) * n_q + rows, mask=inside, other=0.0) * _LOG2E  # rows past n_q: never stored
    if DELTA_FROM_O:
        o = load_tile(O, o_off, 0, start_m, n_q, stride_os, BLOCK_M2, BLOCK_D, HEAD_DIM, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        if BLOCK_D1 > 0:
            o1 = load_tile(O, o_off, 0, start_m, n_q, stride_os, BLOCK_M2, BLOCK_D1, HEAD_DIM, True, BLOCK_D)
            delta += tl.sum(o1.to(tl.float32) * do1.to(tl.float32), axis=1)
        if STORE_DELTA:  # for the dK/dV pass that runs after this one
            tl.store(Delta + zh.to(tl.int64) * n_q + rows, delta, mask=inside)
    else:
        delta = tl.load(Delta + zh.to(tl.int64) * n_q + rows, mask=inside, other=0.0)
    k_row0 = zh * n_k
    whole_tiles_end = (n_k // BLOCK_N2) * BLOCK_N2
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N2) * BLOCK_N2, whole_tiles_end)
        end = tl.minimum(start_m + BLOCK_M2, n_k)
    else:
        full_end = whole_tiles_end
        end = n_k
    dq, dq1 = _dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, k_src, v_src, k_off, v_off, k_row0, stride_ks, stride_vs,
                        0, full_end, rows, n_k, qk_scale, BLOCK_N2, BLOCK_D, BLOCK_D1, HEAD_DIM, False, IS_CAUSAL,
                        PRECISION)
    dq, dq1 = _dq_inner(dq, dq1, q, q1, do, do1, lse2, delta, k_src, v_src, k_off, v_off, k_row0, stride_ks, stride_vs,
                        full_end, end, rows, n_k, qk_scale, BLOCK_N2, BLOCK_D, BLOCK_D1, HEAD_DIM, True, IS_CAUSAL,
                        PRECISION)
    store_tile(DQ, dq_off, start_m, n_q, stride_dqs, dq * sm_scale, BLOCK_M2, BLOCK_D, HEAD_DIM)
    if BLOCK_D1 > 0:
        store_tile(DQ, dq_off, start_m, n_q, stride_dqs, dq1 * sm_scale, BLOCK_M2, BLOCK_D1, HEAD_DIM, BLOCK_D)
