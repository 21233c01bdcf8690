"""lab.measure.numerics: accumulation results against float64 re-computations, observed autocast dtypes, norms."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from lab.measure import numerics as precision


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


def test_half_ulp_is_where_an_addend_is_lost():
    assert precision.half_ulp(4.0, "bf16") == 2.0**-6  # bf16 stalls at 4 when adding 0.01 (< 0.0156)
    assert precision.half_ulp(10001.0, "bf16") * 2 == 64.0 and precision.half_ulp(1.0, "fp32") == 2.0**-24
    assert float(torch.tensor(4.0, dtype=torch.bfloat16) + torch.tensor(0.01, dtype=torch.bfloat16)) == 4.0
    assert precision.half_ulp(0.0, "fp16") == 0.0


def _toy():
    return nn.Sequential(nn.Linear(10, 10, bias=False), nn.ReLU(), nn.LayerNorm(10), nn.Linear(10, 5, bias=False))


def test_accumulate_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        precision.accumulate(accumulator="fp8")


@pytest.mark.parametrize("dtype,low", [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32")])
def test_probe_autocast_dtypes_cpu(dtype, low):
    df = precision.probe_autocast_dtypes(_toy(), dtype=dtype, device="cpu").set_index("tensor")["dtype"]
    assert df["param 0.weight"] == "fp32"             # autocast never changes parameters
    assert df["0 output"] == low                       # matmuls run in the low precision
    assert df["logits"] == low
    assert df["loss"] == "fp32"                        # cross-entropy is on autocast's fp32 list
    assert df["grad logits"] == low                    # gradients flow back in the activations' dtype
    assert df["grad 0.weight"] == "fp32"               # ...and land in the parameters' dtype


def test_autocast_table_shape():
    t = precision.autocast_dtype_table(_toy, device="cpu")
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


def test_autocast_dtype_tables_on_the_cpu():
    t = precision.autocast_dtype_tables(_toy, "cpu")
    assert set(t["device"]) == {"cpu"}
    assert t.set_index("tensor").loc["0 output", "autocast bf16"] == "bf16"
