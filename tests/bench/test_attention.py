"""lab.bench.attention: the implementations by name and the naive grid's rows (the closed forms are tested in
tests/accounting/test_attention.py)."""

import math

import pytest
import torch

from lab.bench import attention as ab
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


def test_naive_grid_rows_and_memory():
    df = ab.run_naive_grid(ds=(8, 16), seqs=(16, 32), batch=2, passes=5, warmup=0, device="cpu", progress=False)
    assert list(zip(df["d"], df["seq_len"])) == [(8, 16), (8, 32), (16, 16), (16, 32)]
    assert (df["status"] == "ok").all() and (df["impl"] == "naive_attention").all() and (df["oom_phase"] == "").all()
    # medians of every pass, with their spread and count (lab.measure.verdicts.summarize)
    assert (df["fwd_ms"] > 0).all() and (df["bwd_ms"] > 0).all() and (df["fwd_n"] == 5).all()
    assert (df["bwd_n"] == 5).all() and (df["fwd_spread_ms"] >= 0).all()
    assert "fwd_std_ms" not in df and df["limit_gib"].isna().all() and (df["gpu"] == "cpu").all()
    # what autograd saved equals the closed form, per configuration
    assert (df["saved_mib"] == df["predicted_saved_mib"]).all()
    assert df.loc[1, "saved_mib"] * 2**20 == 2 * 32 * 32 * 4


def test_naive_grid_records_oom_rows():
    def always_oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    df = ab.run_naive_grid(always_oom, ds=(8,), seqs=(16, 32), batch=1, passes=1, warmup=0, device="cpu",
                           progress=False)
    assert (df["status"] == "oom").all() and (df["oom_phase"] == "forward").all()
    assert df["fwd_ms"].isna().all() and df["error"].str.contains("OutOfMemoryError").all()

    class OomInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q * 2

        @staticmethod
        def backward(ctx, grad):
            raise torch.OutOfMemoryError("CUDA out of memory (backward)")

    df = ab.run_naive_grid(lambda q, k, v, causal: OomInBackward.apply(q) + k + v, ds=(8,), seqs=(16,), batch=1,
                           passes=2, warmup=0, device="cpu", impl="bwd_oom", progress=False)
    assert df.loc[0, "status"] == "oom" and df.loc[0, "oom_phase"] == "backward"
    assert df.loc[0, "fwd_ms"] > 0 and df.loc[0, "fwd_n"] == 2 and math.isnan(df.loc[0, "bwd_ms"])

    def other_error(q, k, v, causal):
        raise ValueError("a bug, not a memory problem")

    with pytest.raises(ValueError):
        ab.run_naive_grid(other_error, ds=(8,), seqs=(16,), passes=1, warmup=0, device="cpu", progress=False)


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
    with pytest.raises(ValueError):
        ab.run_naive_grid(ds=(8,), seqs=(32,), compile=(), device="cpu", progress=False)


@pytest.mark.slow
def test_compiled_grid_matches_eager_memory():
    df = ab.run_naive_grid(ds=(8,), seqs=(16,), batch=2, passes=2, warmup=1, compile=True, device="cpu",
                           progress=False)
    assert df.loc[0, "status"] == "ok" and bool(df.loc[0, "compile"])
    assert df.loc[0, "compile_s"] > 0 and df.loc[0, "fwd_ms"] > 0 and df.loc[0, "bwd_ms"] > 0
    assert df.loc[0, "saved_mib"] == df.loc[0, "predicted_saved_mib"]
