"""FlashAttention-2 backward in Triton: a dK/dV pass over key tiles and a dQ pass over query tiles.

Each program owns the rows it writes, so nothing needs atomics:

* a **dK/dV program** holds one key/value tile in registers and loops over query tiles (causal: from the
  tile holding query ``start_n`` on, since earlier queries never see these keys; only the first few query
  tiles, which cross the diagonal, are masked);
* a **dQ program** holds one query tile and loops over key tiles up to the diagonal (the same split into
  an unmasked part and masked diagonal tiles as the forward).

Both recompute ``P = exp2(S * log2(e) / sqrt(d) - L * log2(e))`` from the saved logsumexp ``L`` and use
``D = rowsum(dO * O)``, computed first by a small preprocess kernel.

``BACKWARD_LAUNCH`` chooses how the two passes are launched:

* ``"fused"``: one launch whose programs are dK/dV and dQ programs interleaved, heaviest causal tiles
  first. Two independent passes in one grid keep all SMs busy when one head of a long sequence gives
  fewer tiles than the GPU has SMs, and there is no tail between two kernels;
* ``"two_pass"``: the dK/dV kernel, then the dQ kernel (the textbook form). With many heads the GPU is
  full either way, and each kernel alone keeps fewer registers and a smaller L2 working set;
* ``"auto"`` (default): for autotuned (long) shapes, both are timed once after tuning and the faster is
  kept for that shape; short shapes use "fused".
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lab.kernels.flash_triton import (
    INTERPRET,
    MASK_VALUE,
    TUNED_CONFIGS,
    TUNING_TIMINGS,
    base2_scale,
    dot_precision,
    fills_gpu,
    interpreter_needs_fp32,
    long_sequence,
    remember_tuning,
    tune_batch,
    unit_last_stride,
    uses_autotune,
)
from lab.kernels.flash_triton import (
    launch as launch_kernel,
)

#: "auto" (default: whichever of the two below is faster for the shape, timed once when tuning), "fused"
#: (dK/dV and dQ programs in one launch) or "two_pass" (two launches). See the module docstring.
BACKWARD_LAUNCH = "auto"

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _bwd_preprocess_kernel(O, DO, Delta, stride_ob, stride_os, stride_dob, stride_dos, n_q,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * O) in fp32, shape (batch, n_queries)."""
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = rows < n_q
    o = tl.load(O + pid_b * stride_ob + rows[:, None] * stride_os + offs_d[None, :], mask=inside[:, None], other=0.0)
    do = tl.load(DO + pid_b * stride_dob + rows[:, None] * stride_dos + offs_d[None, :],
                 mask=inside[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + pid_b * n_q + rows, delta, mask=inside)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qs, stride_dos, lo, hi,
                offs_n, offs_d, n_q, qk_scale,
                BLOCK_M1: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi); transposed so no P^T is formed."""
    offs_m0 = tl.arange(0, BLOCK_M1)
    for start_m in range(lo, hi, BLOCK_M1):
        rows = start_m + offs_m0
        inside = rows < n_q
        # Rows past n_q load zeros (q, dO, L, D): their P is finite and their dS and dO are zero.
        q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :], mask=inside[:, None], other=0.0)
        do = tl.load(do_base + rows[:, None] * stride_dos + offs_d[None, :], mask=inside[:, None], other=0.0)
        lse2 = tl.load(l_base + rows, mask=inside, other=0.0) * _LOG2E
        delta = tl.load(delta_base + rows, mask=inside, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (keys, queries)
        # P^T = exp2(s * log2(e) / sqrt(d) - L * log2(e)): one fused multiply-add per score
        if MASKED:  # causal tiles on the diagonal
            s_t = s_t * qk_scale + tl.where(rows[None, :] >= offs_n[:, None], 0.0, MASK_VALUE)
            p_t = tl.math.exp2(s_t - lse2[None, :])
        else:
            p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_tile(Q, K, V, DO, L, Delta, DK, DV,
               stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
               stride_dkb, stride_dks, stride_dvb, stride_dvs,
               pid_b, start_n, n_q, n_k, qk_scale, sm_scale,
               HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = offs_n[:, None] < n_k
    k = tl.load(K + pid_b * stride_kb + offs_n[:, None] * stride_ks + offs_d[None, :], mask=inside, other=0.0)
    v = tl.load(V + pid_b * stride_vb + offs_n[:, None] * stride_vs + offs_d[None, :], mask=inside, other=0.0)
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    q_base = Q + pid_b * stride_qb
    do_base = DO + pid_b * stride_dob
    l_base = L + pid_b * n_q
    delta_base = Delta + pid_b * n_q
    if IS_CAUSAL:
        # Queries < start_n see none of these keys. Query tiles starting at or after the tile's last key
        # see all of them; the ones in between cross the diagonal and are masked.
        lo = (start_n // BLOCK_M1) * BLOCK_M1
        full_lo = ((start_n + BLOCK_N1 - 1 + BLOCK_M1 - 1) // BLOCK_M1) * BLOCK_M1
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qs, stride_dos,
                             lo, tl.minimum(full_lo, n_q), offs_n, offs_d, n_q, qk_scale,
                             BLOCK_M1, True, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qs, stride_dos,
                             full_lo, n_q, offs_n, offs_d, n_q, qk_scale, BLOCK_M1, False, PRECISION)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, delta_base, stride_qs, stride_dos,
                             0, n_q, offs_n, offs_d, n_q, qk_scale, BLOCK_M1, False, PRECISION)
    tl.store(DK + pid_b * stride_dkb + offs_n[:, None] * stride_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=inside)
    tl.store(DV + pid_b * stride_dvb + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=inside)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, lo, hi,
              rows, offs_d, n_k, qk_scale,
              BLOCK_N2: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N2)
    for start_n in range(lo, hi, BLOCK_N2):
        cols = start_n + offs_n0
        if MASKED:
            inside = cols[:, None] < n_k
            k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=inside, other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=inside, other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            keep = cols[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            s = s * qk_scale + tl.where(keep, 0.0, MASK_VALUE)
            p = tl.math.exp2(s - lse2[:, None])
        else:
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_tile(Q, K, V, DO, L, Delta, DQ,
             stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
             stride_dqb, stride_dqs,
             pid_b, start_m, n_q, n_k, qk_scale, sm_scale,
             HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    rows = start_m + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = rows < n_q
    q = tl.load(Q + pid_b * stride_qb + rows[:, None] * stride_qs + offs_d[None, :], mask=inside[:, None], other=0.0)
    do = tl.load(DO + pid_b * stride_dob + rows[:, None] * stride_dos + offs_d[None, :],
                 mask=inside[:, None], other=0.0)
    lse2 = tl.load(L + pid_b * n_q + rows, mask=inside, other=0.0) * _LOG2E
    delta = tl.load(Delta + pid_b * n_q + rows, mask=inside, other=0.0)
    dq = tl.zeros([BLOCK_M2, HEAD_DIM], dtype=tl.float32)
    k_base = K + pid_b * stride_kb
    v_base = V + pid_b * stride_vb
    whole_tiles_end = (n_k // BLOCK_N2) * BLOCK_N2
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N2) * BLOCK_N2, whole_tiles_end)
        end = tl.minimum(start_m + BLOCK_M2, n_k)
    else:
        full_end = whole_tiles_end
        end = n_k
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, 0, full_end,
                   rows, offs_d, n_k, qk_scale, BLOCK_N2, False, IS_CAUSAL, PRECISION)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, full_end, end,
                   rows, offs_d, n_k, qk_scale, BLOCK_N2, True, IS_CAUSAL, PRECISION)
    tl.store(DQ + pid_b * stride_dqb + rows[:, None] * stride_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=inside[:, None])


@triton.jit(do_not_specialize=["tune_batch"])
def _flash_bwd_kernel(Q, K, V, DO, L, Delta, DQ, DK, DV,
                      stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                      stride_dqb, stride_dqs, stride_dkb, stride_dks, stride_dvb, stride_dvs,
                      n_q, n_k, qk_scale, sm_scale, tune_batch,
                      HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                      PASS: tl.constexpr,
                      BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr,
                      BLOCK_N2: tl.constexpr):
    """PASS 1: dK/dV programs only; PASS 2: dQ programs only; PASS 0: both, interleaved in one grid.
    Grid (programs, batch); ``tune_batch`` only keys the autotuner."""
    # Programs start in x-fastest order (slots ordered heaviest first below); batch entries one after the
    # other, so that the programs running together share one head's Q, K, V, dO in L2.
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    n_kv_tiles = tl.cdiv(n_k, BLOCK_N1)
    n_q_tiles = tl.cdiv(n_q, BLOCK_M2)
    if PASS == 1:
        _dkdv_program(Q, K, V, DO, L, Delta, DK, DV,
                      stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                      stride_dkb, stride_dks, stride_dvb, stride_dvs, pid_b, pid, n_q, n_k, qk_scale, sm_scale,
                      HEAD_DIM, IS_CAUSAL, PRECISION, BLOCK_M1, BLOCK_N1)
    elif PASS == 2:
        _dq_program(Q, K, V, DO, L, Delta, DQ,
                    stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                    stride_dqb, stride_dqs, pid_b, pid, n_q_tiles, n_q, n_k, qk_scale, sm_scale,
                    HEAD_DIM, IS_CAUSAL, PRECISION, BLOCK_M2, BLOCK_N2)
    else:
        # Alternate dK/dV and dQ programs while both have tiles left, then the rest of the longer pass.
        n_pairs = tl.minimum(n_kv_tiles, n_q_tiles)
        paired = pid < 2 * n_pairs
        tile = tl.where(paired, pid // 2, pid - n_pairs)
        is_kv = tl.where(paired, pid % 2 == 0, n_kv_tiles > n_q_tiles)
        if is_kv:
            _dkdv_program(Q, K, V, DO, L, Delta, DK, DV,
                          stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                          stride_dkb, stride_dks, stride_dvb, stride_dvs, pid_b, tile, n_q, n_k, qk_scale, sm_scale,
                          HEAD_DIM, IS_CAUSAL, PRECISION, BLOCK_M1, BLOCK_N1)
        else:
            _dq_program(Q, K, V, DO, L, Delta, DQ,
                        stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                        stride_dqb, stride_dqs, pid_b, tile, n_q_tiles, n_q, n_k, qk_scale, sm_scale,
                        HEAD_DIM, IS_CAUSAL, PRECISION, BLOCK_M2, BLOCK_N2)


@triton.jit
def _dkdv_program(Q, K, V, DO, L, Delta, DK, DV,
                  stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                  stride_dkb, stride_dks, stride_dvb, stride_dvs, pid_b, tile, n_q, n_k, qk_scale, sm_scale,
                  HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr):
    # key tile 0 has the most causal work (every query sees it): it goes first
    _dkdv_tile(Q, K, V, DO, L, Delta, DK, DV,
               stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
               stride_dkb, stride_dks, stride_dvb, stride_dvs,
               pid_b, tile * BLOCK_N1, n_q, n_k, qk_scale, sm_scale,
               HEAD_DIM, IS_CAUSAL, PRECISION, BLOCK_M1, BLOCK_N1)


@triton.jit
def _dq_program(Q, K, V, DO, L, Delta, DQ,
                stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
                stride_dqb, stride_dqs, pid_b, tile, n_q_tiles, n_q, n_k, qk_scale, sm_scale,
                HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    # the last query tile has the most causal work (it sees every key): it goes first
    _dq_tile(Q, K, V, DO, L, Delta, DQ,
             stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_dob, stride_dos,
             stride_dqb, stride_dqs,
             pid_b, (n_q_tiles - 1 - tile) * BLOCK_M2, n_q, n_k, qk_scale, sm_scale,
             HEAD_DIM, IS_CAUSAL, PRECISION, BLOCK_M2, BLOCK_N2)


def _bwd_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16},
                              num_warps=4, num_stages=1)]
    shapes = [  # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)
        (64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 3),
        (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3),
        (32, 128, 128, 32, 8, 3),
    ]
    return [triton.Config({"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2}, num_warps=w, num_stages=s)
            for m1, n1, m2, n2, w, s in shapes]


def _prune_bwd_configs(configs, named_args, **kwargs):
    """Drop configs whose fp32 dK+dV accumulators would need > 192 registers a thread (they spill)."""
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    if d is None:
        return configs
    kept = [c for c in configs if 2 * c.kwargs["BLOCK_N1"] * d / (32 * c.num_warps) <= 192]
    return kept or configs


_flash_bwd_tuned = triton.autotune(
    configs=_bwd_configs(), key=["n_q", "n_k", "tune_batch", "HEAD_DIM", "IS_CAUSAL", "PRECISION", "PASS"],
    prune_configs_by={"early_config_prune": _prune_bwd_configs})(_flash_bwd_kernel)


def _bwd_fixed_config(d: int) -> dict:
    if INTERPRET:
        return {"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4 if d <= 64 else 8,
            "num_stages": 2}


def _bwd_untuned_plan(batch, n_q, n_k, d, device, dtype) -> tuple[str, dict]:
    """Launch mode and per-pass configs without autotuning: what tuning chose on an H200
    (notes/flash_tuning.md, run 3) for long sequences, the small fixed config otherwise."""
    if not long_sequence(n_q, n_k, dtype):
        return "fused", dict.fromkeys((0, 1, 2), _bwd_fixed_config(d))
    small = {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 3}
    if not fills_gpu(batch * triton.cdiv(n_k, 64), device):  # thin grid (one head): one fused launch
        return "fused", dict.fromkeys((0, 1, 2), small)
    dq = small if d <= 64 else {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                                "num_warps": 8, "num_stages": 3}
    return "two_pass", {0: small, 1: small, 2: dq}


def _grid(pass_, n_q, n_k, batch):
    def grid(meta):
        kv = triton.cdiv(n_k, meta["BLOCK_N1"])
        qt = triton.cdiv(n_q, meta["BLOCK_M2"])
        return ({0: kv + qt, 1: kv, 2: qt}[pass_], batch)
    return grid


def flash_backward(q, k, v, out, lse, grad_out, is_causal: bool, launch: str | None = None):
    """Gradients (dQ, dK, dV) of FlashAttention-2 with Triton kernels, in the dtype of q, k, v.

    ``lse`` is the fp32 logsumexp (batch, n_queries) saved by the forward. ``launch`` overrides
    :data:`BACKWARD_LAUNCH` ("auto", "fused" or "two_pass").
    """
    mode = launch or BACKWARD_LAUNCH
    if mode not in ("auto", "fused", "two_pass"):
        raise ValueError(f"launch must be 'auto', 'fused' or 'two_pass', got {mode!r}")
    if interpreter_needs_fp32(q.dtype):
        grads = flash_backward(q.float(), k.float(), v.float(), out.float(), lse, grad_out.float(), is_causal,
                               launch)
        return tuple(g.to(q.dtype) for g in grads)
    q, k, v, out, grad_out = (unit_last_stride(t) for t in (q, k, v, out, grad_out))
    batch, n_q, d = q.shape
    n_k = k.shape[1]
    delta = torch.empty(batch, n_q, dtype=torch.float32, device=q.device)
    pre_block = 16 if INTERPRET else 64
    launch_kernel(_bwd_preprocess_kernel, (triton.cdiv(n_q, pre_block), batch),
                  (out, grad_out, delta, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), n_q),
                  {"HEAD_DIM": d, "BLOCK_M": pre_block})

    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    grad_k = torch.empty_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v, memory_format=torch.contiguous_format)
    args, meta = backward_launch_args(q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v, is_causal)
    tuned = uses_autotune(n_q, n_k, q.dtype)
    key = (n_q, n_k, tune_batch(batch), d, bool(is_causal), meta["PRECISION"], q.dtype)
    untuned_mode, untuned_configs = _bwd_untuned_plan(batch, n_q, n_k, d, q.device, q.dtype)

    def run(mode_):
        for pass_ in (0,) if mode_ == "fused" else (1, 2):
            grid = _grid(pass_, n_q, n_k, batch)
            if tuned:
                config = TUNED_CONFIGS.get(("bwd", *key, pass_))
                if config is None:
                    _flash_bwd_tuned[grid](*args, **meta, PASS=pass_)
                    remember_tuning(("bwd", *key, pass_), _flash_bwd_tuned)
                    continue
            else:
                config = untuned_configs[pass_]
            launch_kernel(_flash_bwd_kernel, grid(config), args, {**meta, "PASS": pass_, **config})

    if mode == "auto":
        mode = choose_launch(("bwd-launch", *key), run) if tuned else untuned_mode
    run(mode)
    return grad_q, grad_k, grad_v


def choose_launch(key: tuple, run) -> str:
    """The faster of the fused and the two-pass launch for this shape, timed once (after tuning both)."""
    if key not in TUNED_CONFIGS:
        from triton.testing import do_bench

        times = {mode: do_bench(lambda m=mode: run(m), return_mode="median") for mode in ("fused", "two_pass")}
        TUNED_CONFIGS[key] = {"launch": min(times, key=times.get)}
        TUNING_TIMINGS[key] = times
    return TUNED_CONFIGS[key]["launch"]


def backward_launch_args(q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v, is_causal: bool):
    """Positional arguments and constexpr keywords (all but PASS and tiles) of the backward kernel."""
    d = q.shape[-1]
    args = (q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), grad_q.stride(0), grad_q.stride(1),
            grad_k.stride(0), grad_k.stride(1), grad_v.stride(0), grad_v.stride(1),
            q.shape[1], k.shape[1], base2_scale(d), 1.0 / math.sqrt(d), tune_batch(q.shape[0]))
    meta = {"HEAD_DIM": d, "IS_CAUSAL": bool(is_causal), "PRECISION": dot_precision(q.dtype)}
    return args, meta
