"""The LM-head loss benchmark on the CPU with tiny shapes (fused kernels interpreted), and its baselines."""

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from lab.bench import fused_loss as fl


def test_sweep_rows_and_columns():
    df = fl.sweep(impls=("fused", "torch", "torch_chunked"), shapes=[(50, 24, 37)], dtypes=("fp32", "bf16"),
                  device="cpu", cpu_steps=1)
    assert list(df.columns) == fl.COLUMNS
    assert len(df) == 6 and set(df["impl"]) == {"fused", "torch", "torch_chunked"}
    assert (df["status"] == "ok").all() and (df["error"] == "").all()
    assert (df[["vocab", "d_model", "tokens"]].drop_duplicates().values.tolist() == [[50, 24, 37]])
    assert (df["fwdbwd_ms"] > 0).all() and (df["fwd_ms"] > 0).all()
    assert df["peak_extra_gib"].isna().all()  # no CUDA allocator to ask on the CPU
    expected = fl.loss_flops(37, 24, 50) / (df["fwdbwd_ms"] * 1e-3) / 1e12
    assert df["tflops"].to_numpy() == pytest.approx(expected.to_numpy())
    ratios = fl.add_ratios(df, "torch")
    assert ratios.loc[ratios["impl"] == "torch", "time_vs_torch"].tolist() == [1.0, 1.0]
    assert ratios["memory_vs_torch"].isna().all()


def test_torch_compiled_row():
    torch._dynamo.reset()
    row = fl.benchmark_loss("torch_compiled", 40, 16, 12, "fp32", "cpu", cpu_steps=1)
    assert row["status"] == "ok" and row["fwdbwd_ms"] > 0


def test_oom_is_a_row_and_other_errors_are_raised_or_recorded():
    def out_of_memory(h, w, t):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.55 GiB")

    row = fl.benchmark_loss("fake", 30, 16, 8, "fp32", "cpu", fn=out_of_memory)
    assert row["status"] == "oom" and row["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert math.isnan(row["fwdbwd_ms"]) and math.isnan(row["tflops"])
    df = fl.sweep(impls=("torch",), shapes=[(30, 16, 8)], device="cpu", fn=out_of_memory)
    assert df["status"].tolist() == ["oom"]  # a sweep records it and goes on

    def broken(h, w, t):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        fl.benchmark_loss("fake", 30, 16, 8, "fp32", "cpu", fn=broken)
    assert fl.benchmark_loss("fake", 30, 16, 8, "fp32", "cpu", fn=broken, record_errors=True)["status"] == "error"
    with pytest.raises(ValueError, match="unknown loss"):
        fl.loss_impl("nope")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_equals_reference(reduction):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(45, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (45,), generator=gen)
    targets[::4] = -100
    ref = F.cross_entropy(hidden @ weight.T, targets, reduction=reduction)
    ref_grads = torch.autograd.grad(3 * ref, (hidden, weight))
    loss = fl.chunked_loss(hidden, weight, targets, reduction, chunk_tokens=8)  # 6 chunks, the last ragged
    grads = torch.autograd.grad(3 * loss, (hidden, weight))  # the upstream gradient scales the stored ones
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    everything_ignored = torch.full_like(targets, -100)
    assert fl.chunked_loss(hidden, weight, everything_ignored, "sum").item() == 0.0
    assert fl.chunked_loss(hidden, weight, everything_ignored, "mean").isnan()


def test_liger_chunk_rule_and_materialized_loss():
    assert fl.liger_chunk_tokens(32768, 4096, 151936) == 1024
    assert fl.liger_chunk_tokens(16384, 768, 10000) == 2048
    h, w, t = fl.make_inputs(20, 8, 6, "fp32")
    torch.testing.assert_close(fl.materialized_loss(h, w, t), F.cross_entropy(h @ w.T, t))


def test_memory_models_meet_the_goal_on_paper():
    """At the goal shape the fused recompute design holds ~0.75 GiB beyond inputs and outputs, under 5% of
    the eager materialized loss (~56 GiB); gradients-in-forward needs the fp32 V x D accumulator."""
    n, d, v = 32768, 4096, 151936
    fused = fl.fused_memory_model(n, d, v)
    eager = fl.materialized_memory_model(n, v)
    assert eager["peak"] / 2**30 == pytest.approx(12 * n * v / 2**30)
    assert fused["peak"] < 0.05 * eager["peak"]
    assert fused["dZ scratch"] == 256 * 2**20 and fused["fp32 d_hidden accumulator"] == n * d * 4
    in_forward = fl.fused_memory_model(n, d, v, grad_in_forward=True)
    assert in_forward["fp32 d_weight accumulator"] == v * d * 4 and in_forward["peak"] > fused["peak"]
    assert isinstance(pd.DataFrame([fused]), pd.DataFrame)
