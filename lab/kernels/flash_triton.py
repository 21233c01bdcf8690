"""FlashAttention-2 in Triton: the forward kernel, the autograd Functions and their input checks.

Two ``torch.autograd.Function`` classes share the Triton forward and differ only in the backward:

* :class:`FlashAttentionTriton` — backward in Triton (:mod:`lab.kernels.flash_triton_backward`: a ``D`` preprocess
  kernel, then a dK/dV pass over key tiles and a dQ pass over query tiles, no atomics);
* :class:`FlashAttentionTritonCompiledBackward` — backward = ``torch.compile`` of the untiled
  recomputation equations (:func:`lab.kernels.flash_pytorch.attention_backward_recompute`), eager if compiling
  fails.

:func:`flash_attention_bhsd` picks between them with ``backward="triton" | "compiled"``.

Both take ``apply(q, k, v, is_causal=False)`` on (batch, seq, d) tensors:

* any sequence lengths, ``n_queries != n_keys`` allowed; causal means query ``i`` attends keys ``j <= i``
  (indices from the start of both sequences, as in ``torch.nn.functional.scaled_dot_product_attention``);
* d in {16, 32, 64, 128}; dtypes fp32, fp16, bf16 (all three of q, k, v alike). fp32 matrix products use
  TF32 exactly when ``torch.backends.cuda.matmul.allow_tf32`` is on, else full fp32;
* tensors whose last dimension is not contiguous are copied with ``.contiguous()``; any batch/sequence
  strides are passed to the kernels as they are (no copy);
* the kernels run on a CUDA GPU, or on the CPU under ``TRITON_INTERPRET=1`` (slow; for tests).

Forward kernel: grid = (query tiles, batch); one loop over key tiles with fp32 accumulators and an online
softmax in base 2 (``log2(e)`` folded into the scale, one fused multiply-add per score). Causal: key tiles
entirely in the future are never visited, and the loop is split so that only tiles crossing the diagonal
(or the ragged last tile) pay for masking, which adds ``-1e6`` to masked scores. Within each batch entry
the heaviest causal query tiles are launched first so that the long rows do not start last.

Tile sizes: a small fixed config below ``AUTOTUNE_MIN_SEQ`` tokens and for fp32; for longer bf16/fp16
sequences ``triton.autotune`` over a short list, keyed on the lengths, d, causality, dtype and the
batch (x heads) rounded to a power of two (one head leaves SMs idle and wants smaller query tiles than
sixteen heads). The choice is cached per shape, so later calls skip the autotuner. ``AUTOTUNE = False``
uses the configs tuning chose on an H200 instead (no tuning compile time, for sweeps over many shapes).
Under ``TRITON_INTERPRET=1`` one small config (the interpreter would run every config).

Host cost: launches reuse the compiled kernel directly (``launch``; ``FAST_LAUNCH = False`` goes through
``JITFunction.run`` every time). Measurements and tuning history: ``notes/flash_tuning.md``.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl

from lab.kernels.flash_pytorch import attention_backward_recompute, check_attention_inputs, fold_heads

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)
#: Added to masked scores (in the base-2 exponent): exp2 of it is exactly 0, and it never overflows.
MASK_VALUE = tl.constexpr(-1.0e6)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Sequences at least this long (max of n_queries, n_keys) get large tiles (autotuned when AUTOTUNE).
AUTOTUNE_MIN_SEQ = 1024
#: True: tune tile sizes the first time a long bf16/fp16 shape is seen (compiling every candidate costs
#: about a minute per head dimension and dtype; later calls reuse the choice). False: use the configs
#: tuning chose on an H200 (no tuning compile time; meant for sweeps over many shapes).
AUTOTUNE = True


# ----------------------------------------------------------------------------------------------- checks
def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error for input the Triton kernels cannot run: shapes, dtypes, d, device."""
    check_attention_inputs(q, k, v)
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dimension d={d} is not supported by the Triton kernels; use one of "
                         f"{SUPPORTED_HEAD_DIMS} (or FlashAttentionPytorch)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {q.dtype} is not supported by the Triton kernels; use fp32, fp16 or bf16")
    if q.device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("q, k, v are CUDA tensors but this process sees no CUDA GPU")
    elif not INTERPRET:
        raise RuntimeError(f"the Triton kernels need CUDA tensors (got {q.device}); on a machine without a GPU "
                           "set TRITON_INTERPRET=1 before importing lab.kernels.flash_triton to run them interpreted")
    elif q.device.type != "cpu":
        raise RuntimeError(f"under TRITON_INTERPRET=1 the kernels run on CPU tensors, got {q.device}")


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dimension without a stride: copy only when it is not contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def base2_scale(d: int) -> float:
    """log2(e) / sqrt(d): turns q.k into the exponent of a base-2 softmax (exp2 is one instruction)."""
    return LOG2E / math.sqrt(d)


def dot_precision(dtype: torch.dtype) -> str:
    """Triton ``input_precision`` for ``tl.dot``: TF32 for fp32 only when PyTorch's matmuls allow it too."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


# ---------------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(acc, row_sum, row_max, q, k_base, v_base, stride_ks, stride_vs, lo, hi,
               offs_m, offs_n, offs_d, n_k, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
               PRECISION: tl.constexpr):
    """Stream key tiles [lo, hi) through the online softmax. MASKED tiles cross the diagonal or the end."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            inside = cols[:, None] < n_k
            k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=inside, other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=inside, other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        # Base-2 exponent s * log2(e) / sqrt(d) - max: one fused multiply-add per score.
        if MASKED:
            keep = cols[None, :] < n_k
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None])
            s = s * qk_scale + tl.where(keep, 0.0, MASK_VALUE)
            new_max = tl.maximum(row_max, tl.max(s, 1))
            p = tl.math.exp2(s - new_max[:, None])
        else:
            new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)  # 0 on the first tile, where row_max = -inf
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit(do_not_specialize=["tune_batch"])
def _flash_fwd_kernel(Q, K, V, O, L,
                      stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs, stride_ob, stride_os,
                      n_q, n_k, qk_scale, tune_batch,
                      HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (query tiles, batch). ``tune_batch`` is unused: it only keys the autotuner (see tune_batch())."""
    # Programs start in x-fastest order: within a batch entry the heaviest causal query tile (the last)
    # starts first, so the long programs never start last. Batch entries run one after the other, which
    # keeps the programs running together on one head's K/V (L2 hits); interleaving the heads instead
    # made the 16-head case slower (run 2 in notes/flash_tuning.md).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + pid_b * stride_qb + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=offs_m[:, None] < n_q, other=0.0)
    k_base = K + pid_b * stride_kb
    v_base = V + pid_b * stride_vb

    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Key tiles [0, full_end) need no mask at all; [full_end, end) cross the diagonal or the end of K.
    whole_tiles_end = (n_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        # keys < full_end are <= start_m, the smallest query of the tile; keys >= start_m + BLOCK_M are
        # in the future of every query in the tile and are skipped.
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, whole_tiles_end)
        end = tl.minimum(start_m + BLOCK_M, n_k)
    else:
        full_end = whole_tiles_end
        end = n_k
    acc, row_sum, row_max = _fwd_inner(acc, row_sum, row_max, q, k_base, v_base, stride_ks, stride_vs,
                                       0, full_end, offs_m, offs_n, offs_d, n_k, qk_scale,
                                       BLOCK_N, False, IS_CAUSAL, PRECISION)
    acc, row_sum, row_max = _fwd_inner(acc, row_sum, row_max, q, k_base, v_base, stride_ks, stride_vs,
                                       full_end, end, offs_m, offs_n, offs_d, n_k, qk_scale,
                                       BLOCK_N, True, IS_CAUSAL, PRECISION)

    rows = offs_m < n_q
    out = acc / row_sum[:, None]
    tl.store(O + pid_b * stride_ob + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=rows[:, None])
    # natural-log logsumexp of the scaled scores: (max + log2(sum)) is in base 2
    tl.store(L + pid_b * n_q + offs_m, (row_max + tl.math.log2(row_sum)) * _LN2, mask=rows)


def _fwd_configs():
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    shapes = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
        (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
        (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 2), (64, 128, 8, 3),
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


_TUNE_KEY = ["n_q", "n_k", "tune_batch", "HEAD_DIM", "IS_CAUSAL", "PRECISION"]
_flash_fwd_tuned = triton.autotune(configs=_fwd_configs(), key=_TUNE_KEY)(_flash_fwd_kernel)

#: (kernel, tuning key) -> launch keywords of the config the autotuner chose; read on every later call so
#: that the hot path skips the autotuner's own dispatch.
TUNED_CONFIGS: dict[tuple, dict] = {}
#: (kernel, tuning key) -> {config: median ms} measured by the autotuner, for the tuning notes.
TUNING_TIMINGS: dict[tuple, dict] = {}


def tune_batch(batch: int) -> int:
    """The batch (x heads) the autotuner keys on: rounded up to a power of two, so that a model's few
    batch sizes share tunings while one head (a thin grid) and many heads (a full GPU) are tuned apart."""
    return min(1 << (batch - 1).bit_length(), 1024)


def remember_tuning(key: tuple, tuner) -> dict:
    """Store the config ``tuner`` just chose for ``key`` (and its timings); return its launch keywords."""
    config = tuner.best_config.all_kwargs()
    TUNED_CONFIGS[key] = config
    timings = getattr(tuner, "configs_timings", None) or {}
    TUNING_TIMINGS[key] = {str(c): t[0] if isinstance(t, list | tuple) else t for c, t in timings.items()}
    return config


try:  # the stream getter JITFunction.run uses (through Triton's driver), without the driver indirection
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # a torch build without CUDA: no GPU launches happen anyway
    def _current_raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream

#: Relaunch compiled kernels directly (see :func:`launch`). False: always go through ``JITFunction.run``.
FAST_LAUNCH = True
_COMPILED: dict[tuple, object] = {}


def launch(kernel, grid: tuple, args: tuple, constexprs: dict) -> None:
    """``kernel[grid](*args, **constexprs)``, with the per-launch host cost cut down.

    ``JITFunction.run`` binds and specialises every argument on every launch (tens of microseconds for
    these ~30-argument kernels, on the critical path when one head's attention takes ~0.1 ms). The first
    launch of an argument signature goes through it and keeps the compiled kernel; later launches with the
    same signature (same dtypes, integer values, float values, 16-byte alignment of every pointer, device)
    call the compiled kernel's launcher directly, the way ``JITFunction.run`` itself does.
    """
    if not FAST_LAUNCH or INTERPRET:
        kernel[grid](*args, **constexprs)
        return
    signature = (id(kernel), args[0].device.index, tuple(constexprs.items()),
                 tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args))
    compiled = _COMPILED.get(signature)
    if compiled is None:
        compiled = kernel[grid](*args, **constexprs)
        if hasattr(compiled, "packed_metadata") and hasattr(compiled, "function"):
            _COMPILED[signature] = compiled
        return
    values = dict(zip(kernel.arg_names, args))
    values.update(constexprs)
    params = [values[name] for name in kernel.arg_names]
    stream = _current_raw_stream(args[0].device.index)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    metadata = compiled.launch_metadata(grid3, stream, *params)
    compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, metadata,
                 triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook, *params)


def _fwd_fixed_config(d: int) -> dict:
    """The config for short sequences (and the interpreter): small tiles, no tuning."""
    if INTERPRET:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if d <= 64 else 32, "num_warps": 4, "num_stages": 2}


def forward_launch_args(q, k, v, out, lse, is_causal: bool) -> tuple[tuple, dict]:
    """Positional arguments and constexpr keywords of the forward kernel (shared with tools that precompile)."""
    d = q.shape[-1]
    args = (q, k, v, out, lse, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), q.shape[1], k.shape[1], base2_scale(d), tune_batch(q.shape[0]))
    meta = {"HEAD_DIM": d, "IS_CAUSAL": bool(is_causal), "PRECISION": dot_precision(q.dtype)}
    return args, meta


def long_sequence(n_q: int, n_k: int, dtype: torch.dtype) -> bool:
    """Shapes worth large tiles: bf16/fp16 on a GPU with at least AUTOTUNE_MIN_SEQ tokens. fp32 (full
    precision dot products, twice the shared memory per tile) always uses the small fixed configs."""
    return not INTERPRET and dtype != torch.float32 and max(n_q, n_k) >= AUTOTUNE_MIN_SEQ


def uses_autotune(n_q: int, n_k: int, dtype: torch.dtype) -> bool:
    """Long bf16/fp16 sequences are autotuned when :data:`AUTOTUNE` is on; the rest use fixed configs."""
    return AUTOTUNE and long_sequence(n_q, n_k, dtype)


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fills_gpu(programs: int, device: torch.device) -> bool:
    """True when a grid of ``programs`` gives every SM at least two programs."""
    return programs >= 2 * multiprocessor_count(device.index if device.index is not None else 0)


def _fwd_untuned_config(batch: int, n_q: int, n_k: int, d: int, device: torch.device, dtype) -> dict:
    """Config without autotuning: the choices tuning made on an H200 (notes/flash_tuning.md, run 3) for
    long sequences, the small fixed config otherwise."""
    if not long_sequence(n_q, n_k, dtype):
        return _fwd_fixed_config(d)
    if not fills_gpu(batch * triton.cdiv(n_q, 128), device):  # thin grid (one head): more, smaller tiles
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    if d <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def interpreter_needs_fp32(dtype: torch.dtype) -> bool:
    """True for bf16 under ``TRITON_INTERPRET=1``: Triton 3.6's interpreter gets ``tl.dot`` of bf16 tiles wrong
    (a single 16x16 product is off by ~1e10; fp16 and fp32 are right), so there the bf16 kernels run on fp32
    copies of their inputs and cast the results back. Compiled on a GPU, bf16 runs natively."""
    return INTERPRET and dtype == torch.bfloat16


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """Run the Triton forward. Returns (output in q's dtype, logsumexp fp32 of shape (batch, n_queries))."""
    check_triton_inputs(q, k, v)
    if interpreter_needs_fp32(q.dtype):
        out, lse = flash_forward(q.float(), k.float(), v.float(), is_causal)
        return out.to(q.dtype), lse
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    batch, n_q, d = q.shape
    n_k = k.shape[1]
    out = torch.empty(batch, n_q, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_q, dtype=torch.float32, device=q.device)
    args, meta = forward_launch_args(q, k, v, out, lse, is_causal)
    if uses_autotune(n_q, n_k, q.dtype):
        key = ("fwd", n_q, n_k, tune_batch(batch), d, bool(is_causal), meta["PRECISION"], q.dtype)
        config = TUNED_CONFIGS.get(key)
        if config is None:
            _flash_fwd_tuned[lambda m: (triton.cdiv(n_q, m["BLOCK_M"]), batch)](*args, **meta)
            remember_tuning(key, _flash_fwd_tuned)
            return out, lse
    else:
        config = _fwd_untuned_config(batch, n_q, n_k, d, q.device, q.dtype)
    launch(_flash_fwd_kernel, (triton.cdiv(n_q, config["BLOCK_M"]), batch), args, {**meta, **config})
    return out, lse


# ------------------------------------------------------------------------------------ autograd wrappers
def _save_forward(ctx, q, k, v, out, lse, is_causal):
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal = bool(is_causal)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2: Triton forward, Triton backward (dK/dV pass over key tiles, dQ pass over query tiles).

    ``FlashAttentionTriton.apply(q, k, v, is_causal=False)`` on (batch, seq, d) tensors returns the
    attention output (batch, n_queries, d) in the input dtype. Saved for backward: q, k, v, the output and
    the fp32 logsumexp of shape (batch, n_queries).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        out, lse = flash_forward(q, k, v, is_causal)
        _save_forward(ctx, q, k, v, out, lse, is_causal)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from lab.kernels.flash_triton_backward import flash_backward

        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = flash_backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return grad_q, grad_k, grad_v, None


_compiled_backward = None
_compile_failed = False


def compiled_backward(q, k, v, out, lse, grad_out, is_causal):
    """:func:`attention_backward_recompute` through ``torch.compile``; eager (with one warning) if compiling
    is not possible here. Returns (dQ, dK, dV)."""
    global _compiled_backward, _compile_failed
    if not _compile_failed:
        try:
            if _compiled_backward is None:
                _compiled_backward = torch.compile(attention_backward_recompute)
            return _compiled_backward(q, k, v, out, lse, grad_out, is_causal)
        except Exception as exc:  # a missing compiler, an unsupported backend, ...
            from lab.measure.device import is_oom

            if is_oom(exc):
                raise
            _compile_failed = True
            warnings.warn(f"torch.compile of the attention backward failed ({type(exc).__name__}: {exc}); "
                          "using the eager backward instead", RuntimeWarning, stacklevel=2)
    return attention_backward_recompute(q, k, v, out, lse, grad_out, is_causal)


class FlashAttentionTritonCompiledBackward(FlashAttentionTriton):
    """FlashAttention-2 with the Triton forward and the backward as compiled PyTorch (recomputation
    equations through ``torch.compile``, eager when compiling is unavailable). Same interface as
    :class:`FlashAttentionTriton`, whose forward it shares."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = compiled_backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return grad_q, grad_k, grad_v, None


BACKWARDS = {"triton": FlashAttentionTriton, "compiled": FlashAttentionTritonCompiledBackward}


def flash_attention_bhsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         backward: str = "triton") -> torch.Tensor:
    """Triton FlashAttention-2 on (batch, heads, seq, d) tensors (heads folded into the batch), for
    ``lab.model.transformer``'s attention registry. ``backward`` is ``"triton"`` or ``"compiled"``.
    Returns (batch, heads, n_queries, d)."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {sorted(BACKWARDS)}, got {backward!r}")
    folded = fold_heads(q, k, v)
    b, h, n_q, d = q.shape
    return BACKWARDS[backward].apply(*folded, causal).reshape(b, h, n_q, d)
