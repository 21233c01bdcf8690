"""The one timer: every sample kept, the device synchronized, GPU kernels timed with CUDA events.

* :func:`time_callable` times whole steps with a host clock, synchronizing after each one (a training step
  is what a user waits for, launch overhead included);
* :func:`time_kernel` times a GPU operation with ``triton.testing.do_bench`` (CUDA events, L2 flushed
  between calls; every repetition kept), and falls back to :func:`time_callable` on the CPU;
* :func:`graph_replay` captures a step in a CUDA graph, so that :func:`time_kernel` of its replay is the
  device's time without the host's (short kernels, whose launches would otherwise set the pace).

Both return a :class:`Timing` whose samples feed :mod:`lab.measure.verdicts`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lab.measure.device import resolve_device, synchronize


@dataclass
class Timing:
    """Every timed sample in milliseconds, with summary statistics."""

    samples_ms: list[float] = field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms) if self.samples_ms else math.nan

    @property
    def std_ms(self) -> float:
        return statistics.stdev(self.samples_ms) if len(self.samples_ms) > 1 else 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    @property
    def cv(self) -> float:
        """Coefficient of variation (std / mean): above ~0.05 the mean alone is misleading."""
        return self.std_ms / self.mean_ms if self.samples_ms else math.nan


def time_callable(fn: Callable[[], object], warmup: int = 2, steps: int = 5,
                  device: torch.device | str = "auto") -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then ``steps`` times timed with a host clock.

    The device is synchronized before and after every timed call, so each sample is the wall time of one
    complete step (kernel launch overhead included), in milliseconds.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1 (a measurement needs a timed step), got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    device = resolve_device(device) if isinstance(device, str) else device
    for _ in range(warmup):
        fn()
    synchronize(device)
    timing = Timing()
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        timing.samples_ms.append((time.perf_counter() - start) * 1e3)
    return timing


def time_kernel(fn: Callable[[], object], device: torch.device | str = "auto", warmup_ms: float = 5,
                rep_ms: float = 20, cpu_warmup: int = 1, cpu_steps: int = 3, min_samples: int = 1) -> Timing:
    """Milliseconds per call of ``fn``: ``triton.testing.do_bench(warmup=warmup_ms, rep=rep_ms)`` on CUDA
    (CUDA events around each call, the L2 cache flushed in between, every repetition returned), or
    :func:`time_callable` with ``cpu_warmup`` / ``cpu_steps`` calls on the CPU. do_bench fits as many calls
    as ``rep_ms`` holds, so a call longer than the budget gets one sample and no spread: where fewer than
    ``min_samples`` came back, it runs again with a budget sized from their median to give that many."""
    if min_samples < 1:
        raise ValueError(f"min_samples must be at least 1, got {min_samples}")
    device = resolve_device(device) if isinstance(device, str) else device
    if device.type == "cuda":
        import triton.testing

        samples = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        if len(samples) < min_samples:  # do_bench sizes its repeats from a first estimate: ask for more time
            per_call = sorted(samples)[len(samples) // 2]
            samples = triton.testing.do_bench(fn, warmup=0, rep=per_call * (min_samples + 1), return_mode="all")
        return Timing([float(s) for s in samples])
    return time_callable(fn, cpu_warmup, cpu_steps, device)


def graph_replay(step: Callable[[], object]) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (after warm-up calls on a side stream); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192, device: torch.device | str = "auto",
                  rep_ms: float = 100) -> float:
    """TFLOP/s of one ``n x n x n`` matrix product in ``dtype`` (``torch.mm`` of random data, :func:`time_kernel`
    median): the tensor-core rate a kernel's or a step's matrix products can hope for on this device."""
    device = resolve_device(device) if isinstance(device, str) else device
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    ms = time_kernel(lambda: a @ b, device, warmup_ms=25, rep_ms=rep_ms).median_ms
    return 2 * n**3 / (ms * 1e-3) / 1e12
