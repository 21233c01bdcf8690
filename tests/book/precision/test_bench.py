"""lab.book.precision.bench: accumulation results against float64 re-computations, observed autocast dtypes, norms."""

import math

import numpy as np
import pytest
import torch

from lab.book.precision import bench as precision


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


def _samples(size, dtype, phase, values, context=64):
    return [dict(size=size, context=context, dtype=dtype, phase=phase, step=i, ms=v) for i, v in enumerate(values)]


def test_speedup_table_uses_medians_and_verdicts():
    import pandas as pd

    rows = (_samples("a", "fp32", "fwd", [10.0, 10.1, 9.9, 10.0, 50.0])      # one outlier: the median ignores it
            + _samples("a", "bf16", "fwd", [4.0, 4.1, 3.9, 4.0, 4.0])
            + _samples("a", "fp32", "fwdbwd", [30.0, 20.0, 40.0, 25.0, 35.0])  # noisy and overlapping
            + _samples("a", "bf16", "fwdbwd", [28.0, 33.0, 22.0, 38.0, 30.0])
            + _samples("b", "fp32", "fwd", [8.0, 8.1, 7.9])                    # bf16 ran out of memory
            + _samples("b", "fp32", "fwdbwd", [9.0, 9.1, 8.9]))
    s = precision.speedup_table(pd.DataFrame(rows)).set_index(["size", "phase"])
    assert s.loc[("a", "fwd"), "speedup"] == pytest.approx(10.0 / 4.0)
    assert s.loc[("a", "fwd"), "fp32_median_ms"] == 10.0 and s.loc[("a", "fwd"), "n_bf16"] == 5
    assert s.loc[("a", "fwd"), "verdict"] == "faster"
    assert s.loc[("a", "fwd"), "speedup_low"] <= 2.5 <= s.loc[("a", "fwd"), "speedup_high"]
    assert s.loc[("a", "fwdbwd"), "verdict"] == "within noise"
    assert s.loc[("a", "fwdbwd"), "mode"] == "forward+backward"
    assert s.loc[("b", "fwd"), "verdict"] == "not measured" and math.isnan(s.loc[("b", "fwd"), "speedup"])
    assert list(s.index.get_level_values("size")) == ["a", "a", "b", "b"]


def test_speedup_table_one_sample_makes_no_claim():
    import pandas as pd

    rows = _samples("a", "fp32", "fwd", [10.0]) + _samples("a", "bf16", "fwd", [1.0])
    s = precision.speedup_table(pd.DataFrame(rows), phases=("fwd",)).iloc[0]
    assert s["speedup"] == 10.0 and s["verdict"] == "within noise" and math.isnan(s["speedup_low"])


def test_speedup_table_by_context():
    import pandas as pd

    rows = [r for c in (32, 64) for r in _samples("a", "fp32", "fwd", [2.0 * c, 2.0 * c + 1], context=c)
            + _samples("a", "bf16", "fwd", [c, c + 1.0], context=c)]
    s = precision.speedup_table(pd.DataFrame(rows), keys=("size", "context"), phases=("fwd",))
    assert s["context"].tolist() == [32, 64]
    assert s["speedup"].tolist() == pytest.approx([64.5 / 32.5, 128.5 / 64.5])


def test_speedup_table_from_a_real_sweep():
    from lab.bench.lm import samples_long, sweep_lm
    from lab.model import ModelConfig

    cfg = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=2, context_length=16, vocab_size=50)
    df = sweep_lm([cfg], contexts=[16], dtypes=["fp32", "bf16"], batch=2, warmup=0, steps=3, device="cpu",
                  progress=False)
    assert list(df["dtype"]) == ["fp32", "bf16"]
    assert (df["status"] == "ok").all() and (df["fwd_ms"] > 0).all() and (df["fwdbwd_ms"] > 0).all()
    table = precision.speedup_table(samples_long(df)).set_index("phase")
    assert table.loc["fwd", "speedup"] == pytest.approx(df["fwd_median_ms"].iloc[0] / df["fwd_median_ms"].iloc[1])
    assert table.loc["fwd", "n_fp32"] == 3
    assert table.loc["fwd", "verdict"] in ("faster", "slower", "within noise")


def test_autocast_dtype_tables_on_the_cpu():
    t = precision.autocast_dtype_tables("cpu")
    assert set(t["device"]) == {"cpu"}
    assert t.set_index("tensor").loc["fc1 output", "autocast bf16"] == "bf16"
