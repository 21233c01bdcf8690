"""The ends of the Gluon backward (:mod:`lab.kernels.flash_gluon_backward`), two plain Triton kernels: the row
statistics its main kernel reads, and dQ's scale and cast from the fp32 accumulator its CTAs add into."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_statistics_kernel(O, DO, LSE, Delta, LSE2, n_q, n_padded, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (query blocks, batch * heads): ``Delta = rowsum(O * dO)`` in fp32 and the logsumexp in base 2
    (``LSE2 = LSE * log2(e)``, which the main kernel's exponent subtracts), written into rows of ``n_padded``
    per head (a multiple of the query tile, so that every tile's statistics start 16-byte aligned, as TMA
    requires); O, dO (rows, HEAD_DIM) and LSE contiguous."""
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    zh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    offsets = (zh * n_q + pos[:, None]) * HEAD_DIM + cols[None, :]
    keep = pos < n_q
    o = tl.load(O + offsets, mask=keep[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=keep[:, None], other=0.0).to(tl.float32)
    tl.store(Delta + zh * n_padded + pos, tl.sum(o * do, 1), mask=keep)
    lse = tl.load(LSE + zh * n_q + pos, mask=keep)
    tl.store(LSE2 + zh * n_padded + pos, lse * 1.4426950408889634, mask=keep)


@triton.jit
def _scale_cast_kernel(SRC, DST, n, scale, BLOCK: tl.constexpr):
    """``DST = (SRC * scale)`` cast to DST's dtype, elementwise over ``n`` elements."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(DST + offsets, (tl.load(SRC + offsets, mask=keep) * scale).to(DST.dtype.element_ty), mask=keep)


def row_statistics(out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                   tile: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(delta, lse2)`` of contiguous (batch, heads, n, d) ``out`` and ``grad_out`` and (batch, heads, n)
    ``lse``: fp32 (batch, heads, n rounded up to ``tile``), zeros past each head's last row (a masked P times a
    statistic must stay 0, never 0 * NaN)."""
    batch, heads, n_q, d = out.shape
    n_padded = triton.cdiv(n_q, tile) * tile
    delta, lse2 = (torch.zeros((batch, heads, n_padded), dtype=torch.float32, device=out.device) for _ in range(2))
    _row_statistics_kernel[(triton.cdiv(n_q, tile), batch * heads)](out, grad_out, lse, delta, lse2, n_q, n_padded,
                                                                     HEAD_DIM=d, BLOCK=tile)
    return delta, lse2


def scale_cast(accum: torch.Tensor, like: torch.Tensor, scale: float) -> torch.Tensor:
    """``accum * scale`` (fp32) as a new tensor of ``like``'s shape and dtype."""
    result = torch.empty_like(like)
    _scale_cast_kernel[(triton.cdiv(result.numel(), 1024), )](accum, result, result.numel(), scale, BLOCK=1024)
    return result
