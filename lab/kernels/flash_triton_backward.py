"""FlashAttention-2 backward in Triton: a dK/dV pass over key tiles and a dQ pass over query tiles.

Both recompute ``P = exp2(S * log2(e) / sqrt(d) - L * log2(e))`` from the saved logsumexp ``L`` and use
``D = rowsum(dO * O)``, which a small preprocess kernel computes first:

* a **dK/dV program** holds one key/value tile in registers and loops over query tiles (causal: from the
  tile holding query ``start_n`` on, since earlier queries never see these keys; only the first few query
  tiles, which cross the diagonal, are masked). Per tile pair it computes ``S``, ``dV += P^T dO``,
  ``dP = dO V^T`` and ``dK += dS^T Q``;
* a **dQ program** holds one query tile and loops over key tiles up to the diagonal (the same split into an
  unmasked part and masked diagonal tiles as the forward), recomputing ``S`` and ``dP`` for ``dQ += dS K``.

The two programs are device functions of :mod:`lab.kernels.flash_backward_tiles`; this module holds the
kernel that runs them over a grid, and its host function :func:`flash_backward`.

That is 7 matrix products per tile pair where 5 suffice, the price of every program owning the rows it
writes: no atomics, and the same bits on every run. Launch modes (``FlashConfig.backward_launch``):

* ``"fused"``: one grid whose programs are dK/dV and dQ programs interleaved, heaviest causal tiles first.
  Two independent passes in one grid keep all SMs busy when one head gives fewer tiles than there are SMs;
* ``"two_pass"``: the dK/dV kernel, then the dQ kernel. With many heads the GPU is full either way, and each
  kernel alone needs fewer registers and a smaller L2 working set.

Tried and removed (``results/flash_atomic_check``, ``results/flash_ordered_check``): a dK/dV pass that also
adds each tile pair's dQ share into an fp32 buffer (5 products per tile pair, by atomics or by TMA bulk
reductions). It was slower than the two-pass launch on most shapes measured and at best a small gain on the
longest, and its dQ's last bits varied from run to run: the saved products were paid back in dQ traffic (an
fp32 read-modify-write per tile pair) and in the dK/dV program's registers. Adding the same shares in a fixed
key-tile order (deterministic) was slower than the atomic launch on every shape measured: the loop that waits
for its turn is not software-pipelined. Also tried and never chosen by the tables: ``D`` computed inside the
backward kernels instead of by the preprocess kernel, and Q/dO and K/V tiles streamed through TMA descriptors.

Head dimensions and strides work as in the forward (``flash_launch``). A head dimension split in two column
chunks (``BLOCK_D1 > 0``, ``flash_config.head_chunks``) sums the two chunks' products into ``S`` and ``dP``
and keeps one accumulator per chunk for dK, dV and dQ.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lab.kernels.flash_backward_tiles import dkdv_tile, dq_tile
from lab.kernels.flash_config import (
    DEFAULT_CONFIG,
    INTERPRET,
    LAUNCHED_PASSES,
    FlashConfig,
    autotunes,
    backward_plan,
    block_d,
    dot_precision,
    head_chunks,
    interpreter_needs_fp32,
    tune_batch,
)
from lab.kernels.flash_launch import (
    TUNED_CONFIGS,
    as_bhsd,
    base2_scale,
    launch,
    load_tile,
    remember_tuning,
    unit_last_stride,
)
from lab.kernels.triton_env import empty_in_layout


@triton.jit
def _bwd_preprocess_kernel(O, DO, Delta, stride_oz, stride_oh, stride_os, stride_doz, stride_doh, stride_dos, n_q,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * O) in fp32, shape (batch * heads, n_queries). Grid (query tiles, heads, batch)."""
    h = tl.program_id(1)
    z = tl.program_id(2)
    start_m = tl.program_id(0) * BLOCK_M
    o = load_tile(O, z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh, start_m, n_q, stride_os,
                  BLOCK_M, BLOCK_D, HEAD_DIM, True)
    do = load_tile(DO, z.to(tl.int64) * stride_doz + h.to(tl.int64) * stride_doh, start_m, n_q, stride_dos,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True)
    rows = start_m + tl.arange(0, BLOCK_M)
    zh = z * tl.num_programs(1) + h
    tl.store(Delta + zh.to(tl.int64) * n_q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1),
             mask=rows < n_q)


@triton.jit(do_not_specialize=["tune_batch"])
def _flash_bwd_kernel(Q, K, V, DO, L, Delta, DQ, DK, DV,
                      stride_qz, stride_qh, stride_qs, stride_kz, stride_kh, stride_ks,
                      stride_vz, stride_vh, stride_vs, stride_doz, stride_doh, stride_dos,
                      stride_dqz, stride_dqh, stride_dqs, stride_dkz, stride_dkh, stride_dks,
                      stride_dvz, stride_dvh, stride_dvs,
                      n_q, n_k, qk_scale, sm_scale, tune_batch,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      PRECISION: tl.constexpr, PASS: tl.constexpr,
                      BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    """PASS 1: dK/dV programs only; PASS 2: dQ programs only; PASS 0: both, interleaved in one grid.
    Grid (programs, heads, batch). ``tune_batch`` only keys the autotuner."""
    # Inductor passes Python floats as fp64 (when it launches this kernel itself, FlashConfig.compile_inline):
    # fp32 scales keep the recomputed softmax and the gradients' scaling in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    # Programs start in x-fastest order (slots ordered heaviest first below); heads one after the other,
    # so that the programs running together share one head's Q, K, V, dO in L2.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    z = tl.program_id(2)
    zh = z * tl.num_programs(1) + h
    z64 = z.to(tl.int64)
    h64 = h.to(tl.int64)
    q_off = z64 * stride_qz + h64 * stride_qh
    k_off = z64 * stride_kz + h64 * stride_kh
    v_off = z64 * stride_vz + h64 * stride_vh
    do_off = z64 * stride_doz + h64 * stride_doh
    dq_off = z64 * stride_dqz + h64 * stride_dqh
    dk_off = z64 * stride_dkz + h64 * stride_dkh
    dv_off = z64 * stride_dvz + h64 * stride_dvh
    n_kv_tiles = tl.cdiv(n_k, BLOCK_N1)
    n_q_tiles = tl.cdiv(n_q, BLOCK_M2)
    if PASS == 0:
        # Alternate dK/dV and dQ programs while both have tiles left, then the rest of the longer pass.
        n_pairs = tl.minimum(n_kv_tiles, n_q_tiles)
        paired = pid < 2 * n_pairs
        tile = tl.where(paired, pid // 2, pid - n_pairs)
        is_kv = tl.where(paired, pid % 2 == 0, n_kv_tiles > n_q_tiles)
    else:
        tile = pid
        is_kv = PASS == 1
    if is_kv:
        # key tile 0 has the most causal work (every query sees it): it goes first
        dkdv_tile(K, V, DK, DV, Q, DO, L, Delta, k_off, v_off, dk_off, dv_off, q_off, do_off, zh,
                  stride_ks, stride_vs, stride_qs, stride_dos, stride_dks, stride_dvs, tile * BLOCK_N1,
                  n_q, n_k, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, BLOCK_D1, IS_CAUSAL, PRECISION, BLOCK_M1, BLOCK_N1)
    else:
        # the last query tile has the most causal work (it sees every key): it goes first
        dq_tile(Q, DO, L, Delta, DQ, K, V, q_off, do_off, dq_off, k_off, v_off, zh,
                stride_qs, stride_dos, stride_dqs, stride_ks, stride_vs, (n_q_tiles - 1 - tile) * BLOCK_M2,
                n_q, n_k, qk_scale, sm_scale, HEAD_DIM, BLOCK_D, BLOCK_D1, IS_CAUSAL, PRECISION, BLOCK_M2, BLOCK_N2)


#: The backward kernel itself, for tools that compile it without launching it (:mod:`lab.kernels.flash_sm90`).
BACKWARD_KERNEL = _flash_bwd_kernel


def _bwd_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16},
                              num_warps=4, num_stages=1)]
    shapes = [  # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)
        (64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 3),
        (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3),
        (32, 128, 128, 32, 8, 3), (32, 128, 128, 32, 4, 5),
    ]
    return [triton.Config({"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2}, num_warps=w, num_stages=s)
            for m1, n1, m2, n2, w, s in shapes]


def _prune_bwd_configs(configs, named_args, **kwargs):
    """Drop configs whose fp32 dK+dV accumulators would need > 192 registers a thread (they spill)."""
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    if bd is None:
        return configs
    bd += kwargs.get("BLOCK_D1", named_args.get("BLOCK_D1", 0))
    kept = [c for c in configs if 2 * c.kwargs["BLOCK_N1"] * bd / (32 * c.num_warps) <= 192]
    return kept or configs


_flash_bwd_tuned = triton.autotune(
    configs=_bwd_configs(),
    key=["n_q", "n_k", "tune_batch", "HEAD_DIM", "BLOCK_D1", "IS_CAUSAL", "PRECISION", "PASS"],
    prune_configs_by={"early_config_prune": _prune_bwd_configs})(_flash_bwd_kernel)


def backward_launch_args(q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v, is_causal: bool,
                         config: FlashConfig) -> tuple[tuple, dict]:
    """Positional arguments and constexpr keywords (all but PASS and the tiles) of the backward kernel on
    (batch, heads, seq, d) tensors."""
    d = q.shape[-1]
    bd, bd1 = head_chunks(d, q.dtype, "bwd", q.shape[2], k.shape[2], config)
    tensors = (q, k, v, grad_out, grad_q, grad_k, grad_v)
    args = (q, k, v, grad_out, lse, delta, grad_q, grad_k, grad_v, *(s for t in tensors for s in t.stride()[:3]),
            q.shape[2], k.shape[2], base2_scale(d), 1.0 / math.sqrt(d), tune_batch(q.shape[0] * q.shape[1]))
    meta = {"HEAD_DIM": d, "BLOCK_D": bd, "BLOCK_D1": bd1, "IS_CAUSAL": bool(is_causal),
            "PRECISION": dot_precision(q.dtype, config.fp32_precision)}
    return args, meta


def flash_backward(q, k, v, out, lse, grad_out, is_causal: bool, config: FlashConfig = DEFAULT_CONFIG,
                   launcher=launch):
    """Gradients (dQ, dK, dV) of FlashAttention-2 with Triton kernels, in the dtype, shape and memory layout
    of q, k, v (:func:`empty_in_layout`). ``lse`` is the fp32 logsumexp (q.shape[:-1]) saved by the forward.
    ``launcher`` launches the kernels (``flash_launch.launch``, or ``inline_launch`` when traced for Inductor;
    the autotuner always launches itself)."""
    if interpreter_needs_fp32(q.dtype):
        grads = flash_backward(q.float(), k.float(), v.float(), out.float(), lse, grad_out.float(), is_causal, config,
                               launcher)
        return tuple(g.to(q.dtype) for g in grads)
    grad_q, grad_k, grad_v = (empty_in_layout(t) for t in (q, k, v))
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (as_bhsd(unit_last_stride(t))
                                          for t in (q, k, v, out, grad_out, grad_q, grad_k, grad_v))
    lse = lse.contiguous()
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    pre_block = 16 if INTERPRET else 64
    launcher(_bwd_preprocess_kernel, (triton.cdiv(n_q, pre_block), heads, batch),
             (o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], n_q),
             {"HEAD_DIM": d, "BLOCK_D": block_d(d), "BLOCK_M": pre_block}, fast=config.fast_launch)
    tuned = autotunes(config, q.dtype, n_q, n_k, config.bwd_tiles)
    key = (n_q, n_k, tune_batch(batch * heads), d, head_chunks(d, q.dtype, "bwd", n_q, n_k, config),
           bool(is_causal), q.dtype)
    mode, table = backward_plan(batch * heads, n_q, n_k, d, q.dtype, q.device, config)
    args, meta = backward_launch_args(q4, k4, v4, do4, lse, delta, dq4, dk4, dv4, is_causal, config)

    def run(mode_):
        for pass_ in LAUNCHED_PASSES[mode_]:
            tiles = TUNED_CONFIGS.get(("bwd", *key, pass_)) if tuned else table[pass_]

            def grid(m, p=pass_):
                kv, qt = triton.cdiv(n_k, m["BLOCK_N1"]), triton.cdiv(n_q, m["BLOCK_M2"])
                return ({0: kv + qt, 1: kv, 2: qt}[p], heads, batch)

            if tiles is None:
                _flash_bwd_tuned[grid](*args, **meta, PASS=pass_)
                remember_tuning(("bwd", *key, pass_), _flash_bwd_tuned)
            else:
                launcher(_flash_bwd_kernel, grid(tiles), args, {**meta, "PASS": pass_, **tiles},
                         fast=config.fast_launch)

    if config.backward_launch == "auto" and tuned:
        mode = choose_launch(("bwd-launch", *key), run)
    run(mode)
    return grad_q, grad_k, grad_v


def choose_launch(key: tuple, run) -> str:
    """The faster of the fused and the two-pass launch for this shape, timed once (after tuning both)."""
    if key not in TUNED_CONFIGS:
        from triton.testing import do_bench

        times = {mode: do_bench(lambda m=mode: run(m), return_mode="median") for mode in ("fused", "two_pass")}
        TUNED_CONFIGS[key] = {"launch": min(times, key=times.get)}
    return TUNED_CONFIGS[key]["launch"]
