"""FlashAttention-2 backward in Triton: a dK/dV pass over key tiles and a dQ pass over query tiles.

Both recompute ``P = exp2(S * log2(e) / sqrt(d) - L * log2(e))`` from the saved logsumexp ``L`` and use
``D = rowsum(dO * O)``:

* a **dK/dV program** holds one key/value tile in registers and loops over query tiles (causal: from the
  tile holding query ``start_n`` on, since earlier queries never see these keys; only the first few query
  tiles, which cross the diagonal, are masked). Per tile pair it computes ``S``, ``dV += P^T dO``,
  ``dP = dO V^T`` and ``dK += dS^T Q``;
* a **dQ program** holds one query tile and loops over key tiles up to the diagonal (the same split into an
  unmasked part and masked diagonal tiles as the forward), recomputing ``S`` and ``dP`` for ``dQ += dS K``.

The two programs are device functions of :mod:`lab.kernels.flash_backward_tiles`; this module holds the
kernel that runs them over a grid, and its host function :func:`flash_backward`.

That is 7 matrix products per tile pair where 5 suffice, the price of every program owning the rows it
writes. ``backward_launch="atomic"`` takes the other side of the trade: the dK/dV program also computes
``dS K`` and adds it into an fp32 dQ buffer with atomics (5 products; the order of the additions, so the
last bits of dQ, varies between runs). Launch modes (``FlashConfig.backward_launch``):

* ``"fused"``: one grid whose programs are dK/dV and dQ programs interleaved, heaviest causal tiles first.
  Two independent passes in one grid keep all SMs busy when one head gives fewer tiles than there are SMs;
* ``"two_pass"``: the dK/dV kernel, then the dQ kernel. With many heads the GPU is full either way, and each
  kernel alone needs fewer registers and a smaller L2 working set;
* ``"ordered"``: as ``"atomic"``, deterministic: the key tiles of a head add their dQ shares into each query
  tile one after another, in descending key-tile order (an int32 counter per query tile says whose turn it
  is; the program whose turn it is reads, adds and writes the rows), so dQ has the same bits on every run.
  The dK/dV programs start lightest first (the last key tile), so each one waits only for programs launched
  before it. On an H100 it took 1.6-1.7x the atomic launch's time on long causal shapes and 2x on a
  non-causal one (all key tiles visit the query tiles in the same order, so they wait in a wavefront): the
  loop that waits for its turn is not software-pipelined (``results/flash_ordered_check``);
* ``"atomic"``: the dK/dV kernel with atomic dQ, then one cast of the fp32 buffer. On Hopper each tile's dQ
  share is one TMA bulk reduction (``FlashConfig.atomic_tma``), which the copy engine applies in L2 (on an
  H100 as fast as per-element atomics from the threads, within 3%). Measured on an H100 the launch ties the
  two-pass launch at d = 128 and loses at d = 64 and 80: the saved products are paid back in dQ traffic
  (an fp32 read-modify-write of ``BLOCK_M1 x d`` per tile pair) and in the dK/dV program's registers.

``D`` comes from a small preprocess kernel, or with ``fused_delta`` from the kernels themselves: a dQ
program computes it for its own rows (in ``"two_pass"`` the dQ pass runs first and stores it for the dK/dV
pass), a dK/dV program recomputes it per query tile from O and dO.

Head dimensions, TMA and strides work as in the forward (``flash_launch``): Q/dO tiles streamed by the
dK/dV loop and K/V tiles streamed by the dQ loop come from pointers or TMA descriptors; the tiles a program
keeps are loaded once with pointers. A head dimension split in two column chunks (``BLOCK_D1 > 0``,
``flash_config.head_chunks``) sums the two chunks' products into ``S`` and ``dP`` and keeps one accumulator
per chunk for dK, dV and dQ; its tiles always come through pointers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lab.kernels.flash_backward_tiles import dkdv_tile, dq_tile
from lab.kernels.flash_config import (
    ADDS_DQ,
    DEFAULT_CONFIG,
    INTERPRET,
    FlashConfig,
    autotunes,
    backward_plan,
    block_d,
    dot_precision,
    has_tma,
    head_chunks,
    interpreter_needs_fp32,
    tune_batch,
)
from lab.kernels.flash_launch import (
    TUNED_CONFIGS,
    TensorDescriptor,
    as_bhsd,
    base2_scale,
    descriptor_pre_hook,
    launch,
    load_tile,
    remember_tuning,
    stream_source,
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
    o = load_tile(O, z.to(tl.int64) * stride_oz + h.to(tl.int64) * stride_oh, 0, start_m, n_q, stride_os,
                  BLOCK_M, BLOCK_D, HEAD_DIM, True)
    do = load_tile(DO, z.to(tl.int64) * stride_doz + h.to(tl.int64) * stride_doh, 0, start_m, n_q, stride_dos,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True)
    rows = start_m + tl.arange(0, BLOCK_M)
    zh = z * tl.num_programs(1) + h
    tl.store(Delta + zh.to(tl.int64) * n_q + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1),
             mask=rows < n_q)


@triton.jit(do_not_specialize=["tune_batch"])
def _flash_bwd_kernel(Q, K, V, O, DO, L, Delta, DQ, DK, DV, Q_S, DO_S, K_S, V_S, DQ_ACC, DQ_TURN,
                      stride_qz, stride_qh, stride_qs, stride_kz, stride_kh, stride_ks,
                      stride_vz, stride_vh, stride_vs, stride_oz, stride_oh, stride_os,
                      stride_doz, stride_doh, stride_dos, stride_dqz, stride_dqh, stride_dqs,
                      stride_dkz, stride_dkh, stride_dks, stride_dvz, stride_dvh, stride_dvs,
                      n_q, n_k, qk_scale, sm_scale, tune_batch,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D1: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      PRECISION: tl.constexpr, PASS: tl.constexpr, ATOMIC_DQ: tl.constexpr, ORDERED_DQ: tl.constexpr,
                      DELTA_FROM_O: tl.constexpr, STORE_DELTA: tl.constexpr,
                      BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr):
    """PASS 1: dK/dV programs only; PASS 2: dQ programs only; PASS 0: both, interleaved in one grid.
    Grid (programs, heads, batch). Q_S/DO_S (streamed by dK/dV programs) and K_S/V_S (streamed by dQ
    programs) are TMA descriptors or the same pointers as Q, DO, K, V; DQ_ACC, where ATOMIC_DQ adds dQ, is
    DQ itself or a (heads, n_q, d) descriptor over it; DQ_TURN, with ORDERED_DQ, the int32 turn counters of
    the ordered additions (zeros; unused otherwise). ``tune_batch`` only keys the autotuner."""
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
    o_off = z64 * stride_oz + h64 * stride_oh
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
        if ORDERED_DQ:  # the lightest key tile first: each waits for the one after it (flash_backward_tiles)
            tile = n_kv_tiles - 1 - pid
        is_kv = PASS == 1
    if is_kv:
        # key tile 0 has the most causal work (every query sees it): it goes first
        # (in "ordered" mode key tile j waits for j + 1 of its head: launched before it, in this order)
        dkdv_tile(K, V, O, DQ_ACC, DK, DV, Q_S, DO_S, L, Delta, DQ_TURN, k_off, v_off, o_off, dq_off, dk_off, dv_off,
                   q_off, do_off, zh, stride_ks, stride_vs, stride_qs, stride_dos, stride_os, stride_dqs, stride_dks,
                   stride_dvs, tile * BLOCK_N1, n_q, n_k, qk_scale, sm_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_D1, IS_CAUSAL, PRECISION, ATOMIC_DQ, DELTA_FROM_O, BLOCK_M1, BLOCK_N1,
                   ORDERED_DQ)
    else:
        # the last query tile has the most causal work (it sees every key): it goes first
        dq_tile(Q, DO, O, L, Delta, DQ, K_S, V_S, q_off, do_off, o_off, dq_off, k_off, v_off, zh,
                 stride_qs, stride_dos, stride_os, stride_dqs, stride_ks, stride_vs,
                 (n_q_tiles - 1 - tile) * BLOCK_M2, n_q, n_k, qk_scale, sm_scale,
                 HEAD_DIM, BLOCK_D, BLOCK_D1, IS_CAUSAL, PRECISION, DELTA_FROM_O, STORE_DELTA, BLOCK_M2, BLOCK_N2)


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
    hook = descriptor_pre_hook({"Q_S": "BLOCK_M1", "DO_S": "BLOCK_M1", "K_S": "BLOCK_N2", "V_S": "BLOCK_N2",
                                "DQ_ACC": "BLOCK_M1"})
    return [triton.Config({"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2}, num_warps=w, num_stages=s,
                          pre_hook=hook) for m1, n1, m2, n2, w, s in shapes]


def _prune_bwd_configs(configs, named_args, **kwargs):
    """Drop configs whose fp32 dK+dV accumulators would need > 192 registers a thread (they spill)."""
    bd = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    if bd is None:
        return configs
    bd += kwargs.get("BLOCK_D1", named_args.get("BLOCK_D1", 0))
    kept = [c for c in configs if 2 * c.kwargs["BLOCK_N1"] * bd / (32 * c.num_warps) <= 192]
    return kept or configs


# DQ is reset before every trial: with atomic dQ updates the trials would otherwise add up.
_flash_bwd_tuned = triton.autotune(
    configs=_bwd_configs(),
    key=["n_q", "n_k", "tune_batch", "HEAD_DIM", "BLOCK_D1", "IS_CAUSAL", "PRECISION", "PASS", "ATOMIC_DQ",
         "ORDERED_DQ", "DELTA_FROM_O"],
    prune_configs_by={"early_config_prune": _prune_bwd_configs}, reset_to_zero=["DQ"])(_flash_bwd_kernel)


def atomic_target(grad_q: torch.Tensor, block_rows: int, bd: int, config: FlashConfig, split: bool = False,
                  ordered: bool = False):
    """Where atomic dQ updates go: a (batch * heads, n_q, d) TMA descriptor over the fp32 buffer ``grad_q``
    (batch, heads, n_q, d) with ``(1, block_rows, bd)`` blocks when ``config.atomic_tma`` and the GPU has TMA
    (the copy engine clips each block to its own head, so ragged tiles need no mask), else ``grad_q`` (also
    for a ``split`` head dimension, whose two column chunks a single block shape cannot serve, and for the
    ``ordered`` additions, which read and write rows themselves)."""
    if split or ordered or not (config.atomic_tma and TensorDescriptor is not None and grad_q.is_cuda
                                and grad_q.is_contiguous() and has_tma(grad_q.device.index or 0)):
        return grad_q
    b, h, n_q, d = grad_q.shape
    return TensorDescriptor(grad_q, [b * h, n_q, d], [n_q * d, d, 1], [1, block_rows, bd])


def backward_launch_args(q, k, v, out, grad_out, lse, delta, grad_q, grad_k, grad_v, is_causal: bool,
                         config: FlashConfig, tiles: dict, atomic: bool = False,
                         turns: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """Positional arguments and constexpr keywords (all but PASS, the delta/atomic switches and the tiles)
    of the backward kernel on (batch, heads, seq, d) tensors; ``atomic``: the pass adds dQ atomically into
    the fp32 buffer ``grad_q`` (see :func:`atomic_target`); ``turns``: the ordered additions' counters
    (:func:`turn_counters`), where the pass adds dQ in key-tile order."""
    d = q.shape[-1]
    bd, bd1 = head_chunks(d, q.dtype, "bwd", q.shape[2], k.shape[2], config)
    ordered = turns is not None
    dq_acc = atomic_target(grad_q, tiles["BLOCK_M1"], bd, config, bd1 > 0, ordered) if atomic else grad_q
    tma = config.bwd_tma and not bd1
    q_s, do_s = (stream_source(t, tiles["BLOCK_M1"], bd, tma) for t in (q, grad_out))
    if isinstance(q_s, torch.Tensor) != isinstance(do_s, torch.Tensor):
        # The dK/dV loop zeroes the next head's rows through the logsumexp fill it picks from Q's kind of
        # source, so Q and dO are streamed alike: both through TMA or both through pointers.
        q_s, do_s = q, grad_out
    k_s, v_s = (stream_source(t, tiles["BLOCK_N2"], bd, tma) for t in (k, v))
    tensors = (q, k, v, out, grad_out, grad_q, grad_k, grad_v)
    # without ordered additions the counters are never touched: lse stands in for them (no allocation)
    args = (q, k, v, out, grad_out, lse, delta, grad_q, grad_k, grad_v, q_s, do_s, k_s, v_s, dq_acc,
            turns if ordered else lse,
            *(s for t in tensors for s in t.stride()[:3]),
            q.shape[2], k.shape[2], base2_scale(d), 1.0 / math.sqrt(d), tune_batch(q.shape[0] * q.shape[1]))
    meta = {"HEAD_DIM": d, "BLOCK_D": bd, "BLOCK_D1": bd1, "IS_CAUSAL": bool(is_causal),
            "PRECISION": dot_precision(q.dtype, config.fp32_precision)}
    return args, meta


def _passes(mode: str, fused_delta: bool) -> list[tuple[int, dict]]:
    """The kernel launches of a launch mode, in order: (PASS, switches). Without ``fused_delta`` the
    preprocess kernel has filled Delta before."""
    plain = {"ATOMIC_DQ": False, "ORDERED_DQ": False, "DELTA_FROM_O": False, "STORE_DELTA": False}
    if mode == "fused":
        return [(0, {**plain, "DELTA_FROM_O": fused_delta})]
    if mode in ADDS_DQ:
        return [(1, {**plain, "ATOMIC_DQ": True, "ORDERED_DQ": mode == "ordered", "DELTA_FROM_O": fused_delta})]
    if fused_delta:  # the dQ pass computes D for its rows and stores it for the dK/dV pass
        return [(2, {**plain, "DELTA_FROM_O": True, "STORE_DELTA": True}), (1, plain)]
    return [(1, plain), (2, plain)]


def turn_counters(batch_heads: int, n_q: int, block_m1: int, device) -> torch.Tensor:
    """The int32 counters of the ordered dQ additions: one per head and query tile of ``block_m1`` rows, zeros
    (the kernel leaves them at zero too)."""
    return torch.zeros(batch_heads * triton.cdiv(n_q, block_m1), dtype=torch.int32, device=device)


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
    tuned = autotunes(config, q.dtype, n_q, n_k, config.bwd_tiles)
    key = (n_q, n_k, tune_batch(batch * heads), d, head_chunks(d, q.dtype, "bwd", n_q, n_k, config),
           bool(is_causal), q.dtype,
           config.bwd_tma, config.fused_delta)
    mode, table = backward_plan(batch * heads, n_q, n_k, d, q.dtype, q.device, config)

    def run(mode_):
        dq_target = dq4
        if mode_ in ADDS_DQ:  # an fp32 accumulator (the gradient itself for fp32 inputs), scaled once at the end
            dq_target = dq4.zero_() if q.dtype == torch.float32 else torch.zeros(
                batch, heads, n_q, d, dtype=torch.float32, device=q.device)
        fused_delta = config.fused_delta
        if not fused_delta:
            pre_block = 16 if INTERPRET else 64
            launcher(_bwd_preprocess_kernel, (triton.cdiv(n_q, pre_block), heads, batch),
                     (o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], n_q),
                     {"HEAD_DIM": d, "BLOCK_D": block_d(d), "BLOCK_M": pre_block}, fast=config.fast_launch)
        for pass_, switches in _passes(mode_, fused_delta):
            tiles = TUNED_CONFIGS.get(("bwd", *key, pass_, mode_)) if tuned else table[pass_]
            # while the autotuner picks the tiles, counters for 16-row query tiles, the smallest (larger ones use
            # a prefix); every trial leaves them at zero for the next
            rows = 16 if tiles is None else tiles["BLOCK_M1"]
            turns = turn_counters(batch * heads, n_q, rows, q.device) if switches["ORDERED_DQ"] else None
            args, meta = backward_launch_args(q4, k4, v4, o4, do4, lse, delta, dq_target, dk4, dv4, is_causal, config,
                                              tiles or table[pass_], atomic=switches["ATOMIC_DQ"], turns=turns)
            meta = {**meta, "PASS": pass_, **switches}

            def grid(m, p=pass_):
                kv, qt = triton.cdiv(n_k, m["BLOCK_N1"]), triton.cdiv(n_q, m["BLOCK_M2"])
                return ({0: kv + qt, 1: kv, 2: qt}[p], heads, batch)

            if tuned and tiles is None:
                _flash_bwd_tuned[grid](*args, **meta)
                remember_tuning(("bwd", *key, pass_, mode_), _flash_bwd_tuned)
            else:
                launcher(_flash_bwd_kernel, grid(tiles), args, {**meta, **tiles}, fast=config.fast_launch)
        if mode_ in ADDS_DQ:  # one elementwise kernel: scale (and cast to q's dtype)
            torch.mul(dq_target.view(grad_q.shape), 1.0 / math.sqrt(d), out=grad_q)

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
