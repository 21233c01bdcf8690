"""The LM-head loss benchmark on the CPU with tiny shapes (fused kernels interpreted), and its baselines."""

import json
import math
import sys
import types

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from lab.bench import fused_loss as fl


def test_sweep_rows_and_columns():
    df = fl.sweep(impls=("fused", "fused_recompute", "torch", "torch_chunked"), shapes=[(50, 24, 37)],
                  dtypes=("fp32", "bf16"), device="cpu", cpu_steps=1, check=True)
    assert list(df.columns) == fl.COLUMNS
    assert len(df) == 8 and set(df["impl"]) == {"fused", "fused_recompute", "torch", "torch_chunked"}
    assert (df["status"] == "ok").all() and (df["error"] == "").all()
    assert (df[["vocab", "d_model", "tokens"]].drop_duplicates().values.tolist() == [[50, 24, 37]])
    assert (df["fwdbwd_ms"] > 0).all() and (df["fwd_ms"] > 0).all()
    # each forward+backward keeps its spread, sample count and samples, for the verdicts of 10's loss table
    assert (df["fwdbwd_n"] == 1).all() and (df["fwdbwd_spread_ms"] == 0).all()
    assert [json.loads(x) for x in df["fwdbwd_samples_ms"]] == [[round(m, 4)] for m in df["fwdbwd_ms"]]
    assert df["peak_extra_gib"].isna().all() and df["peak_with_grads_gib"].isna().all()  # no CUDA allocator
    expected = fl.loss_flops(37, 24, 50) / (df["fwdbwd_ms"] * 1e-3) / 1e12
    assert df["tflops"].to_numpy() == pytest.approx(expected.to_numpy())
    # errors against the fp32 reference: fp32 to rounding, bf16 to the rounding of logits, dZ and gradients
    errors = df.set_index(["dtype", "impl"])[["loss_rel_err", "dh_rel_err", "dw_rel_err"]]
    assert (errors.loc["fp32"] < 1e-5).all().all()
    assert (errors.loc["bf16"] < 2e-2).all().all()
    assert (errors.loc["bf16", ["dh_rel_err", "dw_rel_err"]] > 1e-5).all().all()  # bf16 gradients: visibly rounded
    ratios = fl.add_ratios(df, "torch")
    assert ratios.loc[ratios["impl"] == "torch", "time_vs_torch"].tolist() == [1.0, 1.0]
    assert ratios["memory_vs_torch"].isna().all()


def test_an_untimed_row_is_checked_but_not_timed():
    """Interpreted Triton on a CPU: the errors of one forward+backward, no time (it would say nothing)."""
    df = fl.sweep(impls=("fused", "torch"), shapes=[(30, 16, 8)], dtypes=("fp32",), device="cpu", cpu_steps=1,
                  check=True, untimed=("fused",))
    fused, torch_row = df.set_index("impl").loc["fused"], df.set_index("impl").loc["torch"]
    assert fused["status"] == "not timed" and math.isnan(fused["fwdbwd_ms"]) and fused["dw_rel_err"] < 1e-5
    assert torch_row["status"] == "ok" and torch_row["fwdbwd_ms"] > 0


def test_chunk_size_rows_and_unknown_names():
    row = fl.benchmark_loss("fused_chunk16", 40, 16, 37, "fp32", "cpu", cpu_steps=1,
                            reference=fl.reference_loss_and_grads(*fl.make_inputs(40, 16, 37, "fp32")))
    assert row["status"] == "ok" and row["dw_rel_err"] < 1e-5  # 3 token chunks
    with pytest.raises(ValueError, match="unknown loss"):
        fl.loss_impl("fused_chunk")


def test_peers_that_cannot_run_are_rows(monkeypatch):
    """Liger and CCE: a row saying why where they cannot run (CUDA kernels on the CPU, not installed)."""
    df = fl.sweep(impls=("liger", "cce"), shapes=[(30, 16, 8)], device="cpu")
    assert df["status"].tolist() == ["skipped", "skipped"] and df["fwdbwd_ms"].isna().all()
    for name, module in fl.PEERS.items():
        monkeypatch.setitem(sys.modules, module, None)  # a failing import
        with pytest.raises(fl.PeerUnavailable, match="not installed") as info:
            fl.loss_impl(name)
        assert info.value.status == "not installed"


def test_peers_are_called_with_their_own_argument_order(monkeypatch):
    """The peers' entry points, faked: Liger's module takes (weight, hidden, targets), CCE's function
    (hidden, weight, targets); both must give the materialized loss."""
    h, w, t = fl.make_inputs(20, 8, 6, "fp32")
    liger = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    liger.LigerFusedLinearCrossEntropyLoss = lambda: (lambda weight, hidden, targets:
                                                      fl.materialized_loss(hidden, weight, targets))
    cce = types.ModuleType("cut_cross_entropy")
    cce.linear_cross_entropy = fl.materialized_loss
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, liger.__name__, liger)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", cce)
    for name in ("liger", "cce"):
        torch.testing.assert_close(fl.loss_impl(name)(h, w, t), F.cross_entropy(h @ w.T, t))


def test_command_line(tmp_path, capsys):
    code = fl.main(["--shapes", "40x16x12", "--impls", "fused", "torch", "cce", "--dtype", "fp32", "--device", "cpu",
                    "--check", "--results-dir", str(tmp_path)])
    assert code == 0
    df = pd.read_csv(tmp_path / "fused_loss.csv")
    assert df["impl"].tolist() == ["fused", "torch", "cce"] and df["status"].tolist() == ["ok", "ok", "skipped"]
    assert (df["source"] == "lab.bench.fused_loss").all() and (df.loc[:1, "dh_rel_err"] < 1e-5).all()
    assert "| fused " in capsys.readouterr().out
    assert fl.main(["--impls", "nope", "--device", "cpu"]) == 2
    assert fl.main(["--shapes", "40x16", "--device", "cpu"]) == 2


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
    """At the benchmark's shapes both fused designs hold under 5% of the eager materialized loss beyond inputs
    and outputs: gradients in the forward its token chunk, the recompute backward its scratch buffers."""
    for n, d, v in ((32768, 4096, 151936), (16384, 2560, 10000)):
        fused = fl.fused_memory_model(n, d, v)
        eager = fl.materialized_memory_model(n, v)
        assert eager["peak"] == 12 * n * v
        assert fused["peak"] < 0.05 * eager["peak"] and fused["fp32 d_weight accumulator"] == 0
        assert fused["logits chunk"] >= 1024 * v * 2
    recompute = fl.fused_memory_model(32768, 4096, 151936, grad_in_forward=False)
    assert recompute["dZ scratch"] == 256 * 2**20 and recompute["fp32 d_hidden accumulator"] == 32768 * 4096 * 4
    assert recompute["peak"] < 0.05 * fl.materialized_memory_model(32768, 151936)["peak"]
    assert isinstance(pd.DataFrame([recompute]), pd.DataFrame)
