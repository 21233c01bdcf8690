"""lab.book.ddp.bench: what notebook 07 measures in each profile."""

import torch

from lab.book.ddp import bench as ddp_bench


def test_plan_run_profiles():
    quick = ddp_bench.plan_run(True)
    assert quick.device == "cpu" and quick.backend == "gloo" and quick.configs[0]["size"] == "tiny"
    assert quick.bucket_sizes_mb == (0.1, 1, 10) and quick.interleaving.steps_per_round == 1
    assert quick.interleaving.rounds >= 5 and "Quick profile" in quick.note
    custom = ddp_bench.plan_run(True, rounds=7, warmup=0, schedule="rebuild", bucket_sizes_mb=[2])
    assert (custom.interleaving.rounds, custom.interleaving.warmup, custom.bucket_sizes_mb) == (7, 0, (2.0,))
    if torch.cuda.device_count() < 2:  # the full profile falls back to the CPU, and says so
        full = ddp_bench.plan_run(False)
        assert full.device == "cpu" and "needs 2 GPUs" in full.note
    params = quick.params()
    assert params["run_device"] == "cpu" and params["rounds"] == quick.interleaving.rounds
