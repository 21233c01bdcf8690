"""FlashAttention backward for Hopper (``sm_90a``) in Triton's Gluon layer, on FlashAttention-3's schedule.

One CTA owns a tile of 128 keys of one (batch, head) and streams the query tiles that see it:

* **Row statistics first.** A small Triton kernel (:mod:`lab.kernels.flash_gluon_rows`) computes
  ``D = rowsum(dO * O)`` (fp32) before the main kernel, so that ``dS = P * (dP - D)`` needs nothing the key
  tile's CTA does not have.
* **Producer warp.** It loads the CTA's K and V once (each consumer's 64 rows), then every query tile's Q, dO
  and row statistics into a ring of ``STAGES`` shared-memory slots with ready/empty mbarriers, as in the
  forward.
* **Two consumer warp groups, 64 keys each.** They compute the transposed products ``S^T = K Q^T`` and
  ``dP^T = V dO^T`` (asynchronous ``wgmma``), so that ``P^T`` and ``dS^T`` come out in the accumulator layout
  and feed the next products straight from registers: ``dV += P^T dO`` and ``dK += dS^T Q`` accumulate in
  registers across all query tiles, five products a tile pair in all.
* **dQ in fp32 across key tiles.** Both groups write their ``dS^T`` rows to one of two shared tiles (an
  mbarrier says when both have), and each computes ``dQ = dS K`` for half of the head dimension over all 128
  keys. At d 128 the groups then issue dK's product and, while it runs, hand dQ to a writer warp through
  shared memory, which adds it to an fp32 accumulator in device memory with TMA reduce-adds
  (FlashAttention-3's way: the groups keep the registers atomics' addresses would take, which made them
  spill); at d 64 the groups add it themselves with atomics (:func:`dq_writer_default`). A last Triton kernel
  scales the accumulator and casts it to the input dtype. The order of the additions varies from run to run,
  so dQ is not bitwise reproducible.
* **Causal:** a key tile skips the query tiles entirely before it (they see none of its keys), and only the
  query tiles crossing the diagonal, a ragged last query tile, or a ragged key tile pay for the mask.
"""

from __future__ import annotations

import math

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lab.kernels.flash_gluon_forward import CONSUMER_REGISTERS, PRODUCER_REGISTERS
from lab.kernels.flash_gluon_rows import row_statistics, scale_cast

#: Whether this Triton's Gluon builds a TMA reduce-add (``cp.reduce.async.bulk.tensor``): its Python layer has
#: no call for it, so :func:`_tma_reduce_add` calls the IR builder's binding, which Triton 3.6 has; under any
#: other version the consumers add dQ with atomics instead (:func:`dq_writer_default`).
TMA_REDUCE = triton.__version__.split(".")[:2] == ["3", "6"]


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """Add shared-memory tile ``src`` to the tensor of ``desc`` at ``coord`` (an asynchronous bulk reduction the
    TMA unit performs; ``tma.store_wait`` waits for it to have read ``src``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _to_16_bits(x, dtype: gl.constexpr):
    """``x`` (fp32) rounded to ``dtype`` (bf16 or fp16) two elements an instruction. ``x.to(gl.bfloat16)`` leaves
    ptxas half its conversions as one-element F2F instructions, which run on a slow pipe (fp16's it pairs into
    F2FP): the bf16 backward took 21% longer than the fp16 one at d 64 and 6% at d 128, with the same products."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return x.to(dtype)


@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
              lse_smem, delta_smem, kv_ready, q_ready, q_empty, kv_row, q_row, stat_row, i_start, n_q_tiles,
              STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The producer warp: the key tile's K and V once, then Q, dO and the row statistics of query tiles
    ``i_start ..`` (the statistics through shared memory too: loaded as pointer tensors, their addresses would
    hold registers the consumers need)."""
    HALF: gl.constexpr = BLOCK_N // 2
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [kv_row + w * HALF, 0], kv_ready, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [kv_row + w * HALF, 0], kv_ready, v_smem.index(w))
    for i in range(i_start, n_q_tiles):
        t = i - i_start
        slot = t % STAGES
        mbarrier.wait(q_empty.index(slot), ((t // STAGES) & 1) ^ 1)
        ready = q_ready.index(slot)
        mbarrier.expect(ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + i * BLOCK_M, 0], ready, q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [q_row + i * BLOCK_M, 0], ready, do_smem.index(slot))
        tma.async_copy_global_to_shared(lse_desc, [stat_row + i * BLOCK_M], ready, lse_smem.index(slot))
        tma.async_copy_global_to_shared(delta_desc, [stat_row + i * BLOCK_M], ready, delta_smem.index(slot))


@gluon.jit
def _query_tile(i, t, dk, dv, k_smem, v_w, q_smem, do_smem, ds_smem, dq_smem, q_ready, q_empty, ds_ready,
                dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, keys, n_q, n_k, qk_scale,
                WG: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, DQ_WRITER: gl.constexpr):
    """Query tile ``i`` (the ``t``-th this CTA visits) against warp group ``WG``'s 64 keys: the five products;
    dQ's share goes to the dQ writer warp through shared memory (``DQ_WRITER``), or to device memory."""
    HALF: gl.constexpr = 64
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    slot = t % STAGES
    q_s = q_smem.index(slot)
    do_s = do_smem.index(slot)
    mbarrier.wait(q_ready.index(slot), (t // STAGES) & 1)
    zeros = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
    st_tok = warpgroup_mma(k_smem.index(WG), q_s.permute((1, 0)), zeros, use_acc=False, is_async=True)
    dpt_tok = warpgroup_mma(v_w, do_s.permute((1, 0)), zeros, use_acc=False, is_async=True)

    st = warpgroup_mma_wait(1, deps=(st_tok, ))
    lse2 = lse_smem.index(slot).load(gl.SliceLayout(0, st_layout))
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if MASK:
        queries = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        keep = (gl.expand_dims(queries, 0) < n_q) & (gl.expand_dims(keys, 1) < n_k)
        if IS_CAUSAL:
            keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0))
        pt = gl.where(keep, pt, 0.0)
    # dV's product runs while dS is computed: the wait below retires dP^T, issued before it. dS takes P as
    # rounded for that product (dS itself is rounded to 16 bits next), so the fp32 P need not stay live.
    pt16 = _to_16_bits(pt, q_s.dtype)
    pt_op = gl.convert_layout(pt16, op_layout)
    dv_tok = warpgroup_mma(pt_op, do_s, dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))
    delta = delta_smem.index(slot).load(gl.SliceLayout(0, st_layout))
    dst = pt16.to(gl.float32) * (dpt - gl.expand_dims(delta, 0))
    dst16 = _to_16_bits(dst, q_s.dtype)
    dst_op = gl.convert_layout(dst16, op_layout)
    if not DQ_WRITER:
        dk_tok = warpgroup_mma(dst_op, q_s, dk, is_async=True)

    # dS^T of both groups into one of two tiles, then dQ = dS K for this group's half of the head dimension,
    # summed over the two groups' keys. A group writes a tile again two query tiles later, after it has passed
    # the other tile's barrier, which the other group reaches only once its dQ products of this one retired.
    ds_tile = ds_smem.index(t % 2)
    ds_tile.slice(WG * HALF, HALF, dim=0).store(dst16)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(t % 2))
    mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
    dq = gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, dq_layout)
    for h in gl.static_range(2):
        dq = warpgroup_mma(ds_tile.slice(h * HALF, HALF, dim=0).permute((1, 0)),
                           k_smem.index(h).slice(WG * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1), dq, use_acc=h > 0,
                           is_async=True)
    if DQ_WRITER:
        # dK last: its product runs while dQ is handed to the writer warp
        dk_tok = warpgroup_mma(dst_op, q_s, dk, is_async=True)
        dq, dv, _, _ = warpgroup_mma_wait(1, deps=(dq, dv_tok, pt_op, dst_op))
        mbarrier.wait(dq_empty.index(WG), (t & 1) ^ 1)
        dq_smem.index(WG).store(dq)
        fence_async_shared()  # the writer's TMA reads the tile through the async proxy
        mbarrier.arrive(dq_full.index(WG))
        dk, _ = warpgroup_mma_wait(0, deps=(dk_tok, dst_op))
        mbarrier.arrive(q_empty.index(slot))
    else:
        dq, dv, dk, _, _ = warpgroup_mma_wait(0, deps=(dq, dv_tok, dk_tok, pt_op, dst_op))
        mbarrier.arrive(q_empty.index(slot))
        _add_dq(dq, dq_ptr, dq_base, i, n_q, WG, BLOCK_M, HEAD_DIM)
    return dk, dv


@gluon.jit
def _add_dq(dq, dq_ptr, dq_base, i, n_q, WG: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Add ``dq`` (rows of query tile ``i``, columns of half ``WG`` of the head dimension) to the fp32
    accumulator in device memory, four consecutive values a thread (16-byte atomics)."""
    COLS: gl.constexpr = HEAD_DIM // 2
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (COLS // 4), COLS // 4], [4, 1], [1, 0])  # a warp group
    dq = gl.convert_layout(dq, layout)
    rows = i * BLOCK_M + gl.arange(0, dq.shape[0], layout=gl.SliceLayout(1, layout))
    cols = WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    offsets = dq_base + gl.expand_dims(rows.to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
    gl.atomic_add(dq_ptr + offsets, dq, mask=gl.expand_dims(rows < n_q, 1), sem="relaxed")


@gluon.jit
def _dq_writer(dq_desc, dq_smem, dq_full, dq_empty, q_row, i_start, n_q_tiles, BLOCK_M: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """The dQ writer warp: each query tile's two dQ halves from shared memory into the fp32 accumulator in
    device memory, as TMA reduce-adds, while the consumers go on. A ragged last tile adds its rows past the
    head's end to the next head's first rows: they are exact zeros (their P, so their dS, is masked to 0),
    and the tensor's own end clips the last head's."""
    for i in range(i_start, n_q_tiles):
        t = i - i_start
        for w in gl.static_range(2):
            mbarrier.wait(dq_full.index(w), t & 1)
            _tma_reduce_add(dq_desc, [q_row + i * BLOCK_M, w * (HEAD_DIM // 2)], dq_smem.index(w))
        tma.store_wait(1)  # the first half is read: its tile is free
        mbarrier.arrive(dq_empty.index(0))
        tma.store_wait(0)
        mbarrier.arrive(dq_empty.index(1))


@gluon.jit
def _consumer(WG: gl.constexpr, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty,
              ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr, dv_ptr, kv_base,
              k0, i_start, i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale, sm_scale,
              STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr,
              DQ_WRITER: gl.constexpr):
    """Consumer warp group ``WG``: keys ``k0 + 64 WG ..`` of the tile; accumulates their dK and dV over the
    query tiles and stores them."""
    HALF: gl.constexpr = 64
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    keys = k0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    v_w = v_smem.index(WG)
    mbarrier.wait(kv_ready, 0)
    # [i_start, i_full_start) cross the diagonal, [i_full_end, n_q_tiles) hold a ragged end: those need the mask.
    for i in range(i_start, i_full_start):
        dk, dv = _query_tile(i, i - i_start, dk, dv, k_smem, v_w, q_smem, do_smem, ds_smem, dq_smem, q_ready,
                             q_empty, ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, keys,
                             n_q, n_k, qk_scale, WG, STAGES, BLOCK_M, HEAD_DIM, True, IS_CAUSAL, DQ_WRITER)
    for i in range(i_full_start, i_full_end):
        dk, dv = _query_tile(i, i - i_start, dk, dv, k_smem, v_w, q_smem, do_smem, ds_smem, dq_smem, q_ready,
                             q_empty, ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, keys,
                             n_q, n_k, qk_scale, WG, STAGES, BLOCK_M, HEAD_DIM, False, IS_CAUSAL, DQ_WRITER)
    for i in range(gl.maximum(i_full_end, i_full_start), n_q_tiles):
        dk, dv = _query_tile(i, i - i_start, dk, dv, k_smem, v_w, q_smem, do_smem, ds_smem, dq_smem, q_ready,
                             q_empty, ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, keys,
                             n_q, n_k, qk_scale, WG, STAGES, BLOCK_M, HEAD_DIM, True, IS_CAUSAL, DQ_WRITER)

    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    rows = k0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, store_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    offsets = kv_base + gl.expand_dims(rows.to(gl.int64) * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
    keep = gl.expand_dims(rows < n_k, 1)
    gl.store(dk_ptr + offsets, gl.convert_layout((dk * sm_scale).to(dk_ptr.dtype.element_ty), store_layout), mask=keep)
    gl.store(dv_ptr + offsets, gl.convert_layout(dv.to(dv_ptr.dtype.element_ty), store_layout), mask=keep)


@gluon.jit
def _consumer_default(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready,
                      dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr, dv_ptr, kv_base, k0, i_start,
                      i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale, sm_scale,
                      STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr,
                      DQ_WRITER: gl.constexpr):
    _consumer(0, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready,
              dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr, dv_ptr, kv_base, k0, i_start,
              i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale, sm_scale, STAGES, BLOCK_M, HEAD_DIM, IS_CAUSAL,
              DQ_WRITER)


@gluon.jit
def _consumer_worker(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready,
                     dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr, dv_ptr, kv_base, k0, i_start,
                     i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale, sm_scale,
                     STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, IS_CAUSAL: gl.constexpr,
                     DQ_WRITER: gl.constexpr):
    _consumer(1, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty, ds_ready,
              dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr, dv_ptr, kv_base, k0, i_start,
              i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale, sm_scale, STAGES, BLOCK_M, HEAD_DIM, IS_CAUSAL,
              DQ_WRITER)


@gluon.jit
def _attention_backward_kernel(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, dq_desc, dq_ptr, dk_ptr,
                               dv_ptr, n_q, n_k, qk_scale, sm_scale,
                               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, DQ_WRITER: gl.constexpr):
    """Grid (key tiles of ``BLOCK_N`` rows, batch * heads); causal key tile 0, which sees every query tile,
    starts first. ``DQ_WRITER``: a warp adds dQ to device memory by TMA (else the consumers do, between tiles,
    by atomics)."""
    gl.static_assert(BLOCK_N == 128, "two consumer warp groups of 64 keys")
    kt = gl.program_id(0)
    zh = gl.program_id(1)
    k0 = kt * BLOCK_N
    n_q_tiles = gl.cdiv(n_q, BLOCK_M)
    last_whole = n_q // BLOCK_M  # query tiles [last_whole, n_q_tiles) are ragged
    if IS_CAUSAL:
        i_start = gl.minimum(k0 // BLOCK_M, n_q_tiles)  # earlier query tiles see none of these keys
        i_full_start = gl.minimum(gl.cdiv(k0 + BLOCK_N, BLOCK_M), n_q_tiles)  # every query sees every key
    else:
        i_start = 0
        i_full_start = 0
    i_full_end = gl.maximum(gl.minimum(last_whole, n_q_tiles), i_full_start)
    if k0 + BLOCK_N > n_k:  # a ragged key tile: every query tile needs the key mask
        i_full_start = n_q_tiles
        i_full_end = n_q_tiles

    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N // 2, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N // 2, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for b in gl.static_range(2):
        mbarrier.init(ds_ready.index(b), count=2)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=2)
    for w in gl.static_range(2):
        mbarrier.init(dq_full.index(w), count=1)
        mbarrier.init(dq_empty.index(w), count=1)

    dq_base = zh.to(gl.int64) * n_q * HEAD_DIM
    kv_base = zh.to(gl.int64) * n_k * HEAD_DIM
    # Argument tuples are written in the call: a tuple assigned to a name would turn its constexprs into tensors.
    if DQ_WRITER:
        gl.warp_specialize([
            (_consumer_default, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty,
                                 ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr,
                                 dv_ptr, kv_base, k0, i_start, i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale,
                                 sm_scale, STAGES, BLOCK_M, HEAD_DIM, IS_CAUSAL, DQ_WRITER)),
            (_consumer_worker, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty,
                                ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr,
                                dv_ptr, kv_base, k0, i_start, i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale,
                                sm_scale, STAGES, BLOCK_M, HEAD_DIM, IS_CAUSAL, DQ_WRITER)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                         lse_smem, delta_smem, kv_ready, q_ready, q_empty, zh * n_k + k0, zh * n_q,
                         zh * n_q_tiles * BLOCK_M, i_start, n_q_tiles, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM)),
            (_dq_writer, (dq_desc, dq_smem, dq_full, dq_empty, zh * n_q, i_start, n_q_tiles, BLOCK_M, HEAD_DIM)),
        ], [4, 1, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS, PRODUCER_REGISTERS])
    else:
        gl.warp_specialize([
            (_consumer_default, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty,
                                 ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr,
                                 dv_ptr, kv_base, k0, i_start, i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale,
                                 sm_scale, STAGES, BLOCK_M, HEAD_DIM, IS_CAUSAL, DQ_WRITER)),
            (_consumer_worker, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, q_ready, q_empty,
                                ds_ready, dq_full, dq_empty, lse_smem, delta_smem, dq_ptr, dq_base, dk_ptr,
                                dv_ptr, kv_base, k0, i_start, i_full_start, i_full_end, n_q_tiles, n_q, n_k, qk_scale,
                                sm_scale, STAGES, BLOCK_M, HEAD_DIM, IS_CAUSAL, DQ_WRITER)),
            (_producer, (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                         lse_smem, delta_smem, kv_ready, q_ready, q_empty, zh * n_k + k0, zh * n_q,
                         zh * n_q_tiles * BLOCK_M, i_start, n_q_tiles, STAGES, BLOCK_M, BLOCK_N, HEAD_DIM)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


#: The kernel itself, for tools that compile it without launching it.
BACKWARD_KERNEL = _attention_backward_kernel


def dq_writer_default(d: int) -> bool:
    """Whether dQ goes through the writer warp at head dimension ``d``: at d 128 the consumers need the
    registers that adding dQ themselves takes (their atomics' addresses; with them they spill), and the
    writer's TMA reduce-add leaves them free to run dK's product meanwhile; at d 64 they have registers to
    spare and adding it themselves was faster with the atomic writer this one replaced. Only where this
    Triton can build the TMA reduction (:data:`TMA_REDUCE`)."""
    return d > 64 and TMA_REDUCE


def backward_launch(q, k, v, grad_out, lse2, delta, dq_accum, dk, dv, causal: bool, dq_writer: bool | None = None,
                    stages: int = 2):
    """Grid, arguments, constexprs, ``num_warps`` and ``maxnreg`` of the main backward kernel on contiguous
    (batch, heads, seq, d) tensors; ``lse2`` (base-2 logsumexp) and ``delta`` fp32 (batch, heads, n_queries
    rounded up to the query tile), ``dq_accum`` fp32 like q. Runs nothing."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    block_m, block_n = 64, 128
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]

    def descriptor(t, block):
        return TensorDescriptor.from_tensor(t.view(-1, d), block, gl.NVMMASharedLayout.get_default_for(block, element))

    def row_descriptor(t):
        return TensorDescriptor.from_tensor(t.view(-1), [block_m], gl.NVMMASharedLayout.get_default_for([block_m],
                                                                                                      gl.float32))

    writer = dq_writer_default(d) if dq_writer is None else bool(dq_writer)
    if writer and not TMA_REDUCE:
        raise ValueError(f"dq_writer=True needs Triton 3.6's TMA reduce-add, this is Triton {triton.__version__}")
    # the writer's tiles: half the head dimension of a query tile, in the layout the consumers store them in
    dq_block = [block_m, d // 2]
    dq_desc = TensorDescriptor.from_tensor(dq_accum.view(-1, d), dq_block,
                                           gl.NVMMASharedLayout.get_default_for(dq_block, gl.float32))
    descs = (descriptor(k, [block_n // 2, d]), descriptor(v, [block_n // 2, d]), descriptor(q, [block_m, d]),
             descriptor(grad_out, [block_m, d]), row_descriptor(lse2), row_descriptor(delta), dq_desc)
    args = (*descs, dq_accum, dk, dv, n_q, n_k, 1.4426950408889634 / math.sqrt(d), 1 / math.sqrt(d))
    constexprs = dict(HEAD_DIM=d, STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=bool(causal),
                      DQ_WRITER=writer)
    return (triton.cdiv(n_k, block_n), batch * heads), args, constexprs, 4, 168


def gluon_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, causal: bool,
                   dq_writer: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dQ, dK, dV) of FlashAttention on (batch, heads, seq, d) CUDA tensors (bf16 or fp16, d 64 or
    128) on Hopper, in q's dtype, contiguous. ``dq_writer``: add dQ through the writer warp (None:
    :func:`dq_writer_default`). ``lse``: the forward's natural-log logsumexp, (batch, heads, n_queries) fp32."""
    q, k, v, out, grad_out = (t.contiguous() for t in (q, k, v, out, grad_out))
    lse = lse.contiguous()
    delta, lse2 = row_statistics(out, grad_out, lse, tile=64)  # the main kernel's query tile
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid, args, constexprs, num_warps, maxnreg = backward_launch(q, k, v, grad_out, lse2, delta, dq_accum, dk, dv,
                                                                 causal, dq_writer)
    _attention_backward_kernel[grid](*args, **constexprs, num_warps=num_warps, maxnreg=maxnreg)
    return scale_cast(dq_accum, q, 1 / math.sqrt(q.shape[-1])), dk, dv
