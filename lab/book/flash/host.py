"""Where a short sequence's attention time goes on the host (notebook 05's question about the 2.7B shape, and the
``host`` table of ``python -m lab.book.flash.sweep sweep``): eager against CUDA-graph replay and
``torch.compile``, the inlined Triton kernels against the opaque op, with the profiler's and cProfile's tables.
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from lab.accounting.attention import DTYPES
from lab.book.flash.bench import Shape
from lab.kernels.flash_config import FlashConfig
from lab.measure.device import error_summary, resolve_device
from lab.measure.timing import graph_replay, time_kernel
from lab.model.attention import AttentionFn, get_attention


def _python_profile(step: Callable[[], object], device: torch.device, calls: int = 50) -> str:
    """cProfile's table (own time per Python function, top 30) of ``calls`` calls of ``step``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def host_attention(name: str) -> AttentionFn:
    """The registry's attention ``name`` (``fn(q, k, v, causal)`` on (batch, heads, seq, d)), or
    ``"flash_triton_inline"`` / ``"flash_triton_opaque"``: the Triton kernels with ``compile_inline`` on (the
    default: compiled code launches the kernels itself) or off (it calls the opaque ``lab::flash_attention_*``
    ops, the op's host function on every call), the comparison that shows what inlining saves."""
    if name in ("flash_triton_inline", "flash_triton_opaque"):
        from lab.kernels.flash_triton import flash_attention_bhsd  # needs Triton (an optional dependency)

        config = FlashConfig(compile_inline=name == "flash_triton_inline")
        return lambda q, k, v, causal: flash_attention_bhsd(q, k, v, causal, config=config)
    return get_attention(name)


def host_costs(shape: Shape, dtype: str = "bf16",
               impls: Sequence[str] = ("flash_triton", "flash_triton_opaque", "sdpa"),
               device: torch.device | str = "auto", calls: int = 20, rep_ms: float = 50,
               profile: bool = True) -> tuple[pd.DataFrame, str]:
    """Where a short sequence's attention time goes, in the model's layout (q, k, v as ``transpose(1, 2)``
    views of (batch, seq, heads, d), the registry's ``fn(q, k, v, True)``), forward + backward per row:
    ``eager_ms`` (do_bench median), ``host_ms`` (wall time to issue one call, ``calls`` calls without a
    sync), ``graph_ms`` (the same step replayed from a CUDA graph: the device's time alone),
    ``compiled_ms`` (``torch.compile(fullgraph=True)`` of the attention and its output transpose) and
    ``host_bound`` (eager well above the graph replay). Also returns the torch.profiler table of a few
    eager steps of the first implementation (self CPU time per op) and cProfile's table of its Python functions,
    or "" when ``profile`` is False. ``impls`` are names for :func:`host_attention`."""
    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator(device="cpu").manual_seed(0)
    dt = DTYPES[dtype]
    make = lambda: torch.randn(shape.batch, shape.seq, shape.heads, shape.d, generator=gen).to(device, dt)
    base = [make().requires_grad_() for _ in range(3)]
    dout = make().transpose(1, 2)
    rows, table = [], ""
    timer = dict(warmup_ms=10, rep_ms=rep_ms)
    for name in impls:
        attn = host_attention(name)

        def step(fn=attn):
            q, k, v = (t.transpose(1, 2) for t in base)
            return torch.autograd.grad(fn(q, k, v, shape.causal), base, dout)

        row = dict(shape=f"{shape.batch}x{shape.heads}x{shape.seq}x{shape.d}", dtype=dtype, impl=name)
        row["eager_ms"] = time_kernel(step, device, **timer).median_ms
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                step()
            row["host_ms"] = (time.perf_counter() - start) * 1e3 / calls
            torch.cuda.synchronize(device)
            try:
                row["graph_ms"] = time_kernel(graph_replay(step), device, **timer).median_ms
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its other columns
                row["note"] = f"graph: {error_summary(exc)}"
        compiled = torch.compile(lambda q, k, v, fn=attn: fn(q, k, v, shape.causal).transpose(1, 2).reshape(
            shape.batch, shape.seq, -1), fullgraph=True)
        douts = dout.transpose(1, 2).reshape(shape.batch, shape.seq, -1)
        row["compiled_ms"] = time_kernel(lambda: torch.autograd.grad(
            compiled(*(t.transpose(1, 2) for t in base)), base, douts), device, **timer).median_ms
        row["host_bound"] = bool(row.get("graph_ms", math.nan) * 1.2 < row["eager_ms"])
        if profile and not table:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
                for _ in range(5):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            table += "\n\nPython functions by own time, 50 eager steps:\n" + _python_profile(step, device)
        rows.append(row)
    return pd.DataFrame(rows), table
