"""The 03 notebook's memory experiments on a language model: a training step recorded as a snapshot with
its phases (and each block's backward) marked, gradient memory per block, peak memory by phase, context and
dtype, what one block and one RMSNorm save for the backward, and the activation-checkpointing sweep.

:class:`~lab.book.memory.workload.MemorySetup` is the configuration (every size and switch, resolved from a
notebook's parameters); :class:`MemoryExperiment` runs the measurements on a model it builds on first use, so
a replayed render (tables read back from ``results/``) never builds the model. Every measurement returns a
DataFrame.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from lab import paths
from lab.bench.progress import progress_bar
from lab.book.memory.workload import MemorySetup
from lab.dtypes import autocast, autocast_dtype
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device
from lab.measure.memory_snapshot import MemoryRecording, load_marks, load_snapshot, record_memory_snapshot
from lab.measure.memory_timeline import (
    active_memory_timeline,
    allocations_by_origin,
    gradient_bytes_by_window,
    largest_allocations,
    measure_peak_bytes,
    peaks_by_phase,
)
from lab.measure.quiet import silenced_native_stderr
from lab.measure.saved_tensors import saved_tensor_report
from lab.measure.step import TrainStep, make_optimizer, peak_memory_by_phase, random_batch
from lab.measure.step import make_optimizer as default_optimizer
from lab.measure.timing import time_callable
from lab.model import RMSNorm, TransformerLM
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


def recording_phase_peaks(snapshot: dict, marks: Sequence[tuple[str, int]]) -> pd.DataFrame:
    """Peak, start and end active memory of each marked phase of a recording (GiB), without the unmarked
    stretch before the first mark and the ``end`` mark's tail."""
    peaks = peaks_by_phase(active_memory_timeline(snapshot, marks=marks))
    return peaks[~peaks["phase"].isin(["", "end"])].reset_index(drop=True)


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
    Out-of-memory is a row (``status="oom"``). ``dtypes`` are training dtypes (``fp32``, ``bf16``/``fp16``
    autocast). Returns columns ``context``, ``batch``, ``dtype``, ``mode`` (``forward``, ``train_step``),
    ``peak_gib``, ``status``, ``error``.
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
        row = dict(context=context, batch=batch, dtype=dt, mode=mode, peak_gib=math.nan, status="ok", error="")
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
                     timing_steps: int = 2, progress: bool = True,
                     optimizer: torch.optim.Optimizer | None = None) -> pd.DataFrame:
    """Peak memory and time of one AdamW :class:`~lab.measure.step.TrainStep` for each checkpointing
    configuration of ``model`` (see :func:`lab.model.checkpointing.activation_checkpointing`).

    ``group_sizes`` lists single-level group sizes (``None`` = no checkpointing); ``include_nested`` adds
    the nested strategy. The AdamW state is created first by one unmeasured step under the nested strategy
    (the most frugal), so every measured step carries it, as in steady-state training. The peak of one step
    comes from :func:`lab.measure.memory_timeline.measure_peak_bytes`; ``step_ms`` (mean) and
    ``step_std_ms`` from ``timing_steps`` more steps timed by :func:`lab.measure.timing.time_callable`.
    Out-of-memory is a row. Returns columns ``strategy`` (``none``, ``single``, ``nested``), ``group_size``
    (NaN but for ``single``), ``peak_gib``, ``step_ms``, ``step_std_ms``, ``status``, ``error``.
    """
    device = tokens.device
    optimizer = optimizer or make_optimizer(model, device)
    step = TrainStep(model, optimizer, tokens, targets, dtype=dtype)
    with activation_checkpointing(model, strategy="nested"):
        step()  # creates the AdamW state
    configs = [("single", k) for k in group_sizes] + ([("nested", None)] if include_nested else [])
    rows = []
    for strategy, k in progress_bar(configs, "checkpoint sweep", progress):
        row = dict(strategy="none" if (strategy == "single" and k is None) else strategy,
                   group_size=k if k is not None else math.nan, peak_gib=math.nan, step_ms=math.nan,
                   step_std_ms=math.nan, status="ok", error="")

        def measure(k=k, strategy=strategy):
            with activation_checkpointing(model, group_size=k, strategy=strategy):
                peak = measure_peak_bytes(step, device) / GiB
                timing = time_callable(step, warmup=0, steps=timing_steps, device=device)
            return dict(peak_gib=peak, step_ms=timing.mean_ms, step_std_ms=timing.std_ms)

        rows.append(_measured(row, measure, model, device))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# the notebook's experiments


class MemoryExperiment:
    """The 03 notebook's measurements for one :class:`MemorySetup` on ``device``.

    The model (seeded) is built on first use; snapshots and their HTML pages go to
    ``<artifacts_dir>/03_memory``. Each method measures and returns one table.
    """

    def __init__(self, setup: MemorySetup, device: str | torch.device = "auto",
                 artifacts_dir: str | os.PathLike = "artifacts", seed: int = 0):
        self.setup, self.seed = setup, seed
        self.device = resolve_device(device)
        self.artifacts = paths.resolve(artifacts_dir) / "03_memory"
        self._block_report = None

    @cached_property
    def model(self) -> TransformerLM:
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            return TransformerLM(self.setup.model)

    def snapshot_path(self, name: str) -> Path:
        """Where the snapshot pickle ``name`` (``forward``, ``train_step``) is written."""
        return self.artifacts / f"{name}.pickle"

    def _step(self, context: int, optimizer: bool = True) -> TrainStep:
        tokens, targets = random_batch(self.setup.model, self.setup.batch, self.device, context=context)
        opt = make_optimizer(self.model, self.device) if optimizer else None
        return TrainStep(self.model, opt, tokens, targets, dtype=self.setup.dtype)

    # ---- timelines -------------------------------------------------------------------------------------

    def record_timelines(self) -> pd.DataFrame:
        """Record a forward pass (``forward.pickle``) and two AdamW steps with every block's backward marked
        (``train_step.pickle``) at the timeline context. Returns the peak of each phase of both recordings:
        ``recording``, ``phase``, ``peak_gib``, ``start_gib``, ``end_gib``, the trace indices, ``context``,
        ``dtype``."""
        s = self.setup
        tables = []
        empty_cache()  # what earlier measurements left (an optimizer in a reference cycle) must not count
        step = self._step(s.timeline_context, optimizer=False)
        rec = record_training_snapshot(step, self.snapshot_path("forward"), forward_only=True,
                                       max_entries=s.max_entries)
        tables.append(recording_phase_peaks(rec.snapshot, rec.marks).assign(recording="forward"))
        del rec, step
        empty_cache()
        step = self._step(s.timeline_context)
        rec = record_training_snapshot(step, self.snapshot_path("train_step"), steps=2, blocks=self.model.blocks,
                                       max_entries=s.max_entries)
        tables.append(recording_phase_peaks(rec.snapshot, rec.marks).assign(recording="train_step"))
        del rec, step
        empty_cache()
        df = pd.concat(tables, ignore_index=True).assign(context=s.timeline_context, dtype=s.dtype)
        return df[["recording", "phase", "peak_gib", "start_gib", "end_gib", "start_index", "end_index",
                   "peak_index", "context", "dtype"]]

    def _recording(self, name: str) -> tuple[dict, list, list]:
        path = self.snapshot_path(name)
        if not path.exists():
            raise FileNotFoundError(f"no snapshot {path}: run record_timelines() first")
        return load_snapshot(path), load_marks(path), load_marks(path, "detail_marks")

    def largest_allocations(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` largest allocations of the recorded forward pass, with the code that made them."""
        snapshot, marks, _ = self._recording("forward")
        return largest_allocations(snapshot, n=n, marks=marks, phase="forward 1")

    def allocations_by_origin(self, n: int = 10) -> pd.DataFrame:
        """The recorded forward pass's allocations grouped by the line of user code that made them."""
        snapshot, marks, _ = self._recording("forward")
        return allocations_by_origin(snapshot, marks=marks, phase="forward 1").head(n)

    def gradients_per_block(self) -> pd.DataFrame:
        """:func:`gradient_memory_per_block` of the recorded training step's first backward."""
        snapshot, marks, detail = self._recording("train_step")
        return gradient_memory_per_block(snapshot, marks, detail, self.model.blocks)

    def phase_peaks(self, steps: int = 2) -> pd.DataFrame:
        """:func:`lab.measure.step.peak_memory_by_phase` of ``steps`` AdamW steps at the timeline context."""
        empty_cache()
        with silenced_native_stderr(self.device.type == "cpu"):
            return peak_memory_by_phase(self._step(self.setup.timeline_context), steps=steps)

    def peak_memory(self, progress: bool = True) -> pd.DataFrame:
        """:func:`peak_memory_table` over the setup's contexts and dtypes, with the model's ``size``."""
        s = self.setup
        empty_cache()
        return peak_memory_table(self.model, s.peak_contexts, s.peak_dtypes, batch=s.batch,
                                 progress=progress).assign(size=s.size)

    # ---- what is saved for the backward ----------------------------------------------------------------

    def _block(self):
        if self._block_report is None:
            s = self.setup
            x = torch.randn(s.batch, s.block_context, s.model.d_model, device=self.device, requires_grad=True)
            with autocast(self.device, s.dtype):
                self._block_report = saved_tensor_report(self.model.blocks[0], x)
        return self._block_report

    def block_saved_by_op(self) -> pd.DataFrame:
        """What one TransformerBlock saves for the backward at the block context, per operation (bytes, MiB,
        share), with ``context``, ``batch``, ``dtype`` and ``input_bytes`` (the block's fp32 input)."""
        s = self.setup
        return self._block().by_op().assign(context=s.block_context, batch=s.batch, dtype=s.dtype,
                                            input_bytes=s.residual_bytes(s.block_context))

    def block_saved_by_module(self, depth: int = 2) -> pd.DataFrame:
        """The same bytes per submodule of the block (``attn``, ``ffn.w2``, ...)."""
        s = self.setup
        return self._block().by_module(depth=depth).assign(context=s.block_context, dtype=s.dtype)

    def rmsnorm_saved(self) -> pd.DataFrame:
        """What one RMSNorm saves for the backward, eager and (with ``compile_rmsnorm``) ``torch.compile``'d:
        ``rmsnorm``, ``saved_bytes``, ``saved_mib``, ``saved_inputs`` (in units of its fp32 input) and
        ``ops`` (operation: bytes)."""
        s = self.setup
        norm = RMSNorm(s.model.d_model).to(self.device)
        x = torch.randn(s.batch, s.block_context, s.model.d_model, device=self.device, requires_grad=True)
        variants = [("eager", norm)] + ([("compiled", torch.compile(norm))] if s.compile_rmsnorm else [])
        rows = []
        for label, fn in variants:
            rep = saved_tensor_report(norm, x, forward=fn)
            ops = rep.by_op()
            rows.append(dict(rmsnorm=label, saved_bytes=rep.total_bytes, saved_mib=rep.total_bytes / MiB,
                             saved_inputs=rep.total_bytes / (x.numel() * 4), context=s.block_context,
                             ops=", ".join(f"{o} ({b / MiB:,.3g} MiB)" for o, b in ops[["op", "bytes"]].values)))
        return pd.DataFrame(rows)

    # ---- checkpointing ---------------------------------------------------------------------------------

    def checkpoint_sweep(self, modelled: pd.DataFrame | None = None, progress: bool = True) -> pd.DataFrame:
        """:func:`checkpoint_sweep` at the checkpoint context for every group size of the setup and the nested
        strategy. With ``modelled`` (:func:`~lab.book.memory.workload.checkpoint_model`), each row also gets its
        modelled activation memory (``modelled_mib``) and the modelled peak ``modelled_peak_gib`` = 4 x the fp32
        parameters (weights, gradients, AdamW's two moments) + the modelled activations."""
        s = self.setup
        empty_cache()
        tokens, targets = random_batch(s.model, s.batch, self.device, context=s.checkpoint_context)
        sweep = checkpoint_sweep(self.model, tokens, targets, s.checkpoint_group_sizes, include_nested=True,
                                 dtype=s.dtype, timing_steps=s.timing_steps, progress=progress)
        empty_cache()
        sweep = sweep.assign(size=s.size, context=s.checkpoint_context, batch=s.batch, dtype=s.dtype)
        if modelled is not None:
            sweep = sweep.merge(modelled[["strategy", "group_size", "modelled_mib"]], on=["strategy", "group_size"],
                                how="left")
            sweep["modelled_peak_gib"] = 4 * s.parameter_bytes / GiB + sweep["modelled_mib"] / 1024
        return sweep
