"""Where a language model's training memory goes, measured on any :class:`~lab.model.TransformerLM`: a forward
and training steps recorded as memory snapshots with their phases (and each block's backward) marked, the
gradient memory each block leaves, peak memory by context and dtype, and the peak and time of each
activation-checkpointing configuration. Every measurement returns a DataFrame; out-of-memory is a row
(``status="oom"`` with the memory the device had, ``limit_gib``), never a crash.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from lab.bench.progress import progress_bar
from lab.dtypes import autocast_dtype
from lab.measure.device import available_memory_bytes, empty_cache, error_summary, is_oom
from lab.measure.memory_pages import marked_phase_peaks
from lab.measure.memory_snapshot import MemoryRecording, record_memory_snapshot
from lab.measure.memory_timeline import gradient_bytes_by_window, measure_peak_bytes
from lab.measure.quiet import silenced_native_stderr
from lab.measure.step import TrainStep, random_batch
from lab.measure.step import make_optimizer as default_optimizer
from lab.measure.timing import time_callable
from lab.measure.verdicts import summarize
from lab.model.checkpointing import activation_checkpointing
from lab.units import GiB, MiB

# ----------------------------------------------------------------------------------------------------------
# recording a training step


def record_training_snapshot(step: TrainStep, path: str | os.PathLike, steps: int = 2, forward_only: bool = False,
                             blocks: Sequence[nn.Module] | None = None,
                             max_entries: int = 1_000_000) -> MemoryRecording:
    """Record a memory snapshot of ``steps`` training steps of ``step`` (or one forward with ``forward_only``),
    with each phase marked: ``forward 1``, ``backward 1``, ``optimizer_step 1`` (where AdamW creates its
    state), ...

    With ``blocks`` (the model's block list), a full backward pre-hook on each block also marks where its
    backward starts (``backward 1 block 31`` ...) in ``rec.detail_marks``, for
    :func:`gradient_memory_per_block`. Returns the :class:`MemoryRecording` (the pickle is at ``path``, the
    marks in its JSON sidecar).
    """
    if not forward_only and step.optimizer is None:
        raise ValueError("a training-step recording needs a TrainStep with an optimizer (or forward_only=True)")
    detail: list[tuple[str, int]] = []
    current = {"step": 0}
    handles = []

    def block_mark(i: int):
        def hook(module, grad_output) -> None:
            detail.append((f"backward {current['step']} block {i}", time.time_ns() // 1000))
        return hook

    if blocks is not None and not forward_only:
        for i, block in enumerate(blocks):
            handles.append(block.register_full_backward_pre_hook(block_mark(i)))
    step.model.zero_grad(set_to_none=True)
    # the CPU build's profiler prints a line at every start and stop: keep the report clean
    quiet = silenced_native_stderr(step.device.type == "cpu")
    try:
        with quiet, record_memory_snapshot(path, max_entries=max_entries, device=step.device) as rec:
            for i in range(1, (1 if forward_only else steps) + 1):
                current["step"] = i
                rec.mark(f"forward {i}")
                loss = step.forward()
                if forward_only:
                    rec.mark("after forward")
                    del loss
                    break
                rec.mark(f"backward {i}")
                step.backward(loss)
                del loss
                rec.mark(f"optimizer_step {i}")
                step.optimizer_step()
            rec.mark("end")
    finally:
        for h in handles:
            h.remove()
    rec.detail_marks = detail
    rec.phases_path.write_text(json.dumps({"marks": rec.marks, "detail_marks": detail}) + "\n")
    return rec


def record_step_timelines(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                          folder: str | os.PathLike, dtype: str = "fp32", blocks: Sequence[nn.Module] | None = None,
                          max_entries: int = 1_000_000) -> pd.DataFrame:
    """Record one forward pass (``<folder>/forward.pickle``) and two AdamW steps of ``model`` on one batch, every
    block's backward marked (``train_step.pickle``; :func:`record_training_snapshot`). Returns the peak of each
    marked phase of both recordings (:func:`lab.measure.memory_pages.marked_phase_peaks`) with ``recording``."""
    tables = []
    for name, optimizer in (("forward", None), ("train_step", default_optimizer(model, tokens.device))):
        empty_cache()  # what earlier measurements left (an optimizer in a reference cycle) must not count
        step = TrainStep(model, optimizer, tokens, targets, dtype=dtype)
        rec = record_training_snapshot(step, Path(folder) / f"{name}.pickle", steps=2, forward_only=optimizer is None,
                                       blocks=blocks, max_entries=max_entries)
        tables.append(marked_phase_peaks(rec.snapshot, rec.marks).assign(recording=name))
        del rec, step, optimizer
    empty_cache()
    return pd.concat(tables, ignore_index=True)


def gradient_memory_per_block(snapshot: dict, marks: Sequence[tuple[str, int]],
                              detail_marks: Sequence[tuple[str, int]], blocks: Sequence[nn.Module],
                              step: int = 1) -> pd.DataFrame:
    """Gradient memory of each block inferred from the backward timeline of a :func:`record_training_snapshot`
    recording, against the expectation (the bytes of the block's trainable parameters, one gradient each).

    A block's window runs from its backward pre-hook to the next block's; what is allocated there and is
    still alive when ``optimizer_step <step>`` begins is that block's gradients (block 0's window also
    holds the embedding's gradient, made after it). Returns ``block``, ``measured_bytes``,
    ``expected_bytes``, ``measured_mib``, ``expected_mib``, ``ratio``.
    """
    prefix = f"backward {step} block "
    windows = [m[0] for m in sorted(detail_marks, key=lambda m: m[1]) if m[0].startswith(prefix)]
    if not windows:
        raise ValueError(f"no block marks for step {step}; record with blocks=")
    all_marks = sorted(list(marks) + list(detail_marks), key=lambda m: m[1])
    got = gradient_bytes_by_window(snapshot, all_marks, windows, end_phase=f"optimizer_step {step}")
    got["block"] = got["window"].str.removeprefix(prefix).astype(int)
    expected = {i: sum(p.numel() * p.element_size() for p in b.parameters() if p.requires_grad)
                for i, b in enumerate(blocks)}
    got["expected_bytes"] = got["block"].map(expected)
    got = got.rename(columns={"surviving_bytes": "measured_bytes"}).sort_values("block")
    got["measured_mib"] = got["measured_bytes"] / MiB
    got["expected_mib"] = got["expected_bytes"] / MiB
    got["ratio"] = got["measured_bytes"] / got["expected_bytes"]
    return got[["block", "measured_bytes", "expected_bytes", "measured_mib", "expected_mib", "ratio"]].reset_index(
        drop=True)


# ----------------------------------------------------------------------------------------------------------
# peak memory across contexts and dtypes


def peak_memory_table(model: nn.Module, contexts: Sequence[int], dtypes: Sequence[str] = ("fp32", "bf16"),
                      batch: int = 4, progress: bool = True,
                      make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None) -> pd.DataFrame:
    """Peak memory of a forward pass and of a full AdamW training step for each context length and dtype.

    The forward rows are measured first, for every configuration, before any optimizer state or gradient
    exists. Then the AdamW state is created by one unmeasured step at the smallest context, and each
    training-step row is one steady-state step (parameters, gradients, optimizer state and activations;
    its peak is at least the first step's, whose state appears only after the activations are freed).
    Out-of-memory is a row (``status="oom"``, ``limit_gib`` the memory the device had). ``dtypes`` are
    training dtypes (``fp32``, ``bf16``/``fp16`` autocast). Returns columns ``context``, ``batch``, ``dtype``,
    ``mode`` (``forward``, ``train_step``), ``peak_gib``, ``status``, ``limit_gib``, ``error``.
    """
    device = next(model.parameters()).device
    for d in dtypes:
        autocast_dtype(d)  # a clear error for an unknown name, before anything runs
    make_optimizer = make_optimizer or (lambda m: default_optimizer(m, device))
    optimizer = None

    def batch_of(context: int) -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(model.cfg, batch, device, context=context)

    grid = [(mode, c, d) for mode in ("forward", "train_step") for c in contexts for d in dtypes]
    rows = []
    for mode, context, dt in progress_bar(grid, "peak memory", progress):
        if mode == "train_step" and optimizer is None:
            # one unmeasured step at the smallest context, so that every measured step carries the AdamW state
            opt = make_optimizer(model)
            TrainStep(model, opt, *batch_of(min(contexts)), dtype="fp32")()
            optimizer = opt
        step = TrainStep(model, optimizer, *batch_of(context), dtype=dt)
        row = dict(context=context, batch=batch, dtype=dt, mode=mode, peak_gib=math.nan, status="ok",
                   limit_gib=available_memory_bytes(device) / GiB, error="")
        rows.append(_measured(row, lambda s=step, m=mode: dict(
            peak_gib=measure_peak_bytes(lambda: s.run(m), device) / GiB), model, device))
    return pd.DataFrame(rows)


def _measured(row: dict, measure, model: nn.Module, device: torch.device) -> dict:
    """``row`` updated with what ``measure()`` returns, or with ``status="oom"`` and the error where it runs out
    of memory (any other error propagates); the model's gradients and the allocator's cache are freed after
    either, so that the next configuration starts from the same memory."""
    try:
        with silenced_native_stderr(device.type == "cpu"):
            row.update(measure())
    except Exception as exc:
        if not is_oom(exc):
            raise
        row.update(status="oom", error=error_summary(exc))
    model.zero_grad(set_to_none=True)
    empty_cache()
    return row


# ----------------------------------------------------------------------------------------------------------
# activation checkpointing, measured


def checkpoint_sweep(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                     group_sizes: Sequence[int | None], include_nested: bool = True, dtype: str = "fp32",
                     timing_steps: int = 5, progress: bool = True,
                     optimizer: torch.optim.Optimizer | None = None) -> pd.DataFrame:
    """Peak memory and time of one AdamW :class:`~lab.measure.step.TrainStep` for each checkpointing
    configuration of ``model`` (see :func:`lab.model.checkpointing.activation_checkpointing`).

    ``group_sizes`` lists single-level group sizes (``None`` = no checkpointing); ``include_nested`` adds
    the nested strategy. The AdamW state is created first by one unmeasured step under the nested strategy
    (the most frugal), so every measured step carries it, as in steady-state training. The peak of one step
    comes from :func:`lab.measure.memory_timeline.measure_peak_bytes`; ``step_ms`` (the median),
    ``step_spread_ms``, ``step_n`` and ``step_samples_ms`` from ``timing_steps`` more steps timed by
    :func:`lab.measure.timing.time_callable` (:func:`lab.measure.verdicts.summarize`). Out-of-memory is a row
    (``limit_gib``: the memory the device had). Returns columns ``strategy`` (``none``, ``single``,
    ``nested``), ``group_size`` (NaN but for ``single``), ``peak_gib``, the step's times, ``status``,
    ``limit_gib``, ``error``.
    """
    device = tokens.device
    optimizer = optimizer or default_optimizer(model, device)
    step = TrainStep(model, optimizer, tokens, targets, dtype=dtype)
    with activation_checkpointing(model, strategy="nested"):
        step()  # creates the AdamW state
    configs = [("single", k) for k in group_sizes] + ([("nested", None)] if include_nested else [])
    rows = []
    for strategy, k in progress_bar(configs, "checkpoint sweep", progress):
        row = dict(strategy="none" if (strategy == "single" and k is None) else strategy,
                   group_size=k if k is not None else math.nan, peak_gib=math.nan, step_ms=math.nan,
                   step_spread_ms=math.nan, step_n=0, step_samples_ms=[], status="ok",
                   limit_gib=available_memory_bytes(device) / GiB, error="")

        def measure(k=k, strategy=strategy):
            with activation_checkpointing(model, group_size=k, strategy=strategy):
                peak = measure_peak_bytes(step, device) / GiB
                times = summarize(time_callable(step, warmup=0, steps=timing_steps, device=device).samples_ms)
            return dict(peak_gib=peak, step_ms=times.median, step_spread_ms=times.spread, step_n=times.n,
                        step_samples_ms=list(times.samples))

        rows.append(_measured(row, measure, model, device))
    return pd.DataFrame(rows)
