"""lab.bench.precision: accumulation results against float64 re-computations, observed autocast dtypes, norms."""

import math

import numpy as np
import pytest
import torch

from lab.bench import precision


def _simulate(value, count, acc_dtype, add_dtype):
    """Reference: the same loop in numpy (fp16 has a numpy type; bf16 is simulated by rounding fp32)."""
    if "bfloat16" in (acc_dtype, add_dtype):
        def bf16(v):  # round-to-nearest-even to 8 significant bits via torch as an independent path
            return float(torch.tensor(float(v), dtype=torch.float32).to(torch.bfloat16).double())
        rnd_acc = bf16 if acc_dtype == "bfloat16" else (lambda v: float(np.float32(v)))
        x = bf16(value)
        s = 0.0
        for _ in range(count):
            s = rnd_acc(s + x)
        return s
    acc_t, add_t = np.dtype(acc_dtype).type, np.dtype(add_dtype).type
    s, x = acc_t(0), add_t(value)
    for _ in range(count):
        s = acc_t(s + acc_t(x))
    return float(s)


def test_accumulation_table():
    df = precision.accumulation_experiment().set_index(["accumulator", "addend", "upcast"])
    assert df.loc[("fp32", "fp32", False), "result"] == _simulate(0.01, 1000, "float32", "float32")
    assert df.loc[("fp16", "fp16", False), "result"] == _simulate(0.01, 1000, "float16", "float16")
    assert df.loc[("fp32", "fp16", True), "result"] == _simulate(0.01, 1000, "float32", "float16")
    assert df.loc[("bf16", "bf16", False), "result"] == _simulate(0.01, 1000, "bfloat16", "bfloat16")
    assert df.loc[("fp32", "bf16", True), "result"] == _simulate(0.01, 1000, "float32", "bfloat16")
    # implicit promotion (in-place add into fp32) gives the same as the explicit upcast
    assert df.loc[("fp32", "fp16", False), "result"] == df.loc[("fp32", "fp16", True), "result"]
    # accumulating in fp16 rounds every partial sum: far worse than accumulating the same addends in fp32
    assert df.loc[("fp16", "fp16", False), "abs_error"] > 10 * df.loc[("fp32", "fp16", False), "abs_error"]
    # with an fp32 accumulator the error is (almost) only the addend's representation error
    row = df.loc[("fp32", "fp16", True)]
    assert row["abs_error"] == pytest.approx(abs(row["representation_error"]), rel=0.05)
    assert df["exact"].eq(10.0).all()


def test_accumulate_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        precision.accumulate(accumulator="fp8")


@pytest.mark.parametrize("dtype,low", [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_probe_autocast_dtypes_cpu(dtype, low):
    df = precision.probe_autocast_dtypes(dtype=dtype, device="cpu").set_index("tensor")["dtype"]
    assert df["param fc1.weight"] == "fp32"           # autocast never changes parameters
    assert df["fc1 output"] == low                     # matmuls run in the low precision
    assert df["logits"] == low
    assert df["loss"] == "fp32"                        # cross-entropy is on autocast's fp32 list
    assert df["grad logits"] == low                    # gradients flow back in the activations' dtype
    assert df["grad fc1.weight"] == "fp32"             # ...and land in the parameters' dtype


def test_autocast_table_shape():
    t = precision.autocast_dtype_table(device="cpu")
    assert list(t.columns) == ["tensor", "no autocast", "autocast fp16", "autocast bf16", "kind"]
    assert (t["no autocast"] == "fp32").all()


def test_norm_statistics_demo_shows_overflow_and_cancellation():
    df = precision.norm_statistics_demo(d_model=256)
    get = lambda inp, dt, st: df[(df["input"] == inp) & (df["dtype"] == dt) & (df["statistic"] == st)].iloc[0]
    # fp16: squares of N(0, 300^2) values exceed 65504 -> the mean of squares is inf
    assert math.isinf(get("N(0, 300^2)", "fp16", "mean_square")["value"])
    assert get("N(0, 300^2)", "bf16", "mean_square")["rel_error"] < 0.01   # bf16 has fp32's range
    assert get("N(0, 300^2)", "fp32", "mean_square")["rel_error"] < 1e-6
    # bf16 E[x^2] - E[x]^2 with mean 100, std 1: the difference drowns in rounding (ulp of 1e4 is 64)
    assert get("N(100, 1)", "bf16", "variance")["rel_error"] > 1.0
    assert get("N(100, 1)", "fp32", "variance")["rel_error"] < 1e-2
    assert get("N(100, 1)", "bf16", "variance")["reference"] == pytest.approx(1.0, rel=0.2)  # fp64 value


def test_norm_statistics_matches_float64_formula():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    s = precision.norm_statistics(x, "fp64")
    assert s["mean_square"] == pytest.approx(7.5)
    assert s["variance"] == pytest.approx(1.25)
    assert s["rms_output_max_error"] == 0.0


def test_speedup_table():
    import pandas as pd

    t = pd.DataFrame([dict(size="a", dtype="fp32", fwd_ms=10.0, fwdbwd_ms=30.0, params=5),
                      dict(size="a", dtype="bf16", fwd_ms=4.0, fwdbwd_ms=10.0, params=5),
                      dict(size="b", dtype="fp32", fwd_ms=8.0, fwdbwd_ms=math.nan, params=7),
                      dict(size="b", dtype="bf16", fwd_ms=4.0, fwdbwd_ms=math.nan, params=7)])
    s = precision.speedup_table(t).set_index(["size", "mode"])
    assert s.loc[("a", "forward"), "speedup"] == 2.5
    assert s.loc[("a", "forward+backward"), "speedup"] == 3.0
    assert s.loc[("b", "forward"), "speedup"] == 2.0
    assert math.isnan(s.loc[("b", "forward+backward"), "speedup"])


def test_speedup_table_from_a_real_sweep():
    from lab.bench.lm import sweep_lm
    from lab.model import ModelConfig

    cfg = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=2, context_length=16, vocab_size=50)
    df = sweep_lm([cfg], contexts=[16], dtypes=["fp32", "bf16"], batch=2, warmup=0, steps=1, device="cpu",
                  progress=False)
    assert list(df["dtype"]) == ["fp32", "bf16"]
    assert (df["status"] == "ok").all() and (df["fwd_ms"] > 0).all() and (df["fwdbwd_ms"] > 0).all()
    table = precision.speedup_table(df).set_index("mode")
    assert table.loc["forward", "speedup"] == pytest.approx(df["fwd_ms"].iloc[0] / df["fwd_ms"].iloc[1])
