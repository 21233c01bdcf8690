"""The 03 notebook's measurements: :class:`MemoryExperiment` runs the memory experiments of one
:class:`~lab.book.memory.workload.MemorySetup` (the measuring is :mod:`lab.bench.memory` and :mod:`lab.measure`)
on a model it builds on first use, so a replayed render (tables read back from ``results/``) never builds it.
"""

from __future__ import annotations

import os
from functools import cached_property

import pandas as pd
import torch

from lab import paths
from lab.bench import memory as bench
from lab.book.claims import number
from lab.book.memory.workload import MemorySetup
from lab.dtypes import autocast
from lab.measure import memory_timeline as timeline
from lab.measure.device import empty_cache, resolve_device
from lab.measure.memory_snapshot import load_marks, load_snapshot
from lab.measure.quiet import silenced_native_stderr
from lab.measure.saved_tensors import saved_tensor_report
from lab.measure.step import TrainStep, make_optimizer, peak_memory_by_phase, random_batch
from lab.model import RMSNorm, TransformerLM
from lab.units import GiB, MiB


class MemoryExperiment:
    """The 03 notebook's measurements for one :class:`MemorySetup` on ``device`` (snapshots and their pages in
    ``<artifacts_dir>/03_memory``); the seeded model is built on first use. Each method returns one table."""

    def __init__(self, setup: MemorySetup, device: str | torch.device = "auto",
                 artifacts_dir: str | os.PathLike = "artifacts", seed: int = 0):
        self.setup, self.seed, self.device = setup, seed, resolve_device(device)
        self.artifacts = paths.resolve(artifacts_dir) / "03_memory"

    @cached_property
    def model(self) -> TransformerLM:
        torch.manual_seed(self.seed)
        with torch.device(self.device):
            return TransformerLM(self.setup.model)

    def snapshot_path(self, name: str):
        """Where the snapshot pickle ``name`` (``forward``, ``train_step``) is written."""
        return self.artifacts / f"{name}.pickle"

    def _batch(self, context: int):  # (tokens, targets)
        return random_batch(self.setup.model, self.setup.batch, self.device, context=context)

    def record_timelines(self) -> pd.DataFrame:
        """:func:`lab.bench.memory.record_step_timelines` (each phase's peak) at the timeline context."""
        s = self.setup
        return bench.record_step_timelines(self.model, *self._batch(s.timeline_context), self.artifacts, s.dtype,
                                           self.model.blocks, s.max_entries).assign(context=s.timeline_context,
                                                                                     dtype=s.dtype)

    def _recording(self, name: str) -> tuple[dict, list, list]:  # snapshot, marks and each block's marks
        if not (path := self.snapshot_path(name)).exists():
            raise FileNotFoundError(f"no snapshot {path}: run record_timelines() first")
        return load_snapshot(path), load_marks(path), load_marks(path, "detail_marks")

    def largest_allocations(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` largest allocations of the recorded forward pass, with the code that made them."""
        snapshot, marks, _ = self._recording("forward")
        return timeline.largest_allocations(snapshot, n=n, marks=marks, phase="forward 1")

    def allocations_by_origin(self, n: int = 10) -> pd.DataFrame:
        """The recorded forward pass's allocations grouped by the line of user code that made them."""
        snapshot, marks, _ = self._recording("forward")
        return timeline.allocations_by_origin(snapshot, marks=marks, phase="forward 1").head(n)

    def gradients_per_block(self) -> pd.DataFrame:
        """:func:`lab.bench.memory.gradient_memory_per_block` of the recorded training step's first backward."""
        return bench.gradient_memory_per_block(*self._recording("train_step"), self.model.blocks)

    def phase_peaks(self, steps: int = 2) -> pd.DataFrame:
        """:func:`lab.measure.step.peak_memory_by_phase` of ``steps`` AdamW steps at the timeline context."""
        empty_cache()
        step = TrainStep(self.model, make_optimizer(self.model, self.device), *self._batch(self.setup.timeline_context),
                         dtype=self.setup.dtype)
        with silenced_native_stderr(self.device.type == "cpu"):
            return peak_memory_by_phase(step, steps=steps)

    def peak_memory(self, progress: bool = True) -> pd.DataFrame:
        """:func:`lab.bench.memory.peak_memory_table` over the setup's contexts and dtypes, with ``size``."""
        s = self.setup
        empty_cache()
        return bench.peak_memory_table(self.model, s.peak_contexts, s.peak_dtypes, batch=s.batch,
                                       progress=progress).assign(size=s.size)

    @cached_property
    def _block(self):
        s = self.setup
        x = torch.randn(s.batch, s.block_context, s.model.d_model, device=self.device, requires_grad=True)
        with autocast(self.device, s.dtype):
            return saved_tensor_report(self.model.blocks[0], x)

    def block_saved_by_op(self) -> pd.DataFrame:
        """What one block saves for the backward at the block context, per operation, and its fp32 input's bytes."""
        s = self.setup
        return self._block.by_op().assign(context=s.block_context, batch=s.batch, dtype=s.dtype,
                                          input_bytes=s.residual_bytes(s.block_context))

    def block_saved_by_module(self, depth: int = 2) -> pd.DataFrame:
        """The same bytes per submodule of the block (``attn``, ``ffn.w2``, ...)."""
        return self._block.by_module(depth=depth).assign(context=self.setup.block_context, dtype=self.setup.dtype)

    def rmsnorm_saved(self) -> pd.DataFrame:
        """What one RMSNorm saves for the backward, eager and (``compile_rmsnorm``) compiled, over its input too."""
        s = self.setup
        norm = RMSNorm(s.model.d_model).to(self.device)
        x = torch.randn(s.batch, s.block_context, s.model.d_model, device=self.device, requires_grad=True)
        rows = []
        for label, fn in [("eager", norm)] + [("compiled", torch.compile(norm))] * s.compile_rmsnorm:
            rep = saved_tensor_report(norm, x, forward=fn)
            rows.append(dict(rmsnorm=label, saved_bytes=rep.total_bytes, saved_mib=rep.total_bytes / MiB,
                             saved_inputs=rep.total_bytes / (x.numel() * 4), context=s.block_context,
                             ops=", ".join(f"{o} ({number(b, 'B')})" for o, b in rep.by_op()[["op", "bytes"]].values)))
        return pd.DataFrame(rows)

    def checkpoint_sweep(self, modelled: pd.DataFrame | None = None, progress: bool = True) -> pd.DataFrame:
        """:func:`lab.bench.memory.checkpoint_sweep` at the checkpoint context, with ``modelled``'s activations
        (:func:`~lab.book.memory.workload.checkpoint_model`) and peak: 4 x the fp32 parameters + those."""
        s = self.setup
        empty_cache()
        sweep = bench.checkpoint_sweep(self.model, *self._batch(s.checkpoint_context), s.checkpoint_group_sizes,
                                       dtype=s.dtype, timing_steps=s.timing_steps, progress=progress)
        empty_cache()
        sweep = sweep.assign(size=s.size, context=s.checkpoint_context, batch=s.batch, dtype=s.dtype)
        if modelled is None:
            return sweep
        sweep = sweep.merge(modelled[["strategy", "group_size", "modelled_mib"]], on=["strategy", "group_size"],
                            how="left")
        return sweep.assign(modelled_peak_gib=4 * s.parameter_bytes / GiB + sweep["modelled_mib"] / 1024)
