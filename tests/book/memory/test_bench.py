"""lab.book.memory.bench: the 03 notebook's experiments on a tiny model on the CPU (the measuring itself is tested
in tests/bench/test_memory.py)."""

import pytest

from lab.book.memory import bench as bm
from lab.book.memory.workload import MemorySetup
from lab.model import ModelConfig

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=4, num_heads=2, context_length=32, vocab_size=50)


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


