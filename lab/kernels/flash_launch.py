"""What the forward and the backward kernels share: tile loads, the masking constant, the fast relaunch of
compiled kernels and the autotuning cache.

Tile loads: :func:`load_tile` reads rows ``[start, start + BLOCK)`` of one head's ``(seq, d)`` matrix as a
``(BLOCK, BLOCK_D)`` tile through masked pointer loads, zero outside the matrix. The mask on the head
dimension is what lets any d that is a multiple of 8 run on a power-of-two ``BLOCK_D`` without padded
copies; a column offset reads the second chunk of a split head dimension.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from lab.kernels.flash_config import INTERPRET
from lab.kernels.triton_env import unit_last_stride  # noqa: F401 - the kernels' wrappers import it from here

LOG2E = 1.4426950408889634


def base2_scale(d: int) -> float:
    """log2(e) / sqrt(d): turns q.k into the exponent of a base-2 softmax (exp2 is one instruction)."""
    return LOG2E / math.sqrt(d)


#: Added to masked scores (in the base-2 exponent): exp2 of it is exactly 0, and it never overflows.
MASK_VALUE = tl.constexpr(-1.0e6)


# ---------------------------------------------------------------------------------------------- tiles
@triton.jit
def load_tile(src, head_offset, start, n_rows, stride_s,
              BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, CHECK_ROWS: tl.constexpr,
              COL0: tl.constexpr = 0):
    """Rows ``[start, start + BLOCK)``, columns ``[COL0, COL0 + BLOCK_D)`` of one head as a (BLOCK, BLOCK_D)
    tile (``COL0`` > 0: the second column chunk of a split head dimension, see ``flash_config.head_chunks``).

    The head starts at ``src + head_offset`` with rows ``stride_s`` apart. Rows at or past ``n_rows`` are
    masked only when ``CHECK_ROWS`` (tiles known to be inside the sequence skip the comparison); columns past
    ``HEAD_DIM`` only when the tile reaches past it.
    """
    rows = start + tl.arange(0, BLOCK)
    cols = COL0 + tl.arange(0, BLOCK_D)
    ptrs = src + head_offset + rows[:, None] * stride_s + cols[None, :]
    if CHECK_ROWS:
        if COL0 + BLOCK_D > HEAD_DIM:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif COL0 + BLOCK_D > HEAD_DIM:
        return tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_tile(dst, head_offset, start, n_rows, stride_s, value,
               BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, COL0: tl.constexpr = 0):
    """Store a (BLOCK, BLOCK_D) tile to rows ``[start, start + BLOCK)``, columns ``[COL0, COL0 + BLOCK_D)``
    of one head, masked to the matrix."""
    rows = start + tl.arange(0, BLOCK)
    cols = COL0 + tl.arange(0, BLOCK_D)
    ptrs = dst + head_offset + rows[:, None] * stride_s + cols[None, :]
    if COL0 + BLOCK_D > HEAD_DIM:
        tl.store(ptrs, value.to(dst.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))
    else:
        tl.store(ptrs, value.to(dst.dtype.element_ty), mask=rows[:, None] < n_rows)


def as_bhsd(t: torch.Tensor) -> torch.Tensor:
    """(batch, seq, d) as a (batch, 1, seq, d) view; (batch, heads, seq, d) unchanged. The kernels index
    (batch, head) with two strides, so neither layout is ever copied."""
    return t if t.dim() == 4 else t.unsqueeze(1)


# ------------------------------------------------------------------------------------- fast relaunch
#: The Triton release (major, minor) whose compiled-kernel internals the direct relaunch of :func:`launch` calls
#: (``CompiledKernel.run``, ``launch_metadata``, ``function`` and ``packed_metadata``, the launch hooks of
#: ``triton.knobs.runtime``, the driver's stream getter): none of them is public API and their signatures
#: change between releases, so under any other version every launch takes the public ``kernel[grid](...)``.
RELAUNCH_TRITON = (3, 6)

_COMPILED: dict[tuple, object] = {}


@functools.cache
def relaunches_directly(version: str) -> bool:
    """Whether :func:`launch` may relaunch compiled kernels through Triton's internal launcher under Triton
    ``version`` (``triton.__version__``): only the release it was written for, :data:`RELAUNCH_TRITON`,
    any patch level."""
    try:
        return tuple(int(part) for part in version.split(".")[:2]) == RELAUNCH_TRITON
    except ValueError:  # a version string this check cannot read: not the release it knows
        return False


def _arg_signature(a):
    """What Triton specialises a launch argument on (pointers: dtype and 16-byte alignment; ints and floats:
    their value, a superset of Triton's own key)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return a


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, fast: bool = True) -> None:
    """``kernel[grid](*args, **constexprs)``, with the per-launch host cost cut down where it is safe.

    ``JITFunction.run`` binds and specialises every argument on every launch (tens of microseconds for
    these ~30-argument kernels, on the critical path when one head's attention takes a fraction of a
    millisecond). Under the Triton release :func:`relaunches_directly` knows, the first launch of an argument
    signature goes through it and keeps the compiled kernel; later launches with the same signature
    (:func:`_arg_signature` of every argument, the constexprs, the device) call the compiled kernel's
    launcher directly, the way ``JITFunction.run`` itself does. ``fast=False``, the interpreter and every
    other Triton version always go through the public ``kernel[grid](...)``.
    """
    if not fast or INTERPRET or not relaunches_directly(triton.__version__):
        kernel[grid](*args, **constexprs)
        return
    device_index = args[0].device.index
    signature = (id(kernel), device_index, tuple(constexprs.items()), tuple(_arg_signature(a) for a in args))
    compiled = _COMPILED.get(signature)
    if compiled is None:
        compiled = kernel[grid](*args, **constexprs)
        if hasattr(compiled, "packed_metadata") and hasattr(compiled, "function"):
            _COMPILED[signature] = compiled
        return
    values = dict(zip(kernel.arg_names, args))
    values.update(constexprs)
    params = [values[name] for name in kernel.arg_names]
    stream = driver.active.get_current_stream(device_index)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    metadata = compiled.launch_metadata(grid3, stream, *params)
    compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, metadata,
                 triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook, *params)


def inline_launch(kernel, grid: tuple, args: tuple, constexprs: dict, fast: bool = True) -> None:
    """``kernel[grid](*args, **constexprs)`` through ``torch.library.wrap_triton``: while AOTAutograd traces (the
    ops' functional decomposition, ``FlashConfig.compile_inline``) the launch becomes a graph node that Inductor
    compiles and launches itself; on real tensors outside tracing it is a plain launch. ``num_warps`` and
    ``num_stages`` among ``constexprs`` become the launch's config. Same signature as :func:`launch`
    (``fast`` is ignored)."""
    torch.library.wrap_triton(kernel)[grid](*args, **constexprs)


# -------------------------------------------------------------------------------------------- autotune
#: (kernel, tuning key) -> launch keywords of the config the autotuner chose; read on every later call so
#: that the hot path skips the autotuner's own dispatch.
TUNED_CONFIGS: dict[tuple, dict] = {}


def remember_tuning(key: tuple, tuner) -> dict:
    """Store the config ``tuner`` just chose for ``key``; return its launch keywords."""
    config = tuner.best_config.all_kwargs()
    TUNED_CONFIGS[key] = config
    return config

