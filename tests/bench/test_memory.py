"""lab.bench.memory: snapshots of a training step, peak memory by context and dtype, and activation
checkpointing, measured on a tiny model on the CPU."""

import math

import pandas as pd
import pytest
import torch

from lab.bench import memory as bm
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
    assert (sweep["status"] == "ok").all() and (sweep["step_ms"] > 0).all() and (sweep["step_n"] == 1).all()
    assert all(len(s) == 1 for s in sweep["step_samples_ms"])  # every sample kept beside the median
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
    assert "OutOfMemoryError" in sweep.loc[1, "error"] and sweep.loc[1, "limit_gib"] > 0  # the memory it had


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
    assert peaks["status"].tolist() == ["ok", "ok", "oom", "ok"] and (peaks["limit_gib"] > 0).all()
    assert peaks["peak_gib"].tolist()[:2] == [1.0, 2.0] and peaks["peak_gib"].iloc[3] == 4.0
    assert isinstance(peaks, pd.DataFrame)


def test_record_step_timelines_writes_both_recordings(tiny, tmp_path):
    tokens, targets = random_batch(TINY, 2, "cpu", context=16)
    phases = bm.record_step_timelines(tiny, tokens, targets, tmp_path, blocks=tiny.blocks)
    assert (tmp_path / "forward.pickle").exists() and (tmp_path / "train_step.pickle").exists()
    assert phases.groupby("recording", sort=False)["phase"].apply(list).to_dict() == {
        "forward": ["forward 1", "after forward"],
        "train_step": ["forward 1", "backward 1", "optimizer_step 1", "forward 2", "backward 2", "optimizer_step 2"]}
    assert (phases["peak_gib"] >= phases["start_gib"]).all()
