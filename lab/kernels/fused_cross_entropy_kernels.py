"""Triton kernels of the fused LM head + cross-entropy (the op lives in :mod:`lab.kernels.fused_cross_entropy`).

Notation: hidden ``H`` (N, D), weight ``W`` (V, D), logits ``Z = H W^T`` (N, V), ``lse`` the per-token
logsumexp of ``Z``, ``g`` the loss's gradient per token (``1/count`` for the mean over ``count`` non-ignored
targets, 1 for the sum, 0 at ignored targets).

**Gradients in the forward** (the default): the matmuls are cuBLAS's (``torch.mm`` in the op); one kernel
works on a chunk of stored logits, row by row:

* :func:`_lce_rows_kernel`: one program per token reads its row of logits (fp32 arithmetic on the stored
  values), keeps an online max and sum of exponentials, and writes ``lse`` and the target's logit;
  with ``WRITE_GRAD`` it then overwrites the row with ``dZ = (softmax - onehot(target)) * g`` in the logits'
  dtype. A row that fits in registers (``ONE_BLOCK``: ``next_power_of_2(V) <=``
  :data:`ROW_IN_REGISTERS_MAX`) is read once; a longer one twice (the max/sum pass, then the dZ pass).
  DRAM traffic per token: ``(2 or 3) x V x element size`` bytes.

**Recompute backward** (``reduction="none"``, the skip threshold, or ``grad_in_forward=False``): three
GEMM-shaped kernels (a grid of output tiles in grouped order, an fp32 accumulator, a loop over the reduction
dimension in ``BLOCK_K`` steps):

* :func:`_lse_kernel`: one (token tile x vocab tile) block of ``Z`` per program (loop over D), reduced in
  its epilogue to a partial logsumexp per token and tile; the target logit is picked out by the one tile
  that holds it. The partials (N x vocab tiles) are combined on the host side with ``torch.logsumexp``.
* :func:`_dlogits_kernel`: the same recomputed tile of ``Z``, with the epilogue
  ``dZ = softmax * grad_lse + onehot(target) * grad_target``, stored in the input dtype into a scratch
  buffer of one *vocabulary chunk* (N x chunk). With a skip threshold it also writes one flag per tile:
  0 when every softmax entry of the tile is below the threshold and no target lies in it.
* :func:`_matmul_kernel`: ``C = A @ B`` (optionally ``+ C_in``, optionally skipping the K blocks whose
  flag is 0), for the two gradient GEMMs ``dH += dZ_chunk @ W_chunk`` and ``dW_chunk = dZ_chunk^T @ H``.

Grouped program order (``GROUP_M`` token tiles sweep the vocabulary together) keeps the working set of the
programs that run at the same time (GROUP_M hidden tiles + ~#SMs/GROUP_M weight tiles, a few MB each at
D = 4096) inside L2. Loads index rows modulo the row count (as in Triton's matmul tutorial) so that only
the reduction dimension needs masks; out-of-range rows and columns are masked in the epilogues.

Tile configs: :data:`CONFIGS` (Hopper: logits kernels 128x128x64 with 8 warps and 3 stages, 96 KiB of shared
memory and 128 registers, two programs per SM; GEMMs 128x256x64, 144 KiB); under ``TRITON_INTERPRET=1``
one small config. :func:`compile_report` compiles every variant for sm_90a without a GPU and reports
registers and spills.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lab.kernels.sm90_compile import compile_sm90
from lab.kernels.triton_env import INTERPRET, interpreter_needs_fp32, tf32_allowed  # noqa: F401

#: Tile configs of compiled runs: (kernel, "16bit" | "fp32") -> launch keywords. The matmul config used with
#: a skip threshold must tile inside the dlogits tiles (:func:`launch_matmul` checks).
CONFIGS: dict[tuple[str, str], dict] = {
    ("lse", "16bit"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    ("dlogits", "16bit"): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    ("matmul", "16bit"): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    ("lse", "fp32"): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    ("dlogits", "fp32"): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
    ("matmul", "fp32"): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}
_INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)

#: Launch settings of :func:`_lce_rows_kernel` (``rows_config``). Rows of up to ``ROW_IN_REGISTERS_MAX``
#: logits (rounded up to a power of two) are held in registers by ``ROW_IN_REGISTERS_WARPS`` warps and read
#: once (16,384 fp32 values over 32 warps: 32 registers a thread, no spills on sm_90a; 32,768 spill, as a
#: 1024-thread block gets at most 64 registers a thread). Longer rows are streamed in ``ROW_BLOCK``-wide
#: blocks by ``ROW_BLOCK_WARPS`` warps and read twice (the second read partly from L2); 16 values of each
#: block in flight per thread hide DRAM latency. Timed on an H100 (blocks of 2048 to 32768, 4 to 32 warps,
#: per-row or per-lane running statistics), long rows ran near a plain copy's bandwidth with every setting
#: and fastest with these; rows of 10,000 about as fast in registers as streamed. Under the interpreter the
#: sizes are small, so that tests reach both paths (a block of 64: a vocabulary of 100 streams two blocks, one
#: ragged, and the quick book's 512 takes 8 interpreted blocks a row rather than 32).
ROW_IN_REGISTERS_MAX = 64 if INTERPRET else 16384
ROW_IN_REGISTERS_WARPS = 32
ROW_BLOCK = 64 if INTERPRET else 16384
ROW_BLOCK_WARPS = 32


def config(kernel: str, dtype: torch.dtype, interpret: bool | None = None) -> dict:
    """Launch keywords (tile sizes, GROUP_M, num_warps, num_stages) of ``kernel`` for inputs of ``dtype``;
    ``interpret`` (default: whether this process interprets Triton) picks the interpreter's small config."""
    if INTERPRET if interpret is None else interpret:
        return dict(_INTERPRET_CONFIG)
    return dict(CONFIGS[(kernel, "fp32" if dtype == torch.float32 else "16bit")])


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of ``tl.dot``: TF32 for fp32 only when PyTorch's matmuls allow it too
    (:func:`lab.kernels.triton_env.tf32_allowed`), else exact fp32 ("ieee")."""
    if dtype == torch.float32 and not tf32_allowed():
        return "ieee"
    return "tf32"


# ------------------------------------------------------------------------------------------------ helpers
@triton.jit
def _grouped_pid(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_M row tiles at a time sweeping all column tiles: the
    programs resident together share GROUP_M row operands and few column operands (L2 reuse)."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _logits_tile(H, W, rows, cols, n_rows, n_cols, D, stride_h, stride_w,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 tile ``H[rows] @ W[cols]^T``, looping over D. Rows/columns past the end are read modulo the count
    (valid memory, garbage values the caller masks), so only the D tail needs a mask."""
    safe_rows = (rows % n_rows).to(tl.int64)
    safe_cols = (cols % n_cols).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = H + safe_rows[:, None] * stride_h + offs_k[None, :]
    w_ptrs = W + safe_cols[:, None] * stride_w + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            inside = offs_k[None, :] < D - k
            h = tl.load(h_ptrs, mask=inside, other=0.0)
            w = tl.load(w_ptrs, mask=inside, other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


# ------------------------------------------------------------------------------------------------ forward
# Token counts are not specialised on divisibility by 16 (one compiled kernel serves every batch size) where
# that costs nothing; the vocabulary, the chunk width and the matmul's M and N are: without it the modulo row
# indexing loses its contiguity (no vectorised loads along a unit-stride M, so no pipelining) and the lse
# kernel needs 187 instead of 128 registers (:func:`compile_report` shows both).
@triton.jit(do_not_specialize=["n_rows", "num_pid_m", "num_pid_n"])
def _lse_kernel(H, W, T, P, TGT, n_rows, V, D, stride_h, stride_w, stride_p, num_pid_m, num_pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Partial logsumexp of one logits tile per token -> ``P[row, tile]``; the target logit -> ``TGT[row]``
    (only the tile holding the target writes it)."""
    pid_m, pid_n = _grouped_pid(num_pid_m, num_pid_n, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _logits_tile(H, W, rows, cols, n_rows, V, D, stride_h, stride_w,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    row_ok = rows < n_rows
    col_ok = cols < V
    z = tl.where(col_ok[None, :], acc, float("-inf"))
    z_max = tl.max(z, axis=1)
    sum_exp = tl.sum(tl.exp(z - z_max[:, None]), axis=1)
    tl.store(P + rows.to(tl.int64) * stride_p + pid_n, z_max + tl.log(sum_exp), mask=row_ok)
    t = tl.load(T + rows, mask=row_ok, other=-1)
    hit = cols[None, :] == t[:, None]
    target_logit = tl.sum(tl.where(hit, acc, 0.0), axis=1)
    here = row_ok & (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N) & (t < V)
    tl.store(TGT + rows, target_logit, mask=here)


# ------------------------------------------------------------------------------------ gradients in forward
@triton.jit
def _rounded(x, DTYPE: tl.constexpr, BITWISE_RTNE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (to nearest even, as compiled casts do). Triton's interpreter truncates
    fp32 -> bf16 casts instead; ``BITWISE_RTNE`` rounds by integer arithmetic first, so that the CPU tests
    see the GPU's rounding."""
    if BITWISE_RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit(do_not_specialize=["ignore_index"])
def _lce_rows_kernel(Z, T, SCALE, LSE, TGT, V, stride_z, ignore_index, BLOCK: tl.constexpr,
                     ONE_BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr, BITWISE_RTNE: tl.constexpr):
    """Row ``i`` of the stored logits ``Z``: ``LSE[i]``, ``TGT[i] = Z[i, T[i]]`` (0 when ``T[i]`` is outside
    [0, V)) and, with ``WRITE_GRAD``, ``Z[i] <- (exp(Z[i] - lse) - onehot(T[i])) * g`` in place, where
    ``g = SCALE[0]`` (0 at ``T[i] == ignore_index``).

    ``ONE_BLOCK``: the row in registers, read once. Otherwise streamed in ``BLOCK``-wide blocks with a
    running max and sum per row (two block-wide reductions a block, few registers: room for wide blocks).
    Every value is read before any is overwritten: the target's logit is loaded (and stored) before the
    first block-wide reduction, which every thread passes before the dZ pass writes."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    cols = tl.arange(0, BLOCK)
    t = tl.load(T + row)
    target_logit = tl.load(z_row + t, mask=(t >= 0) & (t < V), other=0.0).to(tl.float32)
    tl.store(TGT + row, target_logit)
    if ONE_BLOCK:
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        m = tl.max(z, axis=0)
        e = tl.exp(z - m)
        s = tl.sum(e, axis=0)
        lse = m + tl.log(s)
    else:
        m = -1e30  # not -inf: exp(m - m_new) must be defined in the first block
        s = 0.0
        for start in range(0, V, BLOCK):
            z = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
    tl.store(LSE + row, lse)
    if WRITE_GRAD:
        g = tl.where(t != ignore_index, tl.load(SCALE), 0.0)
        if ONE_BLOCK:
            dz = (e * (1.0 / s) - (cols == t).to(tl.float32)) * g
            tl.store(z_row + cols, _rounded(dz, Z.dtype.element_ty, BITWISE_RTNE), mask=ok)
        else:
            for start in range(0, V, BLOCK):
                ok = start + cols < V
                z = tl.load(z_row + start + cols, mask=ok, other=0.0).to(tl.float32)
                dz = (tl.exp(z - lse) - (start + cols == t).to(tl.float32)) * g
                tl.store(z_row + start + cols, _rounded(dz, Z.dtype.element_ty, BITWISE_RTNE), mask=ok)


# ----------------------------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=["n_rows", "v0", "num_pid_m", "num_pid_n"])
def _dlogits_kernel(H, W, T, LSE, GL, GT, S, FLAGS, n_rows, width, v0, D, stride_h, stride_w, stride_s, stride_f,
                    threshold, num_pid_m, num_pid_n,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_FLAGS: tl.constexpr):
    """dZ for vocabulary columns ``[v0, v0 + width)`` (``W`` points at row v0): recompute the logits tile,
    ``dZ = exp(Z - lse) * GL[row] + (col == target) * GT[row]`` -> ``S[row, col - v0]`` (S's dtype).

    ``USE_FLAGS``: ``FLAGS[tile_m, tile_n] = 1`` if some softmax entry of a row with ``GL != 0`` reaches
    ``threshold`` or the tile holds a target with ``GT != 0``, else 0, and the tile is then not stored (the
    GEMMs skip it)."""
    pid_m, pid_n = _grouped_pid(num_pid_m, num_pid_n, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _logits_tile(H, W, rows, local, n_rows, width, D, stride_h, stride_w,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    row_ok = rows < n_rows
    inside = row_ok[:, None] & (local < width)[None, :]
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    g_lse = tl.load(GL + rows, mask=row_ok, other=0.0)
    g_tgt = tl.load(GT + rows, mask=row_ok, other=0.0)
    t = tl.load(T + rows, mask=row_ok, other=-1)
    p = tl.exp(acc - lse[:, None])
    onehot = (local[None, :] + v0) == t[:, None]
    dz = p * g_lse[:, None] + tl.where(onehot, g_tgt[:, None], 0.0)
    s_ptrs = S + rows.to(tl.int64)[:, None] * stride_s + local[None, :]
    if USE_FLAGS:
        large = inside & (g_lse[:, None] != 0.0) & (p >= threshold)
        target = inside & onehot & (g_tgt[:, None] != 0.0)
        live = tl.max(tl.max((large | target).to(tl.int32), axis=1), axis=0)
        tl.store(FLAGS + pid_m * stride_f + pid_n, live)
        if live != 0:
            tl.store(s_ptrs, dz.to(S.dtype.element_ty), mask=inside)
    else:
        tl.store(s_ptrs, dz.to(S.dtype.element_ty), mask=inside)


@triton.jit
def _tile_offsets(stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    return tl.arange(0, BLOCK_M)[:, None] * stride + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _matmul_step(acc, a_ptrs, b_ptrs, rk, k, K, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """acc + one K block of A @ B (the K tail masked unless EVEN_K)."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=rk[None, :] < K - k, other=0.0)
        b = tl.load(b_ptrs, mask=rk[:, None] < K - k, other=0.0)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["K", "num_pid_m", "num_pid_n"])
def _matmul_kernel(A, B, C_IN, C, FLAGS, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                   stride_fm, stride_fk, num_pid_m, num_pid_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, PRECISION: tl.constexpr, HAS_C_IN: tl.constexpr,
                   USE_FLAGS: tl.constexpr, FLAG_M: tl.constexpr, FLAG_K: tl.constexpr):
    """``C = A @ B (+ C_IN)`` with an fp32 accumulator, stored in C's dtype; C and C_IN share strides (unit
    column stride). ``USE_FLAGS``: the K block ``k`` of output row tile ``m`` is skipped when
    ``FLAGS[m * BLOCK_M // FLAG_M, k // FLAG_K] == 0`` (needs FLAG_M % BLOCK_M == FLAG_K % BLOCK_K == 0).
    Without flags the loop has no branch, so Triton pipelines its loads as in a plain GEMM."""
    pid_m, pid_n = _grouped_pid(num_pid_m, num_pid_n, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + (rm % M).to(tl.int64)[:, None] * stride_am + rk[None, :].to(tl.int64) * stride_ak
    b_ptrs = B + rk[:, None].to(tl.int64) * stride_bk + (rn % N).to(tl.int64)[None, :] * stride_bn
    # C tile: one int64 base offset and int32 offsets within the tile (cheap to keep or recompute)
    c_base = (pid_m * BLOCK_M).to(tl.int64) * stride_cm + pid_n * BLOCK_N
    if HAS_C_IN:  # start from C_IN (beta = 1): adding it after the loop would need a second tile of registers
        acc = tl.load(C_IN + c_base + _tile_offsets(stride_cm, BLOCK_M, BLOCK_N),
                      mask=(rm < M)[:, None] & (rn < N)[None, :], other=0.0)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    flag_ptr = FLAGS + ((pid_m * BLOCK_M) // FLAG_M) * stride_fm
    for k in range(0, K, BLOCK_K):
        if USE_FLAGS:
            if tl.load(flag_ptr + (k // FLAG_K) * stride_fk) != 0:
                acc = _matmul_step(acc, a_ptrs, b_ptrs, rk, k, K, EVEN_K, PRECISION)
        else:
            acc = _matmul_step(acc, a_ptrs, b_ptrs, rk, k, K, EVEN_K, PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(C + c_base + _tile_offsets(stride_cm, BLOCK_M, BLOCK_N), acc.to(C.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


# ------------------------------------------------------------------------------------------ host launchers
def _split(cfg: dict) -> tuple[dict, dict]:
    """Launch keywords -> (constexpr tile sizes, num_warps/num_stages)."""
    meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
    return meta, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}


def launch_lse(hidden, weight, targets, partial, target_logit, cfg: dict) -> None:
    """Run :func:`_lse_kernel` over all (token tile, vocab tile) blocks. ``partial`` (N, cdiv(V, BLOCK_N))
    fp32 receives the per-tile logsumexps, ``target_logit`` (N,) fp32 the target logits."""
    n, d = hidden.shape
    v = weight.shape[0]
    meta, launch = _split(cfg)
    grid_m, grid_n = triton.cdiv(n, meta["BLOCK_M"]), triton.cdiv(v, meta["BLOCK_N"])
    _lse_kernel[(grid_m * grid_n,)](
        hidden, weight, targets, partial, target_logit, n, v, d, hidden.stride(0), weight.stride(0),
        partial.stride(0), grid_m, grid_n, EVEN_K=d % meta["BLOCK_K"] == 0, PRECISION=dot_precision(hidden.dtype),
        **meta, **launch)


def rows_config(vocab: int) -> dict:
    """Launch keywords of :func:`_lce_rows_kernel` for rows of ``vocab`` logits: ``BLOCK``, ``ONE_BLOCK``,
    ``num_warps`` (see :data:`ROW_IN_REGISTERS_MAX`)."""
    whole = triton.next_power_of_2(max(vocab, 1))
    if whole <= ROW_IN_REGISTERS_MAX:
        return dict(BLOCK=whole, ONE_BLOCK=True, num_warps=max(1, min(ROW_IN_REGISTERS_WARPS, whole // 32)))
    return dict(BLOCK=ROW_BLOCK, ONE_BLOCK=False, num_warps=ROW_BLOCK_WARPS)


def launch_rows(logits, targets, scale, lse, target_logit, ignore_index: int, write_grad: bool) -> None:
    """Run :func:`_lce_rows_kernel` over the rows of ``logits`` (rows, V; unit column stride): ``lse`` and
    ``target_logit`` (rows,) fp32 receive the per-row values; with ``write_grad`` the logits are overwritten
    by ``dZ`` scaled by ``scale`` (a one-element fp32 tensor, read on the device: no host sync)."""
    rows, v = logits.shape
    if rows == 0:
        return
    _lce_rows_kernel[(rows,)](logits, targets, scale, lse, target_logit, v, logits.stride(0), ignore_index,
                              WRITE_GRAD=write_grad, BITWISE_RTNE=INTERPRET and logits.dtype == torch.bfloat16,
                              **rows_config(v))


def launch_dlogits(hidden, weight_chunk, targets, lse, grad_lse, grad_target, scratch, v0: int, cfg: dict,
                   flags=None, threshold: float = 0.0) -> None:
    """Run :func:`_dlogits_kernel` for the vocabulary columns ``[v0, v0 + weight_chunk.shape[0])``."""
    n, d = hidden.shape
    width = weight_chunk.shape[0]
    meta, launch = _split(cfg)
    grid_m, grid_n = triton.cdiv(n, meta["BLOCK_M"]), triton.cdiv(width, meta["BLOCK_N"])
    use_flags = flags is not None
    _dlogits_kernel[(grid_m * grid_n,)](
        hidden, weight_chunk, targets, lse, grad_lse, grad_target, scratch, flags if use_flags else lse,
        n, width, v0, d, hidden.stride(0), weight_chunk.stride(0), scratch.stride(0),
        flags.stride(0) if use_flags else 0, float(threshold), grid_m, grid_n,
        EVEN_K=d % meta["BLOCK_K"] == 0, PRECISION=dot_precision(hidden.dtype), USE_FLAGS=use_flags,
        **meta, **launch)


def launch_matmul(a, b, out, cfg: dict, c_in=None, flags=None, flag_block: tuple[int, int] = (1, 1),
                  flag_strides: tuple[int, int] = (0, 0)) -> None:
    """``out = a @ b (+ c_in)`` through :func:`_matmul_kernel`; ``a`` and ``b`` may be transposed views (any
    strides), ``out``/``c_in`` need a unit column stride. ``flags``: the dlogits tile flags, read with the
    given (row, K) block sizes and strides (see :func:`_matmul_kernel`)."""
    m, k = a.shape
    n = b.shape[1]
    meta, launch = _split(cfg)
    if flags is not None and (flag_block[0] % meta["BLOCK_M"] or flag_block[1] % meta["BLOCK_K"]):
        raise ValueError(f"matmul tiles {meta['BLOCK_M']}x{meta['BLOCK_K']} do not divide the flag blocks "
                         f"{flag_block}; pick a matmul config that tiles inside the dlogits tiles")
    grid_m, grid_n = triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])
    _matmul_kernel[(grid_m * grid_n,)](
        a, b, c_in if c_in is not None else out, out, flags if flags is not None else out, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), flag_strides[0], flag_strides[1],
        grid_m, grid_n, EVEN_K=k % meta["BLOCK_K"] == 0, PRECISION=dot_precision(a.dtype),
        HAS_C_IN=c_in is not None, USE_FLAGS=flags is not None, FLAG_M=flag_block[0], FLAG_K=flag_block[1],
        **meta, **launch)


# ------------------------------------------------------------------------------------ inspection (no GPU)
def config_name(cfg: dict) -> str:
    """``"128x128x64 g8 w8 s3"``: tile sizes, GROUP_M, warps, stages of a launch config."""
    return "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} g{GROUP_M} w{num_warps} s{num_stages}".format(**cfg)


def compile_report(arch: int = 90) -> list[dict]:
    """Compile every kernel variant for ``sm_<arch>a`` on any machine (no GPU: Triton's bundled ptxas), with
    the default configs of bf16 and fp32 (the rows kernel at the goal vocabulary, 151,936, and at 10,000).
    Arguments are specialised as the JIT would at the goal shape (pointers 16-byte aligned, sizes and strides
    divisible by 16 except the ``do_not_specialize`` ones, unit strides constant). Returns one row per
    compile: kernel, config, registers, spill_bytes, shared_kib, wgmma (or error). Run this process without
    ``TRITON_INTERPRET`` (interpreted kernels cannot be compiled)."""

    # arguments the JIT does not mark divisible by 16: floats, flag strides, do_not_specialize sizes
    no_hint = {"threshold", "stride_fm", "stride_fk", "stride_f"}

    def build(fn, types: dict, consts: dict, cfg: dict, ones=()):
        meta = _split(cfg)[0] if "BLOCK_M" in cfg else {}
        consts = {**consts, **meta, **{o: 1 for o in ones}}  # the JIT turns int arguments equal to 1 into constants
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        # the JIT marks 16-byte aligned pointers and ints divisible by 16 (all of them at the goal shape)
        divisible = [i for i, n in enumerate(fn.arg_names)
                     if sig[n] != "constexpr" and n not in no_hint and n not in fn.do_not_specialize]
        out = compile_sm90(fn, sig, consts, divisible, cfg["num_warps"], cfg.get("num_stages", 3), arch)
        return dict(registers=out["registers"], spill_bytes=out["spill_bytes"],
                    shared_kib=out["shared_bytes"] / 1024, wgmma=out["wgmma"])

    variants = []
    for dtype in ("bf16", "fp32"):
        p, cls = "*" + dtype, "fp32" if dtype == "fp32" else "16bit"
        lse_t = {"H": p, "W": p, "T": "*i64", "P": "*fp32", "TGT": "*fp32"}
        dl_t = {**lse_t, "LSE": "*fp32", "GL": "*fp32", "GT": "*fp32", "S": p, "FLAGS": "*i32", "threshold": "fp32"}
        mm_t = {"A": p, "B": p, "C_IN": "*fp32", "C": p, "FLAGS": "*i32"}
        rows_t = {"Z": p, "T": "*i64", "SCALE": "*fp32", "LSE": "*fp32", "TGT": "*fp32"}
        base = {"EVEN_K": True, "PRECISION": "tf32"}
        dl = CONFIGS[("dlogits", cls)]
        off, on = {"USE_FLAGS": False, "FLAG_M": 1, "FLAG_K": 1}, {"FLAG_M": dl["BLOCK_M"], "FLAG_K": dl["BLOCK_N"]}
        # (name, kernel, pointer types, constexprs, config, int arguments equal to 1 in the real launches)
        variants += [(f"lse {dtype}", _lse_kernel, lse_t, base, CONFIGS[("lse", cls)], ())]
        variants += [(f"{name} {dtype}", _dlogits_kernel, dl_t, {**base, "USE_FLAGS": flags}, dl, ())
                     for name, flags in (("dlogits", False), ("dlogits+flags", True))]
        cfg = CONFIGS[("matmul", cls)]
        variants += [(f"matmul dW {dtype}", _matmul_kernel, mm_t, {**base, **off, "HAS_C_IN": False}, cfg,
                      ("stride_am", "stride_bn")),
                     (f"matmul dH+= {dtype}", _matmul_kernel, {**mm_t, "C": "*fp32"},
                      {**base, **off, "HAS_C_IN": True}, cfg, ("stride_ak", "stride_bn")),
                     (f"matmul dH+= flags {dtype}", _matmul_kernel, {**mm_t, "C": "*fp32"},
                      {**base, **on, "USE_FLAGS": True, "HAS_C_IN": True}, cfg,
                      ("stride_ak", "stride_bn", "stride_fk"))]
        for vocab in (151_936, 10_000):
            rc = rows_config(vocab)
            consts = {"BLOCK": rc["BLOCK"], "ONE_BLOCK": rc["ONE_BLOCK"], "WRITE_GRAD": True, "BITWISE_RTNE": False}
            variants.append((f"rows V={vocab} {dtype}", _lce_rows_kernel, rows_t, consts,
                             dict(num_warps=rc["num_warps"], num_stages=3), ()))
    rows = []
    for name, fn, types, consts, cfg, ones in variants:
        row = dict(kernel=name, config=config_name(cfg) if "BLOCK_M" in cfg else
                   "BLOCK {BLOCK} w{num_warps}".format(BLOCK=consts.get("BLOCK"), **cfg))
        try:
            row.update(build(fn, types, consts, cfg, ones))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
            row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        rows.append(row)
    return rows
