"""lab.book.precision.present: notebook 02's settings and claims, from the real arithmetic experiments and from
small synthetic sweeps (CPU and GPU rows); the claims' values and verdicts are checked, never their wording."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book import claims as cl
from lab.book.precision import present as precision
from lab.measure import numerics
from lab.measure.step import MODES
from tests.book.notebook_code import assert_thin

matplotlib.use("Agg")


def values(claim) -> dict:
    """label -> number (Value: its median; Share: its fraction) or text (Observed), in order."""
    out = {}
    for f in claim.findings:
        if isinstance(f, cl.Value):
            out.setdefault(f.measured.label, f.measured.median)
        elif isinstance(f, cl.Share):
            out.setdefault(f.label, f.fraction)
        elif isinstance(f, cl.Observed):
            out.setdefault(f.label, f.seen)
    return out


def test_settings_quick_and_full():
    quick = precision.PrecisionSettings(quick=True, device="cpu")
    assert quick.sizes == ("tiny", "mini") and quick.context == 64 and quick.device == "cpu"
    assert quick.steps >= 5 and quick.warmup >= 2  # enough samples for a verdict; no cold start timed
    full = precision.PrecisionSettings(quick=False, device="cpu")
    assert full.sizes[:2] == ("small", "medium") and "10B" in full.sizes and full.context == 512
    mine = precision.PrecisionSettings(quick=True, device="cpu", sizes=["tiny"], context=32, steps=7)
    assert (mine.sizes, mine.context, mine.steps) == (("tiny",), 32, 7)
    assert mine.params()["sizes"] == ["tiny"] and mine.params()["quick"] is True
    assert precision.TIMED_MODES == MODES  # timed as 01 times its default context, so the ledger compares like rows


def test_accumulation_claim_from_the_real_experiment():
    acc = numerics.accumulation_experiment()
    v = values(precision.accumulation_claim(acc))
    assert v["exact sum"] == 10 and v["fp16 accumulator"] == 9.953125 and v["bf16 accumulator"] == 4.0
    assert v["fp32 accumulator of the same fp16 addends"] == pytest.approx(10.0021, abs=1e-4)
    assert v["its error"] == pytest.approx(0.046875)  # fp16's error, the first one stated
    assert v["of which storing the addend in fp16"] == pytest.approx(1000 * (0.0100021362 - 0.01), rel=1e-3)
    assert v["half a unit in the last place of bf16 at that sum"] == 2.0**-6  # bf16 stalls at 4: 0.01 < 0.0156
    assert "same" in v["an explicit upcast of the fp16 addends"]
    shares = [f for f in precision.accumulation_claim(acc).findings if isinstance(f, cl.Share)]
    assert [s.fraction for s in shares] == [pytest.approx(0.6)]  # bf16's error: 6 of 10


def test_accumulation_claim_follows_the_data():
    acc = numerics.accumulation_experiment(count=10)  # too few additions for bf16 to stall
    claim = precision.accumulation_claim(acc)
    assert "half a unit in the last place of bf16 at that sum" not in values(claim)
    assert "8 significant" not in claim.because
    changed = acc.copy()
    changed.loc[(changed.accumulator == "fp32") & (changed.addend == "fp16") & ~changed.upcast, "result"] = 0.5
    assert "different" in values(precision.accumulation_claim(changed))["an explicit upcast of the fp16 addends"]


def test_autocast_claim_on_a_cpu_render():
    probe = numerics.autocast_dtype_tables(precision.ToyModel, "cpu")
    claim = precision.autocast_claim(probe)
    v = values(claim)
    assert "cpu" in v["probed"]
    assert v["parameters"] == "fp32 / fp32" and v["first Linear's output"] == "fp16 / bf16"
    assert v["LayerNorm output"] == "fp16 / bf16" and v["loss"] == "fp32 / fp32"
    assert v["parameter gradients"] == "fp32 / fp32" and v["gradient arriving at the logits"] == "fp16 / bf16"
    assert "GPU" in claim.because  # the CPU's LayerNorm rule is said not to hold on GPUs


def test_autocast_claim_compares_gpu_and_cpu():
    cpu = numerics.autocast_dtype_tables(precision.ToyModel, "cpu")
    cuda = cpu.assign(device="cuda")
    cuda.loc[cuda["tensor"] == "ln output", ["autocast fp16", "autocast bf16"]] = "fp32"  # CUDA's autocast
    claim = precision.autocast_claim(pd.concat([cuda, cpu], ignore_index=True))
    v = values(claim)
    assert "cuda" in v["probed"] and v["LayerNorm output"] == "fp32 / fp32"
    assert v["LayerNorm output under bf16 autocast on the CPU"] == "bf16" and "CUDA" in claim.because


def test_show_autocast_tables_prints_one_table_per_device(capsys):
    cpu = numerics.autocast_dtype_tables(precision.ToyModel, "cpu")
    precision.show_autocast_tables(pd.concat([cpu.assign(device="cuda"), cpu], ignore_index=True))
    headings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("**")]
    assert [h.strip("*").split()[-1] for h in headings] == ["cuda", "cpu"]


def test_norm_claim_overflow_and_cancellation():
    norm = numerics.norm_statistics_demo(d_model=256)
    claim = precision.norm_claim(norm)
    v = values(claim)
    assert v["mean of squares of N(0, 300^2) activations"] == pytest.approx(90855, rel=0.01)
    assert math.isinf(v["in fp16"]) and v["largest error of fp16's normalised output"] > 1  # output collapses
    assert v["bf16's relative error"] < 0.01  # bf16 has fp32's exponent range
    assert v["variance E[x²] − E[x]² of N(100, 1) activations"] == pytest.approx(1.04, abs=0.01)
    bf16 = [f.measured.median for f in claim.findings if isinstance(f, cl.Value) and f.measured.label == "in bf16"]
    assert bf16 == [4.0] and v["one bf16 step at that size"] == 64  # E[x^2] ~ 1e4 in [8192, 16384)
    assert "65504" in claim.because
    assert len(precision.norm_error_table(norm)) == 9


def test_norm_claim_without_overflow():
    claim = precision.norm_claim(numerics.norm_statistics_demo(d_model=64, scales=(1.0, 50.0)))
    v = values(claim)
    assert math.isfinite(v["in fp16"]) and "largest error of fp16's normalised output" not in v
    assert "65504" not in claim.because


# ---- 4. timings -----------------------------------------------------------------------------------------

TIGHT = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.01]


def _row(size, dtype, fwd, fwdbwd, params, **extra):
    row = dict(size=size, context=64, batch=4, dtype=dtype, attention="sdpa", compile=False, fused_loss=False,
               status="ok", params=params, device="cuda:0", gpu_busy=0.95, host_bound=False)
    for col, scale in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        samples = [scale * x for x in TIGHT] if scale else []
        row.update({f"{col}_ms": scale * 1.0 if scale else math.nan, f"{col}_samples_ms": samples,
                    f"{col}_spread_ms": 0.01 * (scale or 0), f"{col}_n": len(samples)})
    return {**row, **extra}


def _lm(device="cuda:0"):
    return pd.DataFrame([_row("large", "fp32", 40.0, 120.0, 1e9), _row("large", "bf16", 10.0, 30.0, 1e9),
                         _row("small", "fp32", 4.0, 12.0, 1e8, fwd_gpu_ms=3.8),
                         _row("small", "bf16", 4.0, 12.5, 1e8, gpu_busy=0.4, host_bound=True, fwd_gpu_ms=1.5),
                         _row("huge", "fp32", 0, 0, 1e10, status="oom", limit_gib=79.2),
                         _row("huge", "bf16", 300.0, 0, 1e10, status="oom", limit_gib=79.2)]).assign(device=device)


def test_dtype_comparisons_follow_the_rule_and_count_every_size():
    pairs = precision.dtype_comparisons(_lm())
    assert [(k["size"], k["mode"]) for k, _ in pairs][:2] == [("small", "forward"), ("small", "forward+backward")]
    by = {(k["size"], k["mode"]): f for k, f in pairs}
    assert by[("large", "forward+backward")].verdict == "faster"
    assert by[("large", "forward+backward")].comparison.ratio == pytest.approx(0.25)
    # the host's launches paced the small bf16 row: its time decides nothing, its GPU time is compared instead
    assert by[("small", "forward")].verdict == "host-bound" and by[("small", "forward")].goal_word == ""
    assert by[("small", "forward")].gpu_ratio == pytest.approx(1.5 / 3.8)
    assert math.isnan(by[("small", "forward+backward")].gpu_ratio)  # not profiled in this table
    assert by[("huge", "forward")].verdict == "out of memory at 79 GiB"  # the fp32 side did not fit
    claim = precision.speedup_claim(pairs, _lm())
    tallies = [f for f in claim.findings if isinstance(f, cl.Tally)]
    fb = tallies[0].counts()
    assert sum(fb.values()) == 3 and fb["faster"] == 1 and fb["out of memory at 79 GiB"] == 1
    assert fb["host-bound"] == 1
    ends = [f for f in claim.findings if isinstance(f, cl.Versus)]
    assert [f.subject.label for f in ends] == ["bf16 autocast, small, forward+backward",
                                               "bf16 autocast, large, forward+backward"]
    shares = [f for f in claim.findings if isinstance(f, cl.Share)]
    assert [s.fraction for s in shares] == [0.4] and "small" in shares[0].label  # the host-bound row, named
    table = precision.speedup_table(pairs)
    assert list(table.columns[:4]) == ["size", "mode", "bf16", "fp32"] and len(table) == 6


def test_speedup_claim_on_a_cpu_says_what_does_not_carry_over():
    lm = _lm("cpu")
    claim = precision.speedup_claim(precision.dtype_comparisons(lm), lm)
    assert claim.because == precision.CPU_CAVEAT and not [f for f in claim.findings if isinstance(f, cl.Share)]
    none = _lm().assign(host_bound=False)
    observed = [f for f in precision.speedup_claim(precision.dtype_comparisons(none), none).findings
                if isinstance(f, cl.Observed)]
    assert [o.seen for o in observed] == ["none"]  # a GPU render says no row was host-bound


def test_timing_table_and_plot():
    shown = precision.timing_table(_lm())
    assert "fwd_spread_ms" in shown and "fwd_median_ms" not in shown and shown["params_M"].iloc[0] == 1000
    pairs = precision.dtype_comparisons(_lm())
    ax = precision.plot_speedup(pairs, _lm(), title="t").axes[0]
    assert ax.get_xscale() == "log" and ax.get_title() == "t"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "forward+backward"]
    assert sorted({t.get_text() for t in ax.texts}) == ["large", "small"]  # huge ran out of memory


def test_notebook_holds_no_logic():
    assert_thin("02_mixed_precision", 70)
