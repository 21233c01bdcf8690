"""lab.book.memory.bench: the 03 notebook's measurements, on a tiny model on the CPU."""

import math

import pandas as pd
import pytest
import torch

from lab.book.memory import bench as bm
from lab.book.memory.workload import MemorySetup
from lab.measure.step import random_batch
from lab.model import ModelConfig, TransformerLM

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=4, num_heads=2, context_length=32, vocab_size=50)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TransformerLM(TINY)


def test_checkpoint_sweep_rows(tiny):
    tokens, targets = random_batch(TINY, 2, "cpu", context=32)
    sweep = bm.checkpoint_sweep(tiny, tokens, targets, [None, 1], timing_steps=1, progress=False)
    assert sweep["strategy"].tolist() == ["none", "single", "nested"]
    assert sweep["group_size"].isna().tolist() == [True, False, True]
    assert (sweep["status"] == "ok").all() and (sweep["step_ms"] > 0).all()
    # checkpointing every block keeps only block inputs: its peak is below the plain step's
    assert sweep.loc[1, "peak_gib"] < sweep.loc[0, "peak_gib"]
    assert isinstance(tiny.blocks[0], type(tiny.blocks[1])) and len(tiny.blocks) == 4  # blocks restored


def test_checkpoint_sweep_oom_is_a_row(tiny, monkeypatch):
    calls = {"n": 0}

    def fake_peak(fn, device):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        fn()
        return 2**30

    monkeypatch.setattr(bm, "measure_peak_bytes", fake_peak)
    tokens, targets = random_batch(TINY, 2, "cpu", context=16)
    sweep = bm.checkpoint_sweep(tiny, tokens, targets, [None, 2], include_nested=False, timing_steps=1,
                                progress=False)
    assert sweep["status"].tolist() == ["ok", "oom"]
    assert sweep.loc[0, "peak_gib"] == 1.0 and math.isnan(sweep.loc[1, "peak_gib"])
    assert "OutOfMemoryError" in sweep.loc[1, "error"]


def test_experiment_records_timelines_and_gradients(tmp_path):
    setup = MemorySetup(size="tiny-test", model=TINY, batch=2, timeline_context=16, peak_contexts=(16,),
                        peak_dtypes=("fp32",), block_context=16, checkpoint_context=16,
                        checkpoint_group_sizes=(None, 2), compile_rmsnorm=False, timing_steps=1)
    exp = bm.MemoryExperiment(setup, "cpu", tmp_path)
    with pytest.raises(FileNotFoundError, match="record_timelines"):
        exp.largest_allocations()
    phases = exp.record_timelines()
    assert exp.snapshot_path("forward").exists() and exp.snapshot_path("train_step").exists()
    assert phases[phases["recording"] == "train_step"]["phase"].tolist() == [
        "forward 1", "backward 1", "optimizer_step 1", "forward 2", "backward 2", "optimizer_step 2"]
    steps = phases[phases["recording"] == "train_step"].set_index("phase")
    # AdamW's state appears in the first optimizer step: two fp32 moments per parameter and a 4-byte step
    # counter per parameter tensor
    params = list(exp.model.parameters())
    state = 2 * sum(p.numel() * 4 for p in params) + 4 * len(params)
    assert (steps.loc["optimizer_step 1", "end_gib"] - steps.loc["forward 1", "start_gib"]) * 2**30 == state
    grads = exp.gradients_per_block()
    assert grads["block"].tolist() == [0, 1, 2, 3]
    assert (grads.loc[grads["block"] > 0, "ratio"] == 1).all()
    # block 0's window also holds the embedding's gradient
    assert grads.loc[0, "measured_bytes"] - grads.loc[0, "expected_bytes"] == 4 * TINY.vocab_size * TINY.d_model
    largest = exp.largest_allocations(3)
    assert len(largest) == 3 and largest["size_mib"].is_monotonic_decreasing
    ops = exp.block_saved_by_op()
    assert ops["input_bytes"].iloc[0] == 2 * 16 * 32 * 4 and ops["share"].sum() == pytest.approx(1)
    norm = exp.rmsnorm_saved()
    assert norm["rmsnorm"].tolist() == ["eager"] and norm["saved_inputs"].iloc[0] > 1


def test_peak_memory_table_rows_and_oom(tiny, monkeypatch):
    seen = []

    def fake_peak(fn, device):
        fn()
        seen.append(1)
        if len(seen) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return len(seen) * 2**30

    monkeypatch.setattr(bm, "measure_peak_bytes", fake_peak)
    peaks = bm.peak_memory_table(tiny, [8, 16], ["fp32"], batch=2, progress=False)
    assert peaks[["mode", "context"]].values.tolist() == [["forward", 8], ["forward", 16], ["train_step", 8],
                                                           ["train_step", 16]]
    assert peaks["status"].tolist() == ["ok", "ok", "oom", "ok"]
    assert peaks["peak_gib"].tolist()[:2] == [1.0, 2.0] and peaks["peak_gib"].iloc[3] == 4.0
    assert isinstance(peaks, pd.DataFrame)
