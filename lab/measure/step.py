"""The one phased training step: ``forward`` -> ``backward`` -> ``optimizer_step``, and what each phase
costs in time and in memory.

Every benchmark, profile, memory recording and parallel wrapper in the book runs its training step
through :class:`TrainStep`, so the phases have the same names (:data:`PHASES`) in every table, trace and
timeline:

* ``forward``: the loss, under autocast for the step's training dtype (``lab.dtypes``);
* ``backward``: ``loss.backward()`` and, for a data-parallel wrapper, its
  ``finish_gradient_synchronization()`` (waiting for the gradients' communication is part of backward);
* ``optimizer_step``: ``optimizer.step()`` then ``zero_grad(set_to_none=True)``.

Each phase runs inside a ``torch.profiler.record_function`` range of its name. :func:`measure_modes` times
the three modes a step can be measured in (forward only, forward+backward, the whole train step),
interleaved and timed alike, each with its own peak memory, and :func:`peak_memory_by_phase` reads the
peak of each phase.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pandas as pd
import torch
from torch import nn

from lab.dtypes import autocast
from lab.measure.device import synchronize
from lab.measure.memory_snapshot import record_memory_snapshot
from lab.measure.memory_timeline import active_memory_timeline, phase_rows_from_timeline
from lab.measure.timing import Timing
from lab.units import GiB

PHASES = ("forward", "backward", "optimizer_step")
#: What can be timed: the forward alone, forward+backward, or the whole train step.
MODES = ("forward", "forward_backward", "train_step")

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``model(tokens, targets)`` (a ``TransformerLM``, or any wrapper that
    passes its arguments through)."""
    return model(tokens, targets)


def random_batch(cfg, batch: int, device: torch.device | str, context: int | None = None,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch, context) for a model config ``cfg``
    (its ``vocab_size``; ``context`` defaults to its ``context_length``)."""
    gen = torch.Generator().manual_seed(seed)
    context = context or cfg.context_length
    tokens = torch.randint(0, cfg.vocab_size, (batch, context + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


#: The optimizer :func:`make_optimizer` builds, as the ledger keys a step by it (a fused AdamW's step is not
#: another implementation's: 2.7B's foreach AdamW takes tens of ms more on an H200).
OPTIMIZER = "AdamW, fused on CUDA"


def make_optimizer(model: nn.Module, device: torch.device | str, lr: float = 1e-4,
                   weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """AdamW over ``model.parameters()``, fused on CUDA (one kernel for all parameters)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                             fused=torch.device(device).type == "cuda")


class TrainStep:
    """One training step of ``model`` on a fixed batch, split into the phases of :data:`PHASES`.

    ``dtype`` is the training precision (``fp32``, or ``bf16``/``fp16`` autocast); ``loss_fn(model, tokens,
    targets)`` defaults to :func:`lm_loss`. ``optimizer`` may be None for forward/backward-only use.
    Calling the object runs the whole step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, tokens: torch.Tensor,
                 targets: torch.Tensor, dtype: str = "fp32", loss_fn: LossFn = lm_loss,
                 device: torch.device | str | None = None):
        self.model, self.optimizer = model, optimizer
        self.tokens, self.targets = tokens, targets
        self.dtype, self.loss_fn = dtype, loss_fn
        self.device = torch.device(device) if device is not None else tokens.device
        autocast(self.device, dtype)  # an unknown dtype fails here, not inside the first timed step
        self._finish = getattr(model, "finish_gradient_synchronization", None)

    def forward(self) -> torch.Tensor:
        with torch.profiler.record_function("forward"), autocast(self.device, self.dtype):
            return self.loss_fn(self.model, self.tokens, self.targets)

    def backward(self, loss: torch.Tensor) -> None:
        with torch.profiler.record_function("backward"):
            loss.backward()
            if self._finish is not None:
                self._finish()

    def optimizer_step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("this TrainStep has no optimizer")
        with torch.profiler.record_function("optimizer_step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self) -> None:
        """Forward and backward from fresh gradients (the previous step's are dropped first)."""
        self.model.zero_grad(set_to_none=True)
        self.backward(self.forward())

    def __call__(self) -> None:
        self.forward_backward()
        self.optimizer_step()

    def run(self, mode: str) -> None:
        """Run one step of ``mode`` (see :data:`MODES`)."""
        if mode == "forward":
            self.forward()
        elif mode == "forward_backward":
            self.forward_backward()
        elif mode == "train_step":
            self()
        else:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


# ----------------------------------------------------------------------------------------------------------
# time and memory by mode


def measure_mode(step: TrainStep, mode: str, warmup: int = 2, steps: int = 5,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, Timing], float]:
    """:func:`measure_modes` of one mode: ``({column: Timing}, peak_gib)``."""
    timings, peaks = measure_modes(step, [mode], warmup, steps, clock)
    return timings, peaks[mode]


def _timed_run(step: TrainStep, mode: str, clock: Callable[[], float]) -> tuple[float, float]:
    """One run of ``mode`` between two synchronizations, timed by ``clock`` (seconds): ``(ms, backward ms)``.
    The backward's share of a forward+backward is read without a synchronization between the two phases
    (a CUDA event pair on the GPU; the same clock on the CPU, whose ops are synchronous), so the
    forward+backward runs exactly as it does inside a train step: a host synchronization after the forward
    would leave the GPU idle while the host launches the backward, a cost the train step never pays."""
    cuda = step.device.type == "cuda"
    synchronize(step.device)
    t0 = clock()
    backward_ms = math.nan
    if mode == "forward_backward":
        step.model.zero_grad(set_to_none=True)
        loss = step.forward()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        else:
            t1 = clock()
        step.backward(loss)
        del loss
        if cuda:
            end.record()
    else:
        step.run(mode)
    synchronize(step.device)
    t2 = clock()
    if mode == "forward_backward":
        backward_ms = begin.elapsed_time(end) if cuda else (t2 - t1) * 1e3
    return (t2 - t0) * 1e3, backward_ms


def measure_modes(step: TrainStep, modes: Sequence[str], warmup: int = 2, steps: int = 5,
                  clock: Callable[[], float] = time.perf_counter) -> tuple[dict[str, Timing], dict[str, float]]:
    """Time ``modes`` of one step the same way: ``warmup`` untimed runs of each mode alone, in the order given
    (its peak memory read there, before a later mode's state exists: the optimizer's, kept gradients), then
    ``steps`` timed rounds, each running every mode once (interleaved, the order rotating by one each round),
    each run between two device synchronizations and timed by the same ``clock`` (seconds; the host's by
    default, so a host-bound step's launch time counts in every mode alike). Measured in separate runs, one
    mode after the other, the modes of one configuration saw different clocks, caches and host load, and a
    train step could come out faster than its own forward+backward; interleaved, any drift falls on every
    mode alike.

    Returns ``({column: Timing}, {mode: peak_gib})``: columns ``fwd``, ``fwdbwd``, ``step`` (see
    :func:`mode_columns`) and ``bwd`` (the backward's share of each forward+backward, without a
    synchronization between its phases); a mode's peak is the largest GPU memory allocated during its
    warm-up runs (its timed runs without warm-up; NaN on the CPU, which has no allocator statistics).
    """
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    cuda = step.device.type == "cuda"
    columns = dict(zip(modes, mode_columns(modes)))
    timings = {columns[m]: Timing() for m in modes}
    if "forward_backward" in modes:
        timings["bwd"] = Timing()
    peaks = dict.fromkeys(modes, math.nan if not cuda else 0.0)

    def run(mode: str, timed: bool) -> None:
        if cuda and (not timed or not warmup):
            synchronize(step.device)
            torch.cuda.reset_peak_memory_stats(step.device)
        ms, backward_ms = _timed_run(step, mode, clock)
        if cuda and (not timed or not warmup):
            peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated(step.device) / GiB)
        if timed:
            timings[columns[mode]].samples_ms.append(ms)
            if mode == "forward_backward":
                timings["bwd"].samples_ms.append(backward_ms)

    for mode in modes:
        for _ in range(warmup):
            run(mode, timed=False)
    for i in range(steps):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            run(mode, timed=True)
    return timings, peaks


class MemoryCounter(Protocol):
    """Where :func:`peak_memory_by_phase` reads memory: bytes allocated now, the peak since the last reset."""

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...


class CudaMemoryCounter:
    """:class:`MemoryCounter` of the CUDA caching allocator (``memory_allocated`` / ``max_memory_allocated``)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


def peak_memory_by_phase(step: TrainStep, steps: int = 1, counter: MemoryCounter | None = None,
                         snapshot_path: Any = None) -> pd.DataFrame:
    """Peak memory of each phase of ``steps`` training steps: init, forward, backward, optimizer step.

    Before each phase the peak statistic is reset, so a phase's peak is the most memory allocated at any
    moment during it (the first optimizer step includes creating its state). Memory is read from
    ``counter`` if given (any :class:`MemoryCounter`, e.g. a fake in tests); else, on CUDA, the caching
    allocator's statistics. The CPU has no allocator statistics, so there the steps run under
    :func:`lab.measure.memory_snapshot.record_memory_snapshot` and each phase's peak is read off the
    reconstructed timeline (``snapshot_path`` names the pickle; a temporary file otherwise). Returns
    columns ``step``, ``phase`` (``init`` first), ``peak_bytes``, ``allocated_bytes`` (at the phase's end),
    ``peak_gib``, ``allocated_gib``.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")

    def run(on_phase: Callable[[int, str], None]) -> None:
        step.model.zero_grad(set_to_none=True)
        for i in range(steps):
            on_phase(i, "forward")
            loss = step.forward()
            on_phase(i, "backward")
            step.backward(loss)
            del loss
            on_phase(i, "optimizer_step")
            step.optimizer_step()
            on_phase(i, "end")

    rows: list[dict] = []
    if counter is None and step.device.type == "cuda":
        counter = CudaMemoryCounter(step.device)
    if counter is not None:
        counter.reset_peak()
        rows.append(dict(step=0, phase="init", peak_bytes=counter.peak(), allocated_bytes=counter.allocated()))
        current: list = []

        def on_phase(i: int, phase: str) -> None:
            if current and current[1] != "end":
                synchronize(step.device)
                rows.append(dict(step=current[0], phase=current[1], peak_bytes=counter.peak(),
                                 allocated_bytes=counter.allocated()))
            current[:] = [i, phase]
            counter.reset_peak()

        run(on_phase)
    else:
        import tempfile
        from pathlib import Path


        with contextlib.ExitStack() as stack:
            path = snapshot_path or Path(stack.enter_context(tempfile.TemporaryDirectory())) / "phases.pickle"
            with record_memory_snapshot(path, device=step.device) as rec:
                rec.mark("0|init")
                run(lambda i, phase: rec.mark(f"{i}|{phase}"))
            timeline = active_memory_timeline(rec.snapshot, marks=rec.marks)
        rows.extend(phase_rows_from_timeline(timeline, rec.marks))
    df = pd.DataFrame(rows)
    df["peak_gib"] = df["peak_bytes"] / GiB
    df["allocated_gib"] = df["allocated_bytes"] / GiB
    return df


def mode_columns(modes: Sequence[str]) -> list[str]:
    """The ``lm_step`` column prefixes of ``modes``: forward -> fwd, forward_backward -> fwdbwd, train_step -> step."""
    return [{"forward": "fwd", "forward_backward": "fwdbwd", "train_step": "step"}[m] for m in modes]
