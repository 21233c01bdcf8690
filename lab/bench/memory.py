"""The 03 notebook's memory experiments on a language model: a training step recorded as a snapshot with
its phases (and each block's backward) marked, gradient memory per block, and peak memory by context
and dtype.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch
from torch import nn

from lab.dtypes import autocast_dtype
from lab.measure.memory_snapshot import MemoryRecording, record_memory_snapshot
from lab.measure.memory_timeline import gradient_bytes_by_window, measure_peak_bytes
from lab.measure.step import TrainStep

MiB = 2**20
GiB = 2**30

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
    try:
        with record_memory_snapshot(path, max_entries=max_entries, device=step.device) as rec:
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
    from tqdm import tqdm

    from lab.measure.device import empty_cache, error_summary, is_oom
    from lab.measure.step import make_optimizer as default_optimizer

    device = next(model.parameters()).device
    vocab = model.cfg.vocab_size
    for d in dtypes:
        autocast_dtype(d)  # a clear error for an unknown name, before anything runs
    make_optimizer = make_optimizer or (lambda m: default_optimizer(m, device))
    optimizer = None

    def batch_of(context: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=gen).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    grid = [(mode, c, d) for mode in ("forward", "train_step") for c in contexts for d in dtypes]
    rows = []
    for mode, context, dt in tqdm(grid, desc="peak memory", disable=not progress):
        if mode == "train_step" and optimizer is None:
            # one unmeasured step at the smallest context, so that every measured step carries the AdamW state
            opt = make_optimizer(model)
            TrainStep(model, opt, *batch_of(min(contexts)), dtype="fp32")()
            optimizer = opt
        step = TrainStep(model, optimizer, *batch_of(context), dtype=dt)
        row = dict(context=context, batch=batch, dtype=dt, mode=mode, peak_gib=math.nan, status="ok", error="")
        try:
            row["peak_gib"] = measure_peak_bytes(lambda s=step, m=mode: s.run(m), device) / GiB
        except Exception as exc:
            if not is_oom(exc):
                raise
            row.update(status="oom", error=error_summary(exc))
        model.zero_grad(set_to_none=True)
        empty_cache()
        rows.append(row)
    return pd.DataFrame(rows)
