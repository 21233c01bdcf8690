"""The language-model benchmark: one row per configuration, each mode with its own time and peak, OOM as a row."""

import math
import statistics
import types

import pandas as pd
import pytest
import torch

from lab.bench import lm as bench
from lab.model import ModelConfig, TransformerLM

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=64)


def test_benchmark_lm_all_modes_on_cpu():
    row = bench.benchmark_lm(TINY, context=16, batch=2, warmup=1, steps=3, device="cpu")
    assert row["status"] == "ok"
    for key in ("fwd", "bwd", "fwdbwd", "step"):  # the record: median, robust spread, count, every sample
        samples = row[f"{key}_samples_ms"]
        assert len(samples) == 3 == row[f"{key}_n"] and row[f"{key}_ms"] == statistics.median(samples)
        deviations = [abs(x - row[f"{key}_ms"]) for x in samples]
        assert row[f"{key}_spread_ms"] == pytest.approx(1.4826 * statistics.median(deviations))
    assert row["fwdbwd_ms"] >= row["bwd_ms"]
    assert math.isnan(row["gpu_busy"]) and row["host_bound"] is False  # no GPU to be busy
    with torch.device("meta"):
        assert row["params"] == TransformerLM(TINY).num_parameters()
    for key in ("fwd", "fwdbwd", "step"):
        assert math.isnan(row[f"{key}_peak_gib"])  # no GPU memory counter on the CPU
    assert row["fused_loss"] is False and row["world_size"] == 1


def test_oom_is_a_row_not_a_crash(monkeypatch):
    def boom(self, tokens, targets=None, reduction="mean"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(TransformerLM, "forward", boom)
    df = bench.sweep_lm([TINY, TINY], contexts=[8, 16], warmup=1, steps=1, device="cpu", progress=False)
    assert list(df.status) == ["oom"] * 4
    assert df["fwd_ms"].isna().all() and df["error"].str.contains("out of memory").all()


def test_other_errors_propagate(monkeypatch):
    def bug(self, tokens, targets=None, reduction="mean"):
        raise ValueError("a real bug")

    monkeypatch.setattr(TransformerLM, "forward", bug)
    with pytest.raises(ValueError, match="a real bug"):
        bench.benchmark_lm(TINY, context=8, warmup=0, steps=1, device="cpu")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown mode"):
        bench.benchmark_lm(TINY, modes="inference", device="cpu")
    with pytest.raises(ValueError, match="unknown training dtype"):
        bench.benchmark_lm(TINY, dtype="fp8", device="cpu")
    with pytest.raises(ValueError, match="unknown model size"):
        bench.benchmark_lm("enormous", device="cpu")
    with pytest.raises(ValueError, match="steps"):
        bench.benchmark_lm(TINY, steps=0, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            bench.benchmark_lm(TINY, device="cuda")


def test_samples_long_and_table():
    df = pd.DataFrame([bench.benchmark_lm(TINY, context=8, modes="forward", warmup=0, steps=3, device="cpu")])
    long = bench.samples_long(df)
    assert list(long["step"]) == [0, 1, 2] and set(long["phase"]) == {"fwd"}
    table = bench.lm_step_table(df)
    assert not any(c.endswith("_samples_ms") for c in table.columns)
    assert list(table.columns[:len(bench.LM_STEP_COLUMNS)]) == bench.LM_STEP_COLUMNS
    back = bench.with_samples(table.assign(context=8.0), long.assign(context=8.0))  # as read back from CSV
    assert back["fwd_samples_ms"].iloc[0] == df["fwd_samples_ms"].iloc[0] and back["step_samples_ms"].iloc[0] == []


def test_compare_variants_one_row_each_in_order():
    df = bench.compare_variants(TINY, [dict(attention="sdpa"), dict(attention="naive"), dict(fused_loss=False)],
                                context=16, batch=2, warmup=0, steps=1, device="cpu", progress=False)
    assert df["attention"].tolist() == ["sdpa", "naive", "sdpa"] and (df["status"] == "ok").all()
    assert (df[["fwd_ms", "fwdbwd_ms", "step_ms"]] > 0).all().all() and (df["world_size"] == 1).all()


def test_oom_in_one_mode_keeps_the_others(monkeypatch):
    real_backward = torch.Tensor.backward

    def backward_oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (mocked)")

    monkeypatch.setattr(torch.Tensor, "backward", backward_oom)
    row = bench.benchmark_lm(TINY, context=8, warmup=1, steps=2, device="cpu")
    monkeypatch.setattr(torch.Tensor, "backward", real_backward)
    assert row["status"] == "oom" and row["fwd_ms"] > 0
    assert math.isnan(row["fwdbwd_ms"]) and math.isnan(row["step_ms"])
    assert "forward_backward" in row["error"] and "train_step" in row["error"]


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, False])  # a forked rank (the CPU's default) or a new interpreter (a GPU's)
def test_warmup_study_runs_fresh_processes(fork):
    wu = bench.warmup_study(TINY, warmups=(0, 2), steps=3, context=8, batch=2, device="cpu", progress=False,
                            fork=fork)
    assert sorted(wu["warmup"].unique()) == [0, 2] and (wu["device"] == "cpu").all()  # the device asked for
    assert (wu.groupby("warmup")["step"].count() == 3).all() and (wu["fwdbwd_ms"] > 0).all()


def test_a_cpu_run_that_cannot_fit_is_not_attempted(monkeypatch):
    monkeypatch.setattr(bench, "predicted_peak_bytes", lambda *a: (2**21, 2**20))  # needs 2 MiB, has 1 MiB
    row = bench.benchmark_lm(TINY, context=16, batch=2, warmup=0, steps=1, device="cpu")
    assert row["status"] == "oom" and row["error"].startswith("not attempted: needs about")
    assert math.isnan(row["fwd_ms"])


def test_a_mode_predicted_beyond_the_device_is_not_attempted(monkeypatch):
    # the train step's kept state "needs" 2x the device; the forward fits and is measured, once
    real = bench.predicted_peak_bytes

    def predicted(cfg, batch, context, dtype, modes, device):
        need, available = real(cfg, batch, context, dtype, modes, device)
        return (2 * available if list(modes) == ["train_step"] else need), available  # 2x: beyond SURE_OOM

    monkeypatch.setattr(bench, "predicted_peak_bytes", predicted)
    row = bench.benchmark_lm(TINY, context=16, batch=2, modes=("forward", "train_step"), warmup=1, steps=3,
                             device="cpu")
    assert row["status"] == "oom" and row["error"].startswith("train_step: not attempted: needs about")
    assert row["fwd_n"] == 3 and math.isnan(row["step_ms"]) and row["step_n"] == 0


def test_gpu_times_name_the_most_host_bound_mode(monkeypatch):
    # each mode's GPU time comes from one profiled run of it; the row's busy share is its lowest
    kernels = {"forward": 3.0, "forward_backward": 9.0, "train_step": 11.0}
    calls = []

    def fake(run, device):
        calls.append(run)
        got = kernels[calls[-1].__defaults__[0]]
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(bench, "gpu_kernel_ms", fake)
    dropped = []  # the gradients are dropped before each profile
    model = types.SimpleNamespace(zero_grad=lambda set_to_none: dropped.append(set_to_none))
    step = types.SimpleNamespace(device=torch.device("cuda"), run=lambda mode: None, model=model)
    row = dict(fwd_ms=10.0, fwdbwd_ms=10.0, step_ms=12.0)
    out = bench.gpu_times(step, ("forward", "forward_backward", "train_step"), row)
    assert (out["fwd_gpu_ms"], out["fwdbwd_gpu_ms"], out["step_gpu_ms"]) == (3.0, 9.0, 11.0) and len(calls) == 3
    assert out["bwd_gpu_ms"] == 6.0 and out["gpu_busy"] == pytest.approx(0.3) and out["host_bound"] is True
    assert dropped == [True, True, True]
    kernels["forward"] = 9.5
    out = bench.gpu_times(step, ("forward", "forward_backward", "train_step"), row)
    assert out["gpu_busy"] == pytest.approx(0.9) and out["host_bound"] is False
    # a profile that runs out of memory leaves its mode without a GPU time, and the sweep goes on
    kernels["forward"] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 MiB")
    out = bench.gpu_times(step, ("forward", "forward_backward"), row)
    assert math.isnan(out["fwd_gpu_ms"]) and out["fwdbwd_gpu_ms"] == 9.0 and out["gpu_busy"] == pytest.approx(0.9)
    # a mode that was not timed (out of memory) is not profiled; a profile that saw no kernel is no share
    kernels["forward"] = math.nan
    out = bench.gpu_times(step, ("forward", "forward_backward"), dict(fwd_ms=10.0, fwdbwd_ms=math.nan))
    assert math.isnan(out["fwd_gpu_ms"]) and "fwdbwd_gpu_ms" not in out and math.isnan(out["gpu_busy"])


def test_a_sweep_takes_back_the_rows_its_log_holds(tmp_path, monkeypatch):
    from lab.measure.results import RowLog

    here = {"commit": "c" * 40, "gpu_name": None, "gpu_count": 0}
    log = RowLog(tmp_path / "lm_step.jsonl", here=here)
    first = bench.sweep_lm([TINY], contexts=[8, 16], warmup=1, steps=1, device="cpu", progress=False, log=log)
    measured = []
    real = bench.benchmark_lm
    monkeypatch.setattr(bench, "benchmark_lm", lambda *a, **k: measured.append(k["context"]) or real(*a, **k))
    again = RowLog(tmp_path / "lm_step.jsonl", reuse=True, here=here)
    df = bench.sweep_lm([TINY], contexts=[8, 16, 32], warmup=1, steps=1, device="cpu", progress=False, log=again)
    assert measured == [32] and again.reused == 2  # only the row the earlier call did not reach
    assert df["fwd_ms"].iloc[:2].tolist() == first["fwd_ms"].tolist()
    assert df["fwd_samples_ms"].iloc[0] == first["fwd_samples_ms"].iloc[0]
    # another warm-up count is another measurement: nothing taken back
    other = RowLog(tmp_path / "lm_step.jsonl", reuse=True, here=here)
    bench.sweep_lm([TINY], contexts=[8], warmup=2, steps=1, device="cpu", progress=False, log=other)
    assert other.reused == 0


def test_compare_variants_takes_back_the_variants_its_log_holds(tmp_path, monkeypatch):
    from lab.measure.results import RowLog

    here = {"commit": "d" * 40, "gpu_name": None, "gpu_count": 0}
    kw = dict(context=8, warmup=1, steps=1, device="cpu", progress=False)
    first = bench.compare_variants(TINY, [dict(attention="sdpa")], log=RowLog(tmp_path / "v.jsonl", here=here), **kw)
    measured = []
    real = bench.benchmark_lm
    monkeypatch.setattr(bench, "benchmark_lm", lambda *a, **k: measured.append(k.get("attention")) or real(*a, **k))
    again = RowLog(tmp_path / "v.jsonl", reuse=True, here=here)
    df = bench.compare_variants(TINY, [dict(attention="sdpa"), dict(attention="naive")], log=again, **kw)
    assert measured == ["naive"] and again.reused == 1
    assert df["attention"].tolist() == ["sdpa", "naive"] and df["fwd_ms"].iloc[0] == first["fwd_ms"].iloc[0]
    # another context is another measurement: nothing taken back
    other = RowLog(tmp_path / "v.jsonl", reuse=True, here=here)
    bench.compare_variants(TINY, [dict(attention="sdpa")], log=other, **{**kw, "context": 16})
    assert other.reused == 0
