"""Configuration of the Triton FlashAttention kernels, as data: :class:`FlashConfig`, input checks, and the
tile tables that turn (shape, dtype, config) into launch parameters.

Nothing here launches a kernel, so all of it is plain Python that the tests can exercise on the CPU.

* :class:`FlashConfig` is a frozen dataclass passed explicitly (``FlashAttentionTriton.apply(q, k, v,
  causal, config)``, ``flash_attention_bhsd(..., config=...)``). It replaces the module globals
  ``AUTOTUNE``, ``FAST_LAUNCH`` and ``BACKWARD_LAUNCH`` that notebooks used to flip from outside: a global
  is invisible to ``torch.compile`` (a compiled graph would keep whatever it saw when it was traced) and
  leaks between callers. The ``torch.library`` ops receive its fields as plain schema arguments
  (:meth:`FlashConfig.op_args`).
* Head dimensions: any multiple of 8 from 8 to 256. The kernels work on a power-of-two ``BLOCK_D >= d``
  (:func:`block_d`) and mask the columns ``d..BLOCK_D`` on every load and store, so inputs are never
  copied into padded buffers. A head dimension that is not a power of two can instead be cut into two
  power-of-two column chunks (80 = 64 + 16, 96 = 64 + 32, 40 = 32 + 16 with 8 masked columns;
  :func:`head_chunks`): every matrix product over d becomes a sum of two products and every product
  into d two products, so no tensor-core work is spent on a 128-wide tile of which 48 columns are zeros.
* fp32: ``tl.dot`` on fp32 tiles runs on tensor cores as TF32 when PyTorch allows TF32 for its own
  matmuls, else as 3xTF32 (``"tf32x3"``: three TF32 products that recover about fp32 accuracy, the same
  arithmetic PyTorch's fp32 SDPA kernel uses), see :func:`dot_precision`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from lab.kernels.flash_pytorch import check_attention_inputs
from lab.kernels.triton_env import INTERPRET, SUPPORTED_DTYPES, interpreter_needs_fp32, tf32_allowed  # noqa: F401

MAX_HEAD_DIM = 256
#: Sequences at least this long (max of n_queries, n_keys) get the large tiles of the tables below.
LONG_SEQ = 1024
#: The longest causal sequence whose d = 128 forward was timed faster on 64 x 64 tiles than on 128 x 128
#: (longer ones keep the large tiles, which the H100 sweep chose at 16k and 32k tokens).
NARROW_CAUSAL_MAX_SEQ = 8192

BACKWARD_LAUNCHES = ("auto", "fused", "two_pass")
#: The backward kernel's passes each launch mode runs (0: dK/dV and dQ programs in one grid, 1: dK/dV, 2: dQ).
LAUNCHED_PASSES = {"fused": (0,), "two_pass": (1, 2)}
FP32_PRECISIONS = ("auto", "ieee", "tf32", "tf32x3")
SPLIT_MODES = ("auto", "on", "off")
#: Which forward kernel runs (:func:`lab.kernels.flash_dispatch.which_forward`).
FORWARD_KERNELS = ("auto", "gluon", "triton")
#: Which backward kernel runs (:func:`lab.kernels.flash_dispatch.which_backward`).
BACKWARD_KERNELS = ("auto", "gluon", "triton")


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """How the Triton FlashAttention kernels are launched. The defaults are the tables' choices.

    * ``autotune``: time a short list of tile configs the first time a long bf16/fp16 shape is seen
      (compiling them costs about a minute per head dimension; the choice is cached per shape), and the fused
      against the two-pass backward. False: the tables of :func:`forward_tiles` / :func:`backward_plan`, which
      were measured on Hopper GPUs; autotuning is how another GPU gets tiles of its own.
    * ``fast_launch``: relaunch an already compiled kernel through its launcher directly, skipping
      ``JITFunction.run``'s argument binding (see ``flash_launch.launch``, which does so only under the Triton
      version it was written for). False: every launch through Triton's public ``kernel[grid](...)``.
    * ``fp32_precision``: ``"auto"`` (TF32 when PyTorch allows it, else 3xTF32), ``"ieee"``, ``"tf32"``
      or ``"tf32x3"``; fp32 inputs only.
    * ``fwd_tiles``: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` overriding the forward's table (sweeps),
      ``()`` for the table.
    * ``backward_launch``: ``"fused"`` (dK/dV and dQ programs in one grid), ``"two_pass"`` (a dK/dV kernel,
      then a dQ kernel), or ``"auto"`` (the table's choice; timed once per shape when autotuning). Both give
      the same bits on every run (no atomics; ``flash_triton_backward`` says which five-product launches
      were tried and why they lost).
    * ``bwd_tiles``: ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)`` overriding the
      backward's table, ``()`` for the table.
    * ``compile_inline``: under ``torch.compile`` on a GPU, hand Inductor the Triton kernels themselves: the
      ``lab::flash_attention_*`` ops are ``torch.library.triton_op`` operators, which AOTAutograd's
      functionalization decomposes into their kernel launches (``torch.library.wrap_triton``), so the compiled
      code launches the kernels through Inductor's own launcher and the op's host function (config, checks,
      tile tables, launch arguments, the custom-op dispatch around it) runs once, at compile time, instead of
      on every call. Autotuning configs decompose into an opaque op instead (the tuner times candidates on
      real data), and so does the interpreter (:func:`inlines`); off, the opaque op always. On by default: a
      short sequence's opaque op costs more host time than its kernels take on the device, so the device
      waited for the host; inlined, the compiled 2.7B step kept up with the same step on SDPA's kernels
      (:func:`lab.bench.flash_variants.host_costs` measures both). Bit-identical to the opaque op
      (``tests/kernels/test_flash_compile.py -k inlined``, on a GPU).
    * ``split_d``: ``"on"``: a head dimension that is not a power of two runs as two power-of-two column
      chunks where that covers fewer columns than one padded tile (:func:`head_chunks`); ``"off"``: one
      power-of-two tile with masked columns; ``"auto"``: the table's choice per head dimension, dtype,
      pass and sequence length (:func:`splits_head_dim`; never under the interpreter, whose tests choose
      ``"on"`` to check the split kernels).
    * ``forward_kernel``: ``"gluon"``, the Hopper forward written in Gluon (:mod:`lab.kernels.flash_gluon_forward`,
      FlashAttention-3's schedule; an error where it cannot run), ``"triton"``, the portable Triton-language
      forward, or ``"auto"``: Gluon wherever it can run (an sm_90 GPU, bf16/fp16, d 64 or 128) on contiguous
      inputs unless ``fwd_tiles`` fixes the portable kernel's tiles, the portable kernel elsewhere (the Gluon
      kernel would first copy strided inputs, such as the model's head-strided views, which costs more than
      its schedule saves). Both save the same output and natural-log logsumexp, so either backward takes
      either forward's results.
    * ``backward_kernel``: the same choice for the backward: ``"gluon"``, the Hopper backward written in Gluon
      (:mod:`lab.kernels.flash_gluon_backward`, FlashAttention-3's schedule: five products a tile pair, dQ summed
      over key tiles in fp32 in an order that varies from run to run, so its dQ is not bitwise reproducible; an
      error where it cannot run), ``"triton"``, the portable backward, or ``"auto"``: Gluon where it can run on
      contiguous q, k, v unless ``backward_launch`` or ``bwd_tiles`` fix the portable backward's launch, the
      portable kernel elsewhere. The deterministic option is PyTorch's own: under
      ``torch.use_deterministic_algorithms(True)`` ``"auto"`` runs the portable backward (the same bits on every
      run) and ``"gluon"`` is an error (a warning with ``warn_only=True``). The other fields configure the
      portable kernels only.

    Variants that never won were removed, what they measured kept in ``results/``: the forward's overlapped
    key loop (``flash_triton_forward``), the five-product backward launches with atomic or ordered dQ, ``D``
    computed inside the backward kernels, TMA descriptor loads and Triton's warp specialization
    (``flash_triton_backward``).
    """

    autotune: bool = False
    fast_launch: bool = True
    fp32_precision: str = "auto"
    fwd_tiles: tuple[int, ...] = ()
    backward_launch: str = "auto"
    bwd_tiles: tuple[int, ...] = ()
    compile_inline: bool = True
    split_d: str = "auto"
    forward_kernel: str = "auto"
    backward_kernel: str = "auto"

    def __post_init__(self):
        if self.backward_launch not in BACKWARD_LAUNCHES:
            raise ValueError(f"backward_launch must be one of {BACKWARD_LAUNCHES}, got {self.backward_launch!r}")
        if self.fp32_precision not in FP32_PRECISIONS:
            raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}, got {self.fp32_precision!r}")
        if self.split_d not in SPLIT_MODES:
            raise ValueError(f"split_d must be one of {SPLIT_MODES}, got {self.split_d!r}")
        if self.forward_kernel not in FORWARD_KERNELS:
            raise ValueError(f"forward_kernel must be one of {FORWARD_KERNELS}, got {self.forward_kernel!r}")
        if self.forward_kernel == "gluon" and self.fwd_tiles:
            raise ValueError("fwd_tiles are the portable forward's tiles: they cannot go with forward_kernel='gluon'")
        if self.backward_kernel not in BACKWARD_KERNELS:
            raise ValueError(f"backward_kernel must be one of {BACKWARD_KERNELS}, got {self.backward_kernel!r}")
        if self.backward_kernel == "gluon" and (self.bwd_tiles or self.backward_launch != "auto"):
            raise ValueError("bwd_tiles and backward_launch configure the portable backward: they cannot go with "
                             "backward_kernel='gluon'")
        # lists arrive from the torch.library schema (int[]): store tuples so the config stays hashable
        object.__setattr__(self, "fwd_tiles", tuple(int(x) for x in self.fwd_tiles))
        object.__setattr__(self, "bwd_tiles", tuple(int(x) for x in self.bwd_tiles))
        for name, size in (("fwd_tiles", 4), ("bwd_tiles", 6)):
            tiles = getattr(self, name)
            if tiles and (len(tiles) != size or any(t < 1 for t in tiles)):
                raise ValueError(f"{name} must be () or {size} positive ints, got {tiles}")
            blocks = tiles[:2] if size == 4 else tiles[:4]
            if tiles and any(b < 16 or b & (b - 1) for b in blocks):
                raise ValueError(f"{name}: tile sizes must be powers of two >= 16, got {blocks}")

    def op_args(self) -> tuple:
        """The fields in declaration order: the trailing arguments of the ``lab::flash_attention_*`` ops.
        Spelled out rather than ``dataclasses.fields``, which dynamo would have to trace."""
        return (self.autotune, self.fast_launch, self.fp32_precision, self.fwd_tiles, self.backward_launch,
                self.bwd_tiles, self.compile_inline, self.split_d, self.forward_kernel, self.backward_kernel)

    def replace(self, **changes) -> FlashConfig:
        return dataclasses.replace(self, **changes)


DEFAULT_CONFIG = FlashConfig()


def inlines(config: FlashConfig, device: torch.device) -> bool:
    """Whether a traced (``torch.compile``) call decomposes into its kernel launches (``config.compile_inline``):
    compiled kernels on a CUDA device (not the interpreter, whose kernels run on the host's data) and no
    autotuning (the tuner times candidates on real data)."""
    return config.compile_inline and not INTERPRET and device.type == "cuda" and not config.autotune


# ----------------------------------------------------------------------------------------------- checks
def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear one-line error for input the Triton kernels cannot run: shapes, dtypes, d, device.

    Accepts (batch, seq, d) or (batch, heads, seq, d) tensors (all three alike)."""
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        if not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
            raise ValueError(f"batch and heads differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if q.shape[0] * q.shape[1] == 0:
            raise ValueError("attention needs at least one batch entry and one head")
        q, k, v = (t[0] for t in (q, k, v))  # (heads, seq, d) views: the remaining checks are those of 3-D input
    check_attention_inputs(q, k, v)
    d = q.shape[-1]
    if d % 8 or not 8 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dimension d={d} is not supported by the Triton kernels: d must be a multiple of 8 "
                         f"from 8 to {MAX_HEAD_DIM} (or use FlashAttentionPytorch)")
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


def block_d(d: int) -> int:
    """The power-of-two tile width covering head dimension ``d`` (at least 16, the smallest ``tl.dot``)."""
    return max(16, 1 << (d - 1).bit_length())


def split_widths(d: int) -> tuple[int, int]:
    """(first, second) column-chunk widths of head dimension ``d`` cut exactly into two power-of-two tiles: the
    largest power of two below d, then the rest, itself a power of two of at least 16 (the smallest ``tl.dot``):
    48 = 32 + 16, 80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32. ``(block_d(d), 0)``, one padded tile with its
    columns past d masked, for every other d (a power of two, 40, 112): a second chunk wider than its columns
    would need masked loads and stores of its own, and that path addressed memory out of bounds on an H100
    (d = 40 as 32 + 16), so no split pads."""
    first = 1 << (d.bit_length() - 1)
    rest = d - first
    if first == d or first < 16 or rest < 16 or rest & (rest - 1):
        return block_d(d), 0
    return first, rest


#: Head dimensions whose split kernels were timed against the padded ones (bf16, H100): the model's 80 and 96.
SPLIT_MEASURED = (80, 96)


def splits_head_dim(d: int, dtype: torch.dtype, direction: str, n_q: int, n_k: int,
                    interpreted: bool | None = None) -> bool:
    """The table behind ``split_d="auto"``: whether the ``direction`` (``"fwd"`` or ``"bwd"``) kernels of
    head dimension ``d`` run on split column chunks for ``n_q`` queries and ``n_k`` keys.

    Only where measured faster: 16-bit inputs at the head dimensions of :data:`SPLIT_MEASURED`; the forward
    at every length (64 + 16 columns beat a masked 128-wide tile on the same 64 x 64 tiles, long and short),
    the backward on long sequences (on 64 x 64 tiles, two launches; on short sequences the split backward
    was not faster). fp32 and other head dimensions keep the padded tile (not timed).
    Interpreted (``interpreted``; None: this process's Triton): never (the tests choose ``split_d``
    explicitly)."""
    interpreted = INTERPRET if interpreted is None else interpreted
    if interpreted or dtype == torch.float32 or d not in SPLIT_MEASURED or split_widths(d)[1] == 0:
        return False
    return direction == "fwd" or long_sequence(n_q, n_k, interpreted)


def head_chunks(d: int, dtype: torch.dtype, direction: str, n_q: int, n_k: int,
                config: FlashConfig = DEFAULT_CONFIG, interpreted: bool | None = None) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_D1)`` of the ``direction`` (``"fwd"``/``"bwd"``) kernels for ``n_q`` queries and
    ``n_k`` keys: the widths of the first and the second column chunk of the head dimension (``BLOCK_D1`` 0:
    one chunk, :func:`block_d` wide, the columns past ``d`` masked). Follows ``config.split_d``
    (:func:`split_widths`, :func:`splits_head_dim`; ``interpreted``: as there)."""
    split = config.split_d == "on" or (config.split_d == "auto"
                                       and splits_head_dim(d, dtype, direction, n_q, n_k, interpreted))
    return split_widths(d) if split else (block_d(d), 0)


# -------------------------------------------------------------------------------------------- precision
def dot_precision(dtype: torch.dtype, setting: str = "auto") -> str:
    """Triton ``input_precision`` for ``tl.dot``. bf16/fp16 ignore it. fp32: ``setting``, where ``"auto"``
    is TF32 when PyTorch allows it and 3xTF32 otherwise (not ``"ieee"``: fp32 products on the CUDA cores
    run at a fraction of tensor-core speed, and PyTorch's own fp32 SDPA kernel also uses 3xTF32)."""
    if dtype != torch.float32:
        return "tf32"
    if setting == "auto":
        return "tf32" if tf32_allowed() else "tf32x3"
    return setting


# ------------------------------------------------------------------------------------------------ tiles
@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """Number of SMs of CUDA device ``device_index`` (cached: the tile tables ask on every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fills_gpu(programs: int, device: torch.device) -> bool:
    """True when a grid of ``programs`` gives every SM at least two programs."""
    return programs >= 2 * multiprocessor_count(device.index if device.index is not None else 0)


def tune_batch(batch_heads: int) -> int:
    """The batch x heads the autotuner keys on: rounded up to a power of two, so that a model's few batch
    sizes share tunings while one head (a thin grid) and many heads (a full GPU) are tuned apart."""
    return min(1 << (batch_heads - 1).bit_length(), 1024)


def long_sequence(n_q: int, n_k: int, interpreted: bool | None = None) -> bool:
    """Shapes worth large tiles: compiled (not ``interpreted``; None: this process's Triton) with at least
    LONG_SEQ tokens."""
    return not (INTERPRET if interpreted is None else interpreted) and max(n_q, n_k) >= LONG_SEQ


def autotunes(config: FlashConfig, dtype: torch.dtype, n_q: int, n_k: int, tiles: tuple) -> bool:
    """Whether a launch times its tile candidates: ``config.autotune``, a 16-bit long sequence, and no tiles
    fixed by the caller (``tiles``: the config's ``fwd_tiles`` or ``bwd_tiles``)."""
    return config.autotune and dtype != torch.float32 and long_sequence(n_q, n_k) and not tiles


def _tiles(m, n, warps, stages) -> dict:
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}


def forward_tiles(batch_heads: int, n_q: int, n_k: int, d: int, dtype: torch.dtype, device: torch.device,
                  config: FlashConfig = DEFAULT_CONFIG, causal: bool = True) -> dict:
    """Launch parameters of the forward kernel (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``).

    bf16/fp16 at d <= 128: the fastest tiles of a sweep (``python -m lab.bench.flash_sweep sweep``) on an H100,
    revised by a sweep on an H200 where it found a faster tile. Long sequences: 128-query tiles where the heads
    fill the GPU, 64-query tiles for thin grids. At d = 128, causal, up to :data:`NARROW_CAUSAL_MAX_SEQ` tokens,
    64 x 64 tiles on 4 warps beat 128 x 128 on 8 (H200: 10% at 2k tokens, 5% at 8k; tied without the mask):
    the tiles crossing the diagonal, which pay for the mask and do half-wasted work, are a quarter the size,
    and they are a larger share of a short sequence's tiles. Padded head dimensions (80, 96: ``BLOCK_D`` 128
    with masked columns) ran fastest on 64 x 64 tiles, whose smaller register footprint pays for the wasted
    columns, and so did their split kernels (64 + 16, 64 + 32 columns, :func:`head_chunks`) when causal;
    without the mask the split kernels ran 10% faster on 128 x 64 tiles with 8 warps (H200, 4k tokens),
    which causal attention's diagonal tiles make 30% slower. Short sequences (< LONG_SEQ): 64 x 64 tiles, 4 warps,
    timed as CUDA-graph replays (the device's time; eagerly, launching dominates). d > 128 gets smaller
    tiles. fp32 tiles are sized for 3xTF32, the default fp32 precision, which splits every operand into two
    TF32 halves: the largest tiles that do not spill registers in an offline sm_90a compile (ptxas), which
    at d = 128 means 32 x 32.
    """
    if config.fwd_tiles:
        return _tiles(*config.fwd_tiles)
    if INTERPRET:
        return _tiles(16, 16, 4, 1)
    bd = block_d(d)
    long = long_sequence(n_q, n_k)
    if dtype == torch.float32:
        if bd <= 64:
            return _tiles(128, 64, 8, 2) if long else _tiles(64, 32, 4, 2)
        return _tiles(32, 32, 4, 2) if bd <= 128 else _tiles(16, 32, 8, 2)
    if bd > 128:
        return _tiles(64, 32, 8, 2)
    if not long:
        return _tiles(64, 64, 4, 3)
    if not fills_gpu(batch_heads * -(-n_q // 128), device):  # thin grid (one head): more, smaller tiles
        return _tiles(64, 128, 4, 3)
    if bd <= 64:
        return _tiles(128, 64, 8, 3)
    if d < bd:
        split = head_chunks(d, dtype, "fwd", n_q, n_k, config)[1] > 0
        return _tiles(128, 64, 8, 3) if split and not causal else _tiles(64, 64, 4, 3)
    if causal and max(n_q, n_k) <= NARROW_CAUSAL_MAX_SEQ:
        return _tiles(64, 64, 4, 3)
    return _tiles(128, 128, 8, 3)


def _bwd_tiles(m1, n1, m2, n2, warps, stages) -> dict:
    return {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2, "num_warps": warps, "num_stages": stages}


def backward_plan(batch_heads: int, n_q: int, n_k: int, d: int, dtype: torch.dtype, device: torch.device,
                  config: FlashConfig = DEFAULT_CONFIG) -> tuple[str, dict]:
    """(launch mode, {pass: launch parameters}) of the backward without autotuning.

    Passes: 0 = dK/dV and dQ programs in one grid ("fused"), 1 = dK/dV programs, 2 = dQ programs.
    ``BLOCK_M1 x BLOCK_N1`` are the (query, key) tiles of the dK/dV loop, ``BLOCK_M2 x BLOCK_N2`` those of the
    dQ loop. bf16/fp16 at d <= 128, as measured by the sweep of ``python -m lab.bench.flash_sweep`` on an H100:
    one fused launch with 4 warps for short sequences (8 warps took twice as long at 512 tokens) and thin
    grids; when the heads fill the GPU, two passes, at ``BLOCK_D`` 128 with dK/dV programs of 64 queries x 128
    keys on 8 warps. A split head dimension (:func:`head_chunks`: 80 as 64 + 16 columns) ran fastest on 64 x 64
    tiles, 4 warps, in both passes (the wide tiles measured slower there, at d = 80 and 96). The dK/dV program
    keeps two fp32 ``BLOCK_N1 x BLOCK_D`` accumulators in registers, so wide heads and fp32 get narrower key
    tiles.
    """
    bd = block_d(d)
    long = long_sequence(n_q, n_k)
    if config.bwd_tiles:
        tiles = _bwd_tiles(*config.bwd_tiles)
        table_mode, _ = backward_plan(batch_heads, n_q, n_k, d, dtype, device, config.replace(bwd_tiles=()))
    elif INTERPRET:
        tiles, table_mode = _bwd_tiles(16, 16, 16, 16, 4, 1), "fused"
    elif dtype == torch.float32:  # sized for 3xTF32 like the forward's fp32 tiles
        if bd <= 64:  # on an H100 twice as fast as (32, 64, 64, 32, 8, 2) at 16 heads x 2k, d 64, causal
            tiles = _bwd_tiles(32, 32, 32, 32, 4, 2)
        elif bd <= 128:
            tiles = _bwd_tiles(32, 32, 32, 32, 8, 1)
        else:
            tiles = _bwd_tiles(16, 16, 16, 16, 8, 1)
        table_mode = "two_pass" if long and fills_gpu(batch_heads * -(-n_k // 64), device) else "fused"
    elif bd > 128:
        tiles, table_mode = _bwd_tiles(32, 32, 32, 32, 8, 2), "fused"
    elif not long:
        tiles, table_mode = _bwd_tiles(32, 64, 64, 32, 4, 2), "fused"
    else:
        small = _bwd_tiles(64, 64, 64, 64, 4, 3)
        if not fills_gpu(batch_heads * -(-n_k // 64), device):  # thin grid (one head): one fused launch
            tiles, table_mode = small, "fused"
        else:
            split = head_chunks(d, dtype, "bwd", n_q, n_k, config)[1] > 0
            wide = small if bd <= 64 or split else _bwd_tiles(64, 128, 128, 64, 8, 3)
            mode = "two_pass" if config.backward_launch == "auto" else config.backward_launch
            return mode, {0: small, 1: wide, 2: wide}
    mode = table_mode if config.backward_launch == "auto" else config.backward_launch
    return mode, dict.fromkeys((0, 1, 2), tiles)
