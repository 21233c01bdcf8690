"""lab.book.ddp.bench: what notebook 07 measures in each profile."""

import contextlib

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


def test_hide_more_times_only_the_rounds_with_the_host_busy(monkeypatch):
    """The loss curves and the profiled step come from the quiet run; the busy one only times the rounds."""
    import pandas as pd

    calls = []

    def measure(part, size, context, batch, world, device, rounds, bucket_mb, loss_steps, profile=True, **kw):
        calls.append((loss_steps, profile))
        losses = pd.DataFrame(dict(entry=["a"] * loss_steps, step=range(loss_steps), loss=[1.0] * loss_steps))
        return pd.DataFrame(dict(entry=["a"], step_ms=[1.0])), losses

    monkeypatch.setattr(ddp_bench.overlap, "measure", measure)
    monkeypatch.setattr(ddp_bench, "busy_host", lambda n: contextlib.nullcontext())
    run = ddp_bench.plan_run(True)
    quiet, busy = run.hide_more(1.0), run.hide_more(1.0, busy=2)
    assert calls == [(run.hide["loss_steps"], True), (0, False)]
    assert quiet["loss_curve"].iloc[0] == "[1.0, 1.0, 1.0]" and busy["loss_curve"].iloc[0] == "[]"
    assert list(busy["busy_host"]) == [2]
