import json
import math

import pandas as pd
import pytest
import torch

from lab.bench import lm as bench
from lab.model.transformer import ModelConfig, TransformerLM

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=64)


def test_time_callable_counts_calls_and_samples():
    calls = []
    t = bench.time_callable(lambda: calls.append(1), warmup=3, steps=5, device="cpu")
    assert len(calls) == 8 and len(t.samples_ms) == 5
    assert all(s >= 0 for s in t.samples_ms)
    assert t.mean_ms == pytest.approx(sum(t.samples_ms) / 5)


def test_timing_statistics():
    t = bench.Timing([1.0, 2.0, 3.0])
    assert t.mean_ms == 2.0 and t.median_ms == 2.0 and t.std_ms == pytest.approx(1.0)
    assert t.cv == pytest.approx(0.5)


def test_benchmark_lm_all_modes_on_cpu():
    row = bench.benchmark_lm(TINY, context=16, batch=2, warmup=1, steps=2, device="cpu")
    assert row["status"] == "ok"
    for key in ("fwd_ms", "bwd_ms", "fwdbwd_ms", "step_ms"):
        assert row[key] > 0
        assert len(row[key.replace("_ms", "_samples_ms")]) == 2
    assert row["fwdbwd_ms"] >= row["bwd_ms"]
    with torch.device("meta"):
        assert row["params"] == TransformerLM(TINY).num_parameters()
    assert math.isnan(row["peak_gib"])  # no GPU memory counter on the CPU


def test_train_step_changes_weights():
    # the timed train step must really run the optimizer: compare a step's effect against a manual AdamW step
    torch.manual_seed(0)
    model = TransformerLM(TINY)
    before = [p.detach().clone() for p in model.parameters()]
    opt = bench.make_optimizer(model, torch.device("cpu"))
    tokens, targets = bench.random_batch(TINY, 2, "cpu")
    bench.lm_loss(model, tokens, targets).backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_oom_is_a_row_not_a_crash(monkeypatch):
    def boom(self, tokens):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(TransformerLM, "forward", boom)
    df = bench.sweep_lm([TINY, TINY], contexts=[8, 16], warmup=1, steps=1, device="cpu", progress=False)
    assert list(df.status) == ["oom"] * 4
    assert df["fwd_ms"].isna().all() and df["error"].str.contains("out of memory").all()


def test_other_errors_propagate(monkeypatch):
    def bug(self, tokens):
        raise ValueError("a real bug")

    monkeypatch.setattr(TransformerLM, "forward", bug)
    with pytest.raises(ValueError, match="a real bug"):
        bench.benchmark_lm(TINY, context=8, warmup=0, steps=1, device="cpu")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown mode"):
        bench.benchmark_lm(TINY, modes="inference", device="cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        bench.benchmark_lm(TINY, dtype="fp8", device="cpu")
    with pytest.raises(ValueError, match="unknown model size"):
        bench.benchmark_lm("enormous", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            bench.benchmark_lm(TINY, device="cuda")


def test_samples_long_and_table():
    df = pd.DataFrame([bench.benchmark_lm(TINY, context=8, modes="forward", warmup=0, steps=3, device="cpu")])
    long = bench.samples_long(df)
    assert list(long["step"]) == [0, 1, 2] and set(long["phase"]) == {"fwd"}
    assert not any(c.endswith("_samples_ms") for c in bench.lm_step_table(df).columns)


def test_cli_json_and_results(tmp_path, capsys):
    df = bench.main(["--d-model", "32", "--d-ff", "64", "--num-layers", "1", "--num-heads", "4",
                     "--vocab-size", "64", "--context", "8", "16", "--mode", "forward", "--warmup", "0",
                     "--steps", "2", "--device", "cpu", "--json", "--results-dir", str(tmp_path)])
    lines = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
    assert [r["context"] for r in lines] == [8, 16] and len(df) == 2
    assert all(len(r["fwd_samples_ms"]) == 2 for r in lines)


def test_cli_rejects_unknown_size():
    with pytest.raises(SystemExit):
        bench.main(["--size", "gigantic", "--device", "cpu"])


@pytest.mark.slow
def test_warmup_study_runs_fresh_processes():
    wu = bench.warmup_study(TINY, warmups=(0, 2), steps=3, context=8, batch=2, device="cpu", progress=False)
    assert sorted(wu["warmup"].unique()) == [0, 2]
    assert (wu.groupby("warmup")["step"].count() == 3).all() and (wu["fwdbwd_ms"] > 0).all()


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
