"""lab.bench.flash: the FlashAttention grid's rows, TFLOP/s, speedups and goals; errors against float64."""

import math

import pandas as pd
import pytest
import torch

from lab.bench import attention as ab
from lab.bench import flash as fl
from lab.model.attention import naive_attention as model_naive_attention


def test_errors_vs_float64():
    def off_by_one_percent(q, k, v, causal):
        return model_naive_attention(q, k, v, causal) * 1.01

    impls = {"sdpa": ab.attention_impl("sdpa", "cpu"), "scaled": off_by_one_percent}
    errs = fl.errors_vs_float64(impls, batch=2, seq=32, d=16, device="cpu").set_index("impl")
    assert (errs.loc["sdpa", ["out", "dq", "dk", "dv"]] < 1e-5).all()
    # a 1% scaled output: the output error is 1% of the largest |output|, and dV (linear in the output
    # scale) is off by 1% of the largest |dV|
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 32, 16, generator=gen).double() for _ in range(4))
    v.requires_grad_()
    ref = model_naive_attention(q, k, v, True)
    (dv,) = torch.autograd.grad(ref, (v,), do)
    assert errs.loc["scaled", "out"] == pytest.approx(0.01 * ref.abs().max().item(), rel=1e-3)
    assert errs.loc["scaled", "dv"] == pytest.approx(0.01 * dv.abs().max().item(), rel=1e-3)




def test_flash_grid_rows_tflops_and_speedups():
    impls = {"pytorch_naive": ab.naive_attention, "sdpa": ab.attention_impl("sdpa", "cpu")}
    df = fl.run_flash_grid(impls, fl.grid_shapes((32, 64), (16,), heads=2), dtypes=("fp32",), cpu_steps=2,
                           device="cpu", progress=False)
    assert len(df) == 4 and (df["status"] == "ok").all()
    assert set(df["impl"]) == {"pytorch_naive", "sdpa"} and (df["heads"] == 2).all() and df["causal"].all()
    for p in fl.PASSES:
        assert (df[f"{p}_ms"] > 0).all()
    r = df.iloc[0]
    assert r["fwd_tflops"] == pytest.approx(4 * 2 * (32 * 33 / 2) * 16 / (r["fwd_ms"] * 1e-3) / 1e12)
    assert r["e2e_tflops"] == pytest.approx(14 * 2 * (32 * 33 / 2) * 16 / (r["e2e_ms"] * 1e-3) / 1e12)
    sp = fl.add_speedups(df)
    sdpa = sp[sp["impl"] == "sdpa"]
    assert sdpa["e2e_speedup_vs_sdpa"].tolist() == [1.0, 1.0]
    naive = sp[sp["impl"] == "pytorch_naive"].iloc[0]
    assert naive["fwd_speedup_vs_sdpa"] == pytest.approx(sdpa.iloc[0]["fwd_ms"] / naive["fwd_ms"])


def test_flash_grid_oom_rows():
    def oom(q, k, v, causal):
        raise torch.OutOfMemoryError("CUDA out of memory")

    df = fl.run_flash_grid({"broken": oom, "pytorch_naive": ab.naive_attention}, fl.grid_shapes((16,), (16,)),
                           dtypes=("fp32",), cpu_steps=1, device="cpu", progress=False)
    broken = df[df["impl"] == "broken"].iloc[0]
    assert broken["status"] == "oom" and "forward" in broken["note"] and math.isnan(broken["fwd_tflops"])
    assert df[df["impl"] == "pytorch_naive"].iloc[0]["status"] == "ok"
    # a memory limit below the naive requirement: recorded as OOM without being attempted
    df = fl.run_flash_grid({"pytorch_naive": ab.naive_attention}, fl.grid_shapes((64,), (16,)), dtypes=("fp32",),
                           cpu_steps=1, device="cpu", memory_limit_gib=1e-6, progress=False)
    assert df.loc[0, "status"] == "oom" and "not attempted" in df.loc[0, "note"]
    # a configuration skipped on purpose is a row that says why
    df = fl.run_flash_grid({"pytorch_naive": ab.naive_attention}, fl.grid_shapes((64,), (16,)), dtypes=("fp32",),
                           cpu_steps=1, device="cpu", skip=lambda impl, shape, dt: "too slow", progress=False)
    assert df.loc[0, "status"] == "skipped" and df.loc[0, "note"] == "too slow"


def test_flash_goals_from_known_times():
    def row(impl, heads, d, fwd, bwd, e2e, dtype="bf16"):
        return dict(impl=impl, dtype=dtype, batch=1, heads=heads, seq_len=4096, d=d, causal=True, fwd_ms=fwd,
                    bwd_ms=bwd, e2e_ms=e2e, status="ok")

    df = pd.DataFrame([
        row("sdpa", 16, 64, 1.0, 2.0, 3.0), row("triton", 16, 64, 0.9, 2.2, 3.1),  # all goals met
        row("sdpa", 32, 128, 4.0, 8.0, 12.0), row("triton", 32, 128, 5.0, 8.0, 12.0),  # fwd too slow
        row("sdpa", 1, 64, 1.0, 1.0, 1.0), row("triton", 1, 64, 9.0, 9.0, 9.0),  # one head: not LM-like, ignored
        row("sdpa", 16, 64, 1.0, 1.0, 1.0, "fp32"), row("triton", 16, 64, 9.0, 9.0, 9.0, "fp32"),  # fp32 ignored
    ])
    g = fl.flash_goals(df).sort_values("heads")
    assert g["heads"].tolist() == [16, 32]
    assert g["fwd_ratio"].tolist() == pytest.approx([1 / 0.9, 0.8])
    assert g["fwd_ok"].tolist() == [True, False] and g["bwd_ok"].tolist() == [True, True]
    assert g["e2e_ok"].tolist() == [True, True]
    s = fl.summarize_goals(g)
    assert s["configs"] == 2 and s["fwd"]["met"] == 1 and s["fwd"]["worst"] == pytest.approx(0.8)
    assert not s["all_met"]
    empty = fl.summarize_goals(fl.flash_goals(df[df["heads"] < 16]))
    assert empty["configs"] == 0 and not empty["all_met"] and math.isnan(empty["e2e"]["worst"])


@pytest.mark.slow
def test_flash_grid_runs_interpreted_triton():
    df = fl.run_flash_grid(("triton", "pytorch_flash", "sdpa"), fl.grid_shapes((32,), (16, 80)), dtypes=("fp32",),
                           cpu_steps=1,
                           device="cpu", progress=False)
    assert (df["status"] == "ok").all() and (df["e2e_ms"] > 0).all()


