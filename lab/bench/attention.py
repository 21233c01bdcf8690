"""The attention implementations the book compares, by the names of its tables, their inputs, and the naive
grid: forward and backward passes of one implementation timed over head dimensions and lengths, with the memory
in use before the backward and what autograd saved (:func:`run_naive_grid`).

Each takes ``fn(q, k, v, causal)`` on ``(batch, seq, d)`` tensors (heads folded into the batch), the interface
of ``FlashAttentionTriton.apply``, and all share the registry's top-left causal convention
(:mod:`lab.model.attention`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence

import pandas as pd
import torch
import torch._functorch.config  # not imported by ``import torch``; flex_attention_fn and the grid set it

from lab.accounting.attention import DTYPES, naive_attention_totals
from lab.bench.progress import progress_bar
from lab.kernels.flash_pytorch import FlashAttentionPytorch
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device, synchronize
from lab.measure.results import gpu_label
from lab.measure.saved_tensors import saved_tensor_bytes
from lab.measure.timing import time_callable
from lab.measure.verdicts import summarize
from lab.model.attention import AttentionFn, get_attention, naive_attention
from lab.units import GiB, MiB


def sdpa_on_heads(name: str = "sdpa") -> AttentionFn:
    """An SDPA variant of the registry on ``(batch, seq, d)``: viewed as one batch of ``batch`` heads,
    because the fused (Flash/cuDNN/efficient) backends only accept 4-D input and would otherwise fall back
    to the math kernel."""
    fn = get_attention(name)
    return lambda q, k, v, causal: fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal)[0]


#: The benchmark's implementation names (the ``impl`` column of ``flash_benchmark.csv``).
IMPLS = ("triton", "triton_compiled_bwd", "pytorch_flash", "pytorch_naive", "sdpa", "sdpa_flash", "sdpa_cudnn",
         "sdpa_efficient", "flex")

_FLEX = {}


def flex_attention_fn() -> AttentionFn:
    """PyTorch's FlexAttention as a peer: ``torch.compile`` of ``flex_attention`` (Triton kernels that
    Inductor generates) with a causal block mask, so fully masked key blocks are skipped as in the other
    fused kernels; on ``(batch, seq, d)`` inputs viewed as one batch of ``batch`` heads. Block masks are
    built once per (sequence lengths, device) and reused.

    Turns off AOTAutograd's donated buffers for the rest of the process: the benchmarks run one forward's
    backward repeatedly (``retain_graph=True``), which a compiled backward that frees ("donates") its saved
    tensors refuses, and the check reads the setting when the backward runs, so a scoped patch cannot do. Raises
    dynamo's recompile limit too (to 64): every new shape is one more compilation of ``flex_attention``, and
    past the default 8 dynamo would run it uncompiled (materializing the whole score matrix) without failing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # optional: torch >= 2.5

    if "fn" not in _FLEX:
        torch._functorch.config.donated_buffer = False
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def fn(q, k, v, causal=True):
        mask = None
        if causal:
            key = (q.shape[-2], k.shape[-2], str(q.device))
            if key not in _FLEX:
                _FLEX[key] = create_block_mask(causal_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
            mask = _FLEX[key]
        return _FLEX["fn"](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), block_mask=mask)[0]

    return fn


def attention_impl(name: str, device: torch.device | str = "auto") -> AttentionFn:
    """The attention function ``fn(q, k, v, causal)`` on ``(batch, seq, d)`` called ``name`` in the tables.

    ``pytorch_naive`` (the registry's naive attention), ``sdpa`` and ``sdpa_<backend>`` (SDPA, default or one
    backend), ``triton`` (``FlashAttentionTriton``), ``triton_compiled_bwd`` (its forward, backward as
    compiled PyTorch; both carry ``kernel(q, k, v, causal)``, which forward kernel runs: ``"gluon"`` or
    ``"triton"``, and ``bwd_kernel(q, k, v, causal)``, which backward: ``"gluon"``, ``"triton"`` or
    ``"compiled"``), ``flex`` (compiled FlexAttention, :func:`flex_attention_fn`) and ``pytorch_flash``
    (``FlashAttentionPytorch``, tiled in pure PyTorch). All share
    the registry's top-left causal convention. The flash kernels are imported only when asked for (on a
    machine without a GPU they run interpreted where the entry point asked, :func:`lab.use_triton_interpreter`).
    """
    if isinstance(device, str):
        resolve_device(device)  # an unknown device name is an error here too
    if name == "pytorch_naive":
        return naive_attention
    if name.startswith("sdpa") and name in IMPLS:
        return sdpa_on_heads(name)
    if name in ("triton", "triton_compiled_bwd"):
        # optional dependency: Triton (Linux only), imported only when its kernel is asked for
        from lab.kernels.flash_triton import BACKWARDS, which_backward, which_forward

        function = BACKWARDS["triton" if name == "triton" else "compiled"]
        fn = lambda q, k, v, causal: function.apply(q, k, v, causal)
        # the rows say which forward and which backward ran (the Gluon kernels on Hopper, else the portable ones):
        # see kernel_of
        fn.kernel = lambda q, k, v, causal: which_forward(q, k, v, causal)
        fn.bwd_kernel = ((lambda q, k, v, causal: which_backward(q, k, v, causal)) if name == "triton"
                         else (lambda q, k, v, causal: "compiled"))
        return fn
    if name == "pytorch_flash":
        return lambda q, k, v, causal: FlashAttentionPytorch.apply(q, k, v, causal)
    if name == "flex":
        return flex_attention_fn()
    raise ValueError(f"unknown attention implementation {name!r}; choose one of {', '.join(IMPLS)}")


def attention_inputs(batch: int, seq: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Seeded random ``q, k, v`` (requiring gradients) and an upstream gradient ``dout``, each ``(batch, seq,
    d)`` in ``dtype`` on ``device``: the same values on every device for one seed (drawn on the CPU)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda: torch.randn(batch, seq, d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = (make().requires_grad_() for _ in range(3))
    return q, k, v, make()


# ----------------------------------------------------------------------------------------------------------
# The naive grid: forward and backward passes timed separately, memory before the backward


def _timed(row: dict, pass_: str, timing) -> None:
    s = summarize(timing.samples_ms)
    row.update({f"{pass_}_ms": s.median, f"{pass_}_spread_ms": s.spread, f"{pass_}_n": s.n,
                f"{pass_}_samples_ms": list(s.samples)})


def _measure_naive(fn: AttentionFn, batch, seq, d, dtype, causal, passes, warmup, device, row) -> None:
    torch_dtype = DTYPES[dtype]
    if device.type == "cuda":
        # cuBLAS takes its workspace from PyTorch's allocator on first use: create it before the baseline
        # so that it is not charged to this configuration
        torch.ones(8, 8, device=device, dtype=torch_dtype) @ torch.ones(8, 8, device=device, dtype=torch_dtype)
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        row["mem_baseline_mib"] = torch.cuda.memory_allocated(device) / MiB
    q, k, v, dout = attention_inputs(batch, seq, d, torch_dtype, device)
    row["oom_phase"] = "forward"
    _timed(row, "fwd", time_callable(lambda: fn(q, k, v, causal), warmup, passes, device))
    # one forward whose graph the backward passes reuse (retain_graph), measured before backward starts
    synchronize(device)
    out = fn(q, k, v, causal)
    synchronize(device)
    if device.type == "cuda":
        row["mem_before_bwd_mib"] = torch.cuda.memory_allocated(device) / MiB
    row["oom_phase"] = "backward"
    _timed(row, "bwd", time_callable(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup,
                                     passes, device))
    if device.type == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / MiB
    out = None  # the lambda above holds the graph through this name: drop it
    # what autograd keeps, counted tensor by tensor (device independent), once per configuration
    row["oom_phase"] = "saved-tensor count"
    row["saved_mib"] = saved_tensor_bytes(lambda a, b, c: fn(a, b, c, causal), q, k, v) / MiB


def _run_naive_config(fn, compile, batch, seq, d, dtype, causal, passes, warmup, device, row) -> None:
    run = fn
    if compile:
        torch._dynamo.reset()
        run = torch.compile(fn, dynamic=False)
        row["oom_phase"] = "compilation"
        q, k, v, dout = attention_inputs(batch, seq, d, DTYPES[dtype], device)
        start = time.perf_counter()
        torch.autograd.grad(run(q, k, v, causal), (q, k, v), dout)
        synchronize(device)
        row["compile_s"] = time.perf_counter() - start
        del q, k, v, dout
    _measure_naive(run, batch, seq, d, dtype, causal, passes, warmup, device, row)


def run_naive_grid(fn: AttentionFn = naive_attention, ds: Sequence[int] = (16, 32, 64, 128),
                   seqs: Sequence[int] = (256, 1024, 4096, 8192, 16384), batch: int = 8, dtype: str = "fp32",
                   causal: bool = False, passes: int = 100, warmup: int = 5, compile: bool | Sequence[bool] = False,
                   impl: str | None = None, device: torch.device | str = "auto",
                   progress: bool = True) -> pd.DataFrame:
    """Time ``passes`` forward and ``passes`` backward passes of ``fn`` for every ``d x seq``.

    Each configuration gets fresh ``(batch, seq, d)`` inputs. Forward passes run with gradients enabled (as
    in training) and each one's graph is dropped; then one forward is kept, the memory in use is read
    (``torch.cuda.memory_allocated``), and ``passes`` backward passes reuse its graph
    (``retain_graph=True``). With ``compile=True`` the function is compiled afresh per shape
    (``torch.compile(dynamic=False)`` after ``torch._dynamo.reset()``), and ``compile_s`` is the time of the
    first forward+backward (compilation included). ``compile=(False, True)`` measures each configuration
    eagerly and then compiled, one right after the other; the ``compile`` column tells the rows apart.

    One row per configuration: ``fwd_ms``/``bwd_ms`` the median ms per pass with ``*_spread_ms`` (robust
    spread), ``*_n`` and every sample, ``*_samples_ms`` (:func:`lab.measure.verdicts.summarize`); memory in
    MiB (NaN on the CPU, except ``saved_mib``, counted with saved-tensor hooks); ``predicted_*_mib`` from
    :func:`lab.accounting.attention.naive_attention_totals`; ``limit_gib`` the device's memory (NaN on the
    CPU). Out-of-memory in either pass is a row with ``status="oom"``, ``oom_phase`` naming the pass and
    ``error`` the allocator's summary; any other error propagates.
    """
    device = resolve_device(device) if isinstance(device, str) else device
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if passes < 1 or warmup < 0:
        raise ValueError("passes must be >= 1 and warmup >= 0")
    compiles = (bool(compile),) if isinstance(compile, bool) else tuple(bool(c) for c in compile)
    if not compiles:
        raise ValueError("compile must be a bool or a non-empty sequence of bools")
    impl = impl or getattr(fn, "__name__", "attention")
    gpu = gpu_label() if device.type == "cuda" else "cpu"
    limit = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else math.nan
    grid = [(d, s, c) for d in ds for s in seqs for c in compiles]
    label = {(False,): "", (True,): " compiled"}.get(compiles, " eager and compiled")
    rows = []
    for d, seq, compiled in progress_bar(grid, f"{impl}{label}", progress):
        predicted = naive_attention_totals(batch, seq, d, dtype, causal)
        row = dict(impl=impl, compile=compiled, batch=batch, seq_len=seq, d=d, dtype=dtype, causal=causal,
                   **{f"{p}_{c}": math.nan for p in ("fwd", "bwd") for c in ("ms", "spread_ms")}, fwd_n=0, bwd_n=0,
                   fwd_samples_ms=[], bwd_samples_ms=[],
                   mem_baseline_mib=math.nan, mem_before_bwd_mib=math.nan, peak_mib=math.nan, saved_mib=math.nan,
                   predicted_saved_mib=predicted["saved"] / MiB,
                   predicted_before_bwd_mib=predicted["before_backward"] / MiB,
                   predicted_peak_mib=predicted["peak"] / MiB, compile_s=math.nan, gpu=gpu, limit_gib=limit,
                   status="ok", oom_phase="", error="")
        empty_cache()
        # Compiled backward graphs may donate (reuse) saved buffers, which forbids retain_graph=True; the
        # backward timing reuses one graph, so donation is switched off (a small memory saving forgone).
        try:
            with torch._functorch.config.patch(donated_buffer=False):
                _run_naive_config(fn, compiled, batch, seq, d, dtype, causal, passes, warmup, device, row)
            row["oom_phase"] = ""
        except Exception as exc:
            if not is_oom(exc):
                raise
            row.update(status="oom", oom_phase=row["oom_phase"] or "setup", error=error_summary(exc))
        rows.append(row)
        gc.collect()
        empty_cache()
    return pd.DataFrame(rows)
