"""FlashAttention forward for Hopper (``sm_90a``) in Triton's Gluon layer, on FlashAttention-3's schedule.

The Triton-language kernel (:mod:`lab.kernels.flash_triton_forward`) leaves the schedule to the compiler, which
waits for each tile's score product before its softmax. Gluon states the schedule itself:

* **Warp specialization.** One producer warp only issues tensor-memory-accelerator (TMA) copies: each consumer's
  Q tile once, then every key and value tile into a ring of ``STAGES`` shared-memory slots per operand, each slot
  with a *ready* mbarrier (the copy landed) and an *empty* one (every consumer is done with it). The producer
  runs on the fewest registers a warp can have, so that the consumers get the rest.
* **Consumer warp groups.** ``NUM_WG`` warp groups of 4 warps each own ``BLOCK_M`` rows of the CTA's query tile
  and share its key/value tiles. Their matrix products are asynchronous warp-group MMAs (``wgmma``) with explicit
  waits.
* **Intra-warp-group overlap.** Each step issues the next score product ``S_j = Q K_j^T`` and the previous
  tile's ``O += P_{j-1} V_{j-1}`` together, then waits only for ``S_j`` (one product may stay in flight) and runs
  the softmax of tile ``j`` while ``P_{j-1} V_{j-1}`` is still on the tensor cores.
* **Ping-pong.** With ``PINGPONG`` the warp groups take turns to issue their products (an mbarrier per warp
  group passes the turn on), so that one group's softmax runs while the other's products do, instead of both
  groups asking for the tensor cores, then both for the exponential unit, at once.
* **Online softmax in base 2**, fp32 row maximum and sum: ``log2(e) / sqrt(d)`` is folded into one scale (one
  fused multiply-add and one ``exp2`` a score); masked scores are ``-inf``, which never meets ``-inf`` in a row
  maximum because every row sees key 0 in its first tile.
* **Causal** (top-left, query ``i`` sees keys ``j <= i``): key tiles entirely in the future are never loaded,
  and only tiles that cross the diagonal or the end of K pay for the mask. Query tiles start heaviest first.

Q, K and V are read through 2-D descriptors over ``(batch * heads * seq, d)``: a tile that runs past a head's
last row reads the next head's rows (or zeros past the tensor), which the key mask and the row mask of the
stores keep out of the result. Saved for the backward: O and the natural-log logsumexp of every query row.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_LN2 = gl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634

#: Registers a thread of the producer warp and of a worker consumer warp group asks for (``setmaxnreg``); the
#: default partition (consumer warp group 0) gets what the kernel's ``maxnreg`` leaves over.
PRODUCER_REGISTERS = gl.constexpr(24)
CONSUMER_REGISTERS = gl.constexpr(240)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
              q_row, kv_row, n_tiles,
              NUM_WG: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The producer warp: every consumer's Q tile, then key tile ``j`` and value tile ``j`` in turn, each into
    the ring slot ``j % STAGES`` once all consumers have released it."""
    for w in gl.static_range(NUM_WG):
        mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * BLOCK_M, 0], q_ready.index(w), q_smem.index(w))
    for j in range(n_tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        # A fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _take_turn(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Wait until it is warp group ``WG``'s ``k``-th turn to issue products (group 0 goes first)."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(0), (k & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(WG), k & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % NUM_WG))


@gluon.jit
def _softmax(s, m_i, l_i, rows, cols, n_k, qk_scale, MASK: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Online-softmax update of one score tile: returns (P unnormalised, new row max, new row sum, the factor
    ``exp2(old max - new max)`` that rescales the output accumulator). Maxima are in scaled base-2 units."""
    if MASK:
        keep = gl.expand_dims(cols, 0) < n_k
        if IS_CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _step(j, acc, p_op, m_i, l_i, q_s, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turn, rows, col_base,
          n_k, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
          WG: gl.constexpr, NUM_WG: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, MASK: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """Key tile ``j`` (``j >= 1``): issue ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}``, then the softmax of
    ``S_j`` while the second product runs."""
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    _take_turn(turn, j, WG, PINGPONG)
    s_tok = warpgroup_mma(q_s, k_smem.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    _pass_turn(turn, WG, NUM_WG, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(slot))
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, col_base + j * BLOCK_N, n_k, qk_scale, MASK, IS_CAUSAL)
    p_next = gl.convert_layout(p.to(q_s.dtype), p_layout)
    acc, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op))
    mbarrier.arrive(v_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, p_next, m_i, l_i


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr,
              lse_ptr, o_base, lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale,
              HEAD_DIM: gl.constexpr, NUM_WG: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """Consumer warp group ``WG``: rows ``[m0 + WG * BLOCK_M, m0 + (WG + 1) * BLOCK_M)`` of the query tile
    against every key tile the CTA visits; writes their output rows and logsumexp."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    first_row = m0 + WG * BLOCK_M
    rows = first_row + gl.arange(0, BLOCK_M, layout=row_layout)
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    q_s = q_smem.index(WG)
    mbarrier.wait(q_ready.index(WG), 0)

    # Tile 0: its score product alone (nothing to overlap yet); it may cross the diagonal or the end of K.
    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turn, 0, WG, PINGPONG)
    s_tok = warpgroup_mma(q_s, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    _pass_turn(turn, WG, NUM_WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, rows, cols, n_k, qk_scale, True, IS_CAUSAL)
    p_op = gl.convert_layout(p.to(q_s.dtype), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_full):
        acc, p_op, m_i, l_i = _step(j, acc, p_op, m_i, l_i, q_s, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                    turn, rows, cols, n_k, qk_scale, s_layout, o_layout, p_layout, WG, NUM_WG, STAGES,
                                    BLOCK_M, BLOCK_N, False, IS_CAUSAL, PINGPONG)
    for j in range(gl.maximum(n_full, 1), n_tiles):
        acc, p_op, m_i, l_i = _step(j, acc, p_op, m_i, l_i, q_s, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                    turn, rows, cols, n_k, qk_scale, s_layout, o_layout, p_layout, WG, NUM_WG, STAGES,
                                    BLOCK_M, BLOCK_N, True, IS_CAUSAL, PINGPONG)

    # The last tile's P V, then the epilogue.
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    _take_turn(turn, n_tiles, WG, PINGPONG)
    o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    _pass_turn(turn, WG, NUM_WG, PINGPONG)
    acc, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op))
    mbarrier.arrive(v_empty.index(last))

    acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
    lse = (m_i + gl.log2(l_i)) * _LN2
    gl.store(lse_ptr + lse_base + rows, lse, mask=rows < n_q)
    # Coalesced 16-byte stores: each thread writes 8 consecutive elements of a row.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    out = gl.convert_layout(acc.to(o_ptr.dtype.element_ty), store_layout)
    o_rows = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, store_layout))
    offsets = o_base + gl.expand_dims(o_rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(o_cols, 0)
    gl.store(o_ptr + offsets, out, mask=gl.expand_dims(o_rows < n_q, 1))


@gluon.jit
def _consumer_worker(q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr,
                     o_base, lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale,
                     HEAD_DIM: gl.constexpr, NUM_WG: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """Consumer warp group 1 (a worker partition)."""
    _consumer(1, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr, o_base,
              lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale, HEAD_DIM, NUM_WG, STAGES, BLOCK_M,
              BLOCK_N, IS_CAUSAL, PINGPONG)


@gluon.jit
def _consumer_default(q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr,
                      o_base, lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale,
                      HEAD_DIM: gl.constexpr, NUM_WG: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """Consumer warp group 0 (the default partition: the kernel's own ``num_warps = 4`` warps)."""
    _consumer(0, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr, lse_ptr, o_base,
              lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale, HEAD_DIM, NUM_WG, STAGES, BLOCK_M,
              BLOCK_N, IS_CAUSAL, PINGPONG)


@gluon.jit
def _attention_forward_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, stride_oz, stride_oh, stride_os, n_heads,
                              batch_heads, heads_per_group, n_q, n_k, qk_scale,
                              HEAD_DIM: gl.constexpr, NUM_WG: gl.constexpr, STAGES: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr,
                              PINGPONG: gl.constexpr):
    """One CTA per query tile of ``NUM_WG * BLOCK_M`` rows of one (batch, head). The heads run in groups of
    ``heads_per_group``, whose K/V fit in L2 together, one group after the other; within a group the
    heaviest causal query tiles of all its heads start first, so that the short tiles fill the end of the
    group instead of one long tile running alone."""
    gl.static_assert(NUM_WG == 2, "one default and one worker consumer warp group")
    n_m = gl.cdiv(n_q, NUM_WG * BLOCK_M)
    pid = gl.program_id(0)
    group = pid // (heads_per_group * n_m)
    first_head = group * heads_per_group
    group_heads = gl.minimum(heads_per_group, batch_heads - first_head)
    index = pid - group * heads_per_group * n_m
    pid_m = n_m - 1 - index // group_heads
    zh = first_head + index % group_heads
    m0 = pid_m * (NUM_WG * BLOCK_M)
    if IS_CAUSAL:
        kv_end = gl.minimum(m0 + NUM_WG * BLOCK_M, n_k)
        n_full = gl.minimum((m0 + 1) // BLOCK_N, n_k // BLOCK_N)  # tiles no row of the CTA needs masked
    else:
        kv_end = n_k
        n_full = n_k // BLOCK_N
    n_tiles = gl.cdiv(kv_end, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_empty.index(i), count=NUM_WG)

    z = zh // n_heads
    h = zh % n_heads
    o_base = z.to(gl.int64) * stride_oz + h.to(gl.int64) * stride_oh
    lse_base = zh.to(gl.int64) * n_q
    # The argument tuples are written out in the call: a tuple assigned to a name first would turn its
    # constexpr members into tensors.
    gl.warp_specialize([
        (_consumer_default, (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr,
                             lse_ptr, o_base, lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale, HEAD_DIM,
                             NUM_WG, STAGES, BLOCK_M, BLOCK_N, IS_CAUSAL, PINGPONG)),
        (_consumer_worker, (q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, turn, o_ptr,
                            lse_ptr, o_base, lse_base, stride_os, m0, n_q, n_k, n_full, n_tiles, qk_scale, HEAD_DIM,
                            NUM_WG, STAGES, BLOCK_M, BLOCK_N, IS_CAUSAL, PINGPONG)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
                     zh * n_q + m0, zh * n_k, n_tiles, NUM_WG, STAGES, BLOCK_M, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


#: The kernel itself, for tools that compile it without launching it.
FORWARD_KERNEL = _attention_forward_kernel


def forward_tiles(d: int, causal: bool) -> dict:
    """Launch constants at head dimension ``d``: two consumer warp groups of 64 query rows each (the rows of one
    ``wgmma`` warp group), 128-key tiles, and as many ring stages as shared memory holds beside the Q tiles and
    the epilogue's staging."""
    return dict(NUM_WG=2, BLOCK_M=64, BLOCK_N=128, STAGES=2 if d > 64 else 4, PINGPONG=True)


def heads_sharing_l2(n_k: int, d: int, element_bytes: int, device: torch.device) -> int:
    """How many heads' K and V fit in half the GPU's L2 cache together (at least one): the CTAs that run at
    the same time then read each K/V tile from device memory once."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 * 2 ** 20
    return max(1, (l2_bytes // 2) // (2 * n_k * d * element_bytes))


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def forward_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, tiles: dict | None = None,
                   out: torch.Tensor | None = None):
    """Outputs and launch arguments of the forward on contiguous (batch, heads, seq, d) tensors: returns
    ``(out, lse, grid, args, constexprs, num_warps, maxnreg)``; runs nothing (the tensors may live on the
    CPU, for compiling). ``out``: where the output goes (None: a new contiguous tensor)."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    tiles = {**forward_tiles(d, causal), **(tiles or {})}
    m, n = tiles["BLOCK_M"], tiles["BLOCK_N"]
    element = _gl_dtype(q.dtype)
    q_layout = gl.NVMMASharedLayout.get_default_for([m, d], element)
    kv_layout = gl.NVMMASharedLayout.get_default_for([n, d], element)
    q_desc = TensorDescriptor.from_tensor(q.view(-1, d), [m, d], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(-1, d), [n, d], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(-1, d), [n, d], kv_layout)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    heads_per_group = tiles.pop("heads_per_group", None) or heads_sharing_l2(n_k, d, q.element_size(), q.device)
    grid = (triton.cdiv(n_q, tiles["NUM_WG"] * m) * batch * heads, )
    args = (q_desc, k_desc, v_desc, out, lse, out.stride(0), out.stride(1), out.stride(2), heads, batch * heads,
            min(heads_per_group, batch * heads), n_q, n_k, _LOG2E / math.sqrt(d))
    constexprs = dict(HEAD_DIM=d, IS_CAUSAL=bool(causal), **tiles)
    # Every thread's register cap at entry, so the warp groups can trade registers (setmaxnreg): the kernel has
    # 4 default warps, 4 consumer warps and one producer warp group.
    warps = 4 * (tiles["NUM_WG"] + 1)
    maxnreg = (65536 // (32 * warps)) // 8 * 8
    return out, lse, grid, args, constexprs, 4, maxnreg


def _tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as TMA reads it: contiguous (each head's rows one 2-D block) from a 16-byte aligned address (a
    view that starts mid-row may not be)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  tiles: dict | None = None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention forward on (batch, heads, seq, d) CUDA tensors (bf16 or fp16, d 64 or 128) on Hopper.
    Returns (output in q's dtype and shape; natural-log logsumexp fp32 of shape (batch, heads, n_queries),
    contiguous). The output is written into ``out`` when given (q's shape and dtype, any strides with a unit
    last one: the caller's layout), else into a new contiguous tensor. Inputs that are not contiguous are
    copied first (TMA reads each head's rows as one 2-D block)."""
    q, k, v = (_tma_operand(t) for t in (q, k, v))
    out, lse, grid, args, constexprs, num_warps, maxnreg = forward_launch(q, k, v, causal, tiles, out)
    _attention_forward_kernel[grid](*args, **constexprs, num_warps=num_warps, maxnreg=maxnreg)
    return out, lse
