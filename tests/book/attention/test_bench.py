"""Tests for lab.book.attention.bench: the implementations by name, the naive grid's rows and the tables built from
them (the closed forms are tested in tests/accounting/test_attention.py)."""

import math

import pandas as pd
import pytest
import torch

from lab.book.attention import bench as ab
from lab.model.attention import naive_attention as model_naive_attention

# ---------------------------------------------------------------------------------------------------------
# The implementations


def test_naive_attention_matches_model_and_sdpa_in_float64():
    q, k, v = (torch.randn(3, 20, 8, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        ours = ab.attention_impl("pytorch_naive", "cpu")(q, k, v, causal)
        torch.testing.assert_close(ours, model_naive_attention(q, k, v, causal))
        sdpa = ab.attention_impl("sdpa", "cpu")
        torch.testing.assert_close(sdpa(q, k, v, causal),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        torch.testing.assert_close(ours, sdpa(q, k, v, causal))


def test_attention_impl_names():
    assert ab.attention_impl("pytorch_naive", "cpu") is ab.naive_attention
    with pytest.raises(ValueError):
        ab.attention_impl("flash3", "cpu")


# ---------------------------------------------------------------------------------------------------------
# The naive grid


def test_naive_memory_check_subtracts_the_baseline():
    row = pd.Series(dict(predicted_saved_mib=8.0, saved_mib=8.0, predicted_before_bwd_mib=10.0,
                         mem_before_bwd_mib=42.0, mem_baseline_mib=32.0, predicted_peak_mib=20.0, peak_mib=62.0))
    check = ab.naive_memory_check(row)
    assert check["measured_mib"].tolist() == [8.0, 10.0, 30.0]
    assert check["measured_over_predicted"].tolist() == [1.0, 1.0, 1.5]


def test_naive_grid_rows_and_memory():
    df = ab.run_naive_grid(ds=(8, 16), seqs=(16, 32), batch=2, passes=2, warmup=0, device="cpu", progress=False)
    assert len(df) == 4
    assert list(zip(df["d"], df["seq_len"])) == [(8, 16), (8, 32), (16, 16), (16, 32)]
    for col in ["impl", "compile", "fwd_ms", "bwd_ms", "mem_before_bwd_mib", "saved_mib", "predicted_saved_mib",
                "status", "note"]:
        assert col in df.columns
    assert (df["status"] == "ok").all() and (df["impl"] == "naive_attention").all()
    assert (df["fwd_ms"] > 0).all() and (df["bwd_ms"] > 0).all()
    # what autograd saved equals the closed form, per configuration
    assert (df["saved_mib"] == df["predicted_saved_mib"]).all()
    assert df.loc[1, "saved_mib"] * 2**20 == 2 * 32 * 32 * 4
    scaling = ab.saved_memory_scaling(df)
    assert scaling["p_all"].tolist() == pytest.approx([2.0, 2.0])
    row, kind = ab.accounting_config(df)
    assert kind == "largest_fit" and row["seq_len"] == 32 and row["d"] == 16


def test_naive_grid_records_oom_rows():
    def always_oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    df = ab.run_naive_grid(always_oom, ds=(8,), seqs=(16, 32), batch=1, passes=1, warmup=0, device="cpu",
                           progress=False)
    assert (df["status"] == "oom").all()
    assert df["note"].str.contains("forward").all() and df["fwd_ms"].isna().all()
    row, kind = ab.accounting_config(df)
    assert kind == "oom" and row["seq_len"] == 16

    class OomInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q * 2

        @staticmethod
        def backward(ctx, grad):
            raise torch.OutOfMemoryError("CUDA out of memory (backward)")

    df = ab.run_naive_grid(lambda q, k, v, causal: OomInBackward.apply(q) + k + v, ds=(8,), seqs=(16,), batch=1,
                           passes=2, warmup=0, device="cpu", impl="bwd_oom", progress=False)
    assert df.loc[0, "status"] == "oom" and "backward" in df.loc[0, "note"]
    assert df.loc[0, "fwd_ms"] > 0 and math.isnan(df.loc[0, "bwd_ms"])

    def other_error(q, k, v, causal):
        raise ValueError("a bug, not a memory problem")

    with pytest.raises(ValueError):
        ab.run_naive_grid(other_error, ds=(8,), seqs=(16,), passes=1, warmup=0, device="cpu", progress=False)


def test_eager_vs_compiled_table():
    eager = pd.DataFrame(dict(d=[16, 16], seq_len=[64, 128], fwd_ms=[2.0, 8.0], bwd_ms=[4.0, 16.0],
                              mem_before_bwd_mib=[1.0, 4.0], saved_mib=[1.0, 4.0], status=["ok", "ok"]))
    compiled = eager.assign(fwd_ms=[1.0, 2.0], bwd_ms=[4.0, 8.0], compile_s=[3.0, 3.0])
    t = ab.eager_vs_compiled(eager, compiled)
    assert t["fwd_speedup"].tolist() == [2.0, 4.0] and t["bwd_speedup"].tolist() == [1.0, 2.0]
    # no spread was recorded: no verdict
    assert t["fwd_verdict"].tolist() == ["", ""]


def test_eager_vs_compiled_verdicts_follow_the_noise():
    """A 2x difference with a 1% spread over 100 passes is "faster"; a 1% difference with a 20% spread is not."""
    eager = pd.DataFrame(dict(d=[16, 16], seq_len=[64, 128], fwd_ms=[2.0, 1.0], fwd_std_ms=[0.02, 0.2],
                              bwd_ms=[4.0, 4.0], bwd_std_ms=[0.04, 0.04], passes=[100, 100],
                              mem_baseline_mib=[10.0, 10.0], mem_before_bwd_mib=[12.0, 14.0], saved_mib=[1.0, 4.0],
                              status=["ok", "ok"]))
    compiled = eager.assign(fwd_ms=[1.0, 0.99], bwd_ms=[8.0, 4.0], mem_before_bwd_mib=[11.0, 14.0])
    t = ab.eager_vs_compiled(eager, compiled)
    assert t["fwd_verdict"].tolist() == ["faster", "within noise"]
    assert t["bwd_verdict"].tolist() == ["slower", "within noise"]
    # memory compared above each configuration's baseline
    assert t["mem_above_baseline_mib_eager"].tolist() == [2.0, 4.0]
    assert t["mem_above_baseline_mib_compiled"].tolist() == [1.0, 4.0]


def test_naive_grid_measures_eager_and_compiled_side_by_side(monkeypatch):
    """compile=(False, True): each configuration eager then compiled, one right after the other."""
    order = []

    def fake_run(fn, compiled, batch, seq, d, dtype, causal, passes, warmup, device, row):
        order.append((d, seq, compiled))
        row.update(fwd_ms=1.0, bwd_ms=2.0)

    monkeypatch.setattr(ab, "_run_naive_config", fake_run)
    df = ab.run_naive_grid(ds=(8, 16), seqs=(32,), passes=1, warmup=0, compile=(False, True), device="cpu",
                           progress=False)
    assert order == [(8, 32, False), (8, 32, True), (16, 32, False), (16, 32, True)]
    assert df["compile"].tolist() == [False, True, False, True]
    assert (df["gpu"] == "cpu").all() and df["gpu_memory_gib"].isna().all()
    with pytest.raises(ValueError):
        ab.run_naive_grid(ds=(8,), seqs=(32,), compile=(), device="cpu", progress=False)


@pytest.mark.slow
def test_compiled_grid_matches_eager_memory():
    df = ab.run_naive_grid(ds=(8,), seqs=(16,), batch=2, passes=2, warmup=1, compile=True, device="cpu",
                           progress=False)
    assert df.loc[0, "status"] == "ok" and bool(df.loc[0, "compile"])
    assert df.loc[0, "compile_s"] > 0 and df.loc[0, "fwd_ms"] > 0 and df.loc[0, "bwd_ms"] > 0


# ---------------------------------------------------------------------------------------------------------
# The whole model, eager against compiled


def test_lm_eager_vs_compiled_runs_each_size_eager_then_compiled(monkeypatch):
    calls = []

    def fake_compare(size, variants, **kwargs):
        calls.append((size, [dict(v) for v in variants], kwargs["modes"]))
        return pd.DataFrame([dict(size=size, compile=bool(v.get("compile", False))) for v in variants])

    monkeypatch.setattr(ab, "compare_variants", fake_compare)
    df = ab.lm_eager_vs_compiled(["tiny", "mini"], context=32, batch=2, dtype="fp32", device="cpu", progress=False)
    assert [c[0] for c in calls] == ["tiny", "mini"]
    assert calls[0][1] == [dict(attention="sdpa"), dict(attention="sdpa", compile=True)]
    assert df["size"].tolist() == ["tiny", "tiny", "mini", "mini"] and df["compile"].tolist() == [False, True] * 2


def test_progress_bar_leaves_the_switch_to_the_environment(monkeypatch):
    """With progress on, no ``disable`` is passed, so tqdm's TQDM_DISABLE default (the renderer's) applies."""
    import tqdm

    calls = []
    monkeypatch.setattr(tqdm, "tqdm", lambda iterable, **kwargs: calls.append(kwargs) or iterable)
    assert list(ab.progress_bar(range(2), "x", progress=True)) == [0, 1]
    ab.progress_bar(range(2), "x", progress=False)
    assert calls == [dict(desc="x"), dict(desc="x", disable=True)]
