"""lab.book.precision.present: notebook 02's settings, tables, plot and generated prose, from small synthetic tables
(and the real, fast arithmetic experiments), on CPU and GPU data."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book.precision import bench as experiments
from lab.book.precision import present as precision
from tests.book.prose import counts, in_order, sentence_with

matplotlib.use("Agg")


def test_settings_quick_and_full():
    quick = precision.settings(quick=True, device="cpu")
    assert quick.sizes == ("tiny", "mini") and quick.context == 64 and quick.device == "cpu"
    assert quick.steps >= 7  # one wild sample cannot decide a bootstrap verdict
    full = precision.settings(quick=False, device="cpu")
    assert full.sizes[:2] == ("small", "medium") and "10B" in full.sizes and full.context == 512
    mine = precision.settings(quick=True, device="cpu", sizes=["tiny"], context=32, steps=7)
    assert (mine.sizes, mine.context, mine.steps) == (("tiny",), 32, 7)
    assert mine.params()["sizes"] == ["tiny"] and mine.params()["quick"] is True


def test_num_and_measured_on():
    assert precision.num(1234.4) == "1,234" and precision.num(12.345) == "12.3" and precision.num(math.nan) == "n/a"
    assert precision.num(0.0012345) == "0.00123"
    assert precision.measured_on(pd.DataFrame({"device": ["cuda:0"]})) == "cuda"
    assert precision.measured_on(pd.DataFrame({"device": ["cpu"]})) == "cpu"
    assert precision.measured_on(pd.DataFrame({"gpu": ["NVIDIA H100"]})) == "cuda"


# ---- 1. accumulation ------------------------------------------------------------------------------------


def test_accumulation_paragraph_from_the_real_experiment():
    acc = experiments.accumulation_experiment()
    text = precision.accumulation_paragraph(acc)
    assert "fp16 ends at **9.95312**" in text
    assert "stops at **4** (60% error) once the addend (0.01) is below half a unit" in text
    assert "(0.0156)" in text  # half an ulp of 4 in bf16: 2^(2-8)
    assert "makes no difference" in text
    answer = precision.accumulation_answer(acc)
    assert answer.startswith("Summing to 10:") and "bf16 one at 4" in answer


def test_accumulation_paragraph_follows_the_data():
    acc = experiments.accumulation_experiment(count=10)  # too few additions for bf16 to stall
    row = acc.set_index(["accumulator", "addend", "upcast"])
    assert row.loc[("bf16", "bf16", False), "result"] > 0.09
    text = precision.accumulation_paragraph(acc)
    assert "ends at" in text and "below half a unit" not in text
    changed = acc.copy()
    changed.loc[(changed.accumulator == "fp32") & (changed.addend == "fp16") & ~changed.upcast, "result"] = 0.5
    assert "changes the result" in precision.accumulation_paragraph(changed)


# ---- 2. autocast probe ----------------------------------------------------------------------------------


def test_autocast_paragraph_on_a_cpu_render():
    probe = experiments.autocast_dtype_tables("cpu")
    text = precision.autocast_paragraph(probe)
    assert text.startswith("On cpu, under fp16 autocast the parameters stay **fp32**")
    assert "the LayerNorm output **fp16**" in text
    assert "does not carry over to GPUs" in text
    assert precision.autocast_answer(probe) == ("On cpu: matmul outputs and logits become bf16; parameters, loss "
                                                "and parameter gradients stay fp32; the LayerNorm output is bf16.")


def test_autocast_paragraph_compares_gpu_and_cpu():
    cpu = experiments.autocast_dtype_tables("cpu")
    cuda = cpu.assign(device="cuda")
    ln = cuda["tensor"] == "ln output"
    cuda.loc[ln, ["autocast fp16", "autocast bf16"]] = "fp32"  # what CUDA's autocast does
    probe = pd.concat([cuda, cpu], ignore_index=True)
    tables = precision.autocast_tables(probe)
    assert list(tables) == ["cuda", "cpu"]
    text = precision.autocast_paragraph(probe)
    assert text.startswith("On cuda,") and "the LayerNorm output **fp32**" in text
    assert "differs between devices: **fp32** on cuda, **bf16** on the CPU" in text
    assert "does not carry over" not in text


def test_show_autocast_tables_prints_one_table_per_device(capsys):
    cpu = experiments.autocast_dtype_tables("cpu")
    precision.show_autocast_tables(pd.concat([cpu.assign(device="cuda"), cpu], ignore_index=True))
    out = capsys.readouterr().out
    assert "**Observed dtypes on cuda**" in out and "**Observed dtypes on cpu**" in out


# ---- 3. norm statistics ---------------------------------------------------------------------------------


def test_norm_paragraph_overflow_and_cancellation():
    norm = experiments.norm_statistics_demo(d_model=256)
    text = precision.norm_paragraph(norm)
    assert "For N(0, 300^2) activations" in text and "the fp16 mean of squares is **inf**" in text
    assert "collapses to zero" in text
    assert "one bf16 step is 64" in text  # E[x^2] ~ 1e4 lies in [8192, 16384): 2^13 / 2^7
    assert "N(100, 1) activations" in text
    answer = precision.norm_answer(norm)
    assert "is inf" in answer and "N(100, 1)" in answer
    table = precision.norm_error_table(norm)
    assert {"bf16", "fp16", "fp32"} <= set(table.columns) and len(table) == 9


def test_norm_paragraph_without_overflow():
    norm = experiments.norm_statistics_demo(d_model=64, scales=(1.0, 50.0))  # squares up to ~4e4 < 65504
    text = precision.norm_paragraph(norm)
    assert "For N(0, 50^2) activations" in text and "collapses" not in text and "% off" in text


# ---- 4. timings -----------------------------------------------------------------------------------------


def _speed(rows):
    base = dict(mode="forward+backward", phase="fwdbwd", fp32_median_ms=10.0, bf16_median_ms=5.0, n_fp32=5, n_bf16=5)
    return pd.DataFrame([{**base, **r} for r in rows])


def _lm(sizes, device="cuda:0"):
    return pd.DataFrame([dict(size=s, params=p, device=device, dtype=d) for s, p in sizes for d in ("fp32", "bf16")])


def test_speedup_clause_words_come_from_the_verdict():
    row = dict(speedup=2.0, speedup_low=1.8, speedup_high=2.2)
    assert precision.speedup_clause(pd.Series({**row, "verdict": "faster"})) == \
        "bf16 autocast is 2x faster than fp32 (95% interval 1.8-2.2x)"
    assert precision.speedup_clause(pd.Series({**row, "verdict": "within noise"})).startswith(
        "bf16 autocast is within noise of fp32 (speedup 2x")
    slow = dict(speedup=0.5, speedup_low=0.4, speedup_high=0.6, verdict="slower")
    assert "slower than fp32: 0.5x its speed" in precision.speedup_clause(pd.Series(slow))
    none = dict(speedup=3.0, speedup_low=math.nan, speedup_high=math.nan, verdict="within noise")
    assert "no spread measured" in precision.speedup_clause(pd.Series(none))


def test_verdict_counts_and_phrase():
    speed = _speed([dict(size="a", verdict="faster"), dict(size="b", verdict="within noise"),
                    dict(size="c", verdict="not measured")])
    counts = precision.verdict_counts(speed, "forward+backward")
    assert counts == {"faster": 1, "within noise": 1, "slower": 0, "not measured": 1}
    assert precision.counts_phrase(counts) == ("faster beyond noise in 1 of 2 configurations, within noise in 1, "
                                               "not measured (out of memory) in 1")


def test_size_trend_needs_separated_intervals():
    lm = _lm([("small", 1e8), ("large", 1e9)])
    grows = _speed([dict(size="large", speedup=4.0, speedup_low=3.5, speedup_high=4.5, verdict="faster"),
                    dict(size="small", speedup=1.5, speedup_low=1.2, speedup_high=1.8, verdict="faster")])
    assert precision.size_trend(grows, lm) == "grows"  # ordered by parameters, not by row order
    overlap = grows.assign(speedup_low=[1.0, 1.2], speedup_high=[5.0, 1.8])
    assert precision.size_trend(overlap, lm) == "no trend beyond noise"
    shrinks = grows.assign(speedup=[1.0, 3.0], speedup_low=[0.9, 2.5], speedup_high=[1.1, 3.5])
    assert precision.size_trend(shrinks, lm) == "shrinks"


def test_speedup_paragraph_gpu_and_cpu():
    speed = _speed([dict(size="small", speedup=1.5, speedup_low=1.2, speedup_high=1.8, verdict="faster"),
                    dict(size="large", speedup=4.0, speedup_low=3.5, speedup_high=4.5, verdict="faster"),
                    dict(size="small", mode="forward", phase="fwd", speedup=1.1, speedup_low=0.9, speedup_high=1.3,
                         verdict="within noise")])
    gpu = precision.speedup_paragraph(speed, _lm([("small", 1e8), ("large", 1e9)]))
    assert counts(sentence_with(gpu, "cuda")) == [(2, 2)]  # forward+backward: faster in 2 of 2
    ends = gpu[gpu.index("For small"):]
    small, large = ends.split(";")[:2]
    assert in_order(small, [1.5, 1.2, 1.8]) and "faster" in small  # speedup and its interval
    assert in_order(large, [4, 3.5, 4.5]) and "faster" in large
    assert precision.size_trend(speed, _lm([("small", 1e8), ("large", 1e9)])) == "grows"
    assert in_order(sentence_with(gpu, "grows"), [1.5, 4])
    assert counts(sentence_with(gpu, "forward alone")) == [(0, 1)] and "within noise in 1" in gpu
    assert precision.CPU_BF16_CAVEAT not in gpu
    cpu = precision.speedup_paragraph(speed, _lm([("small", 1e8), ("large", 1e9)], device="cpu"))
    assert cpu.endswith(precision.CPU_BF16_CAVEAT) and "larger models spend" not in cpu
    answer = precision.speedup_answer(speed, _lm([("small", 1e8), ("large", 1e9)], device="cpu"))
    assert in_order(answer, [1.5, 4]) and answer.count("(faster)") == 2 and "GPU" in answer


def test_speedup_paragraph_when_nothing_fits():
    speed = _speed([dict(size="a", speedup=math.nan, speedup_low=math.nan, speedup_high=math.nan,
                         verdict="not measured")])
    assert "no speedup to report" in precision.speedup_paragraph(speed, _lm([("a", 1e8)]))
    assert precision.speedup_answer(speed, _lm([("a", 1e8)])).startswith("Not measured")


def test_timing_and_speedup_tables_for_display():
    lm = pd.DataFrame([dict(size="a", context=64, dtype="fp32", status="ok", params=2e6, fwd_median_ms=1.0,
                            fwd_std_ms=0.1, fwd_peak_gib=math.nan, step_median_ms=math.nan, extra=1)])
    shown = precision.timing_table(lm)
    assert list(shown.columns) == ["size", "context", "dtype", "status", "params_M", "fwd_median_ms", "fwd_std_ms"]
    assert shown["params_M"].iloc[0] == 2.0
    speed = _speed([dict(size="a", speedup=2.0, speedup_low=1.5, speedup_high=2.5, verdict="faster")])
    display = precision.speedup_display(speed)
    assert display["95% interval"].iloc[0] == "1.5-2.5" and display["verdict (bf16)"].iloc[0] == "faster"


def test_plot_speedup_draws_one_line_per_mode():
    speed = _speed([dict(size="small", speedup=1.5, speedup_low=1.2, speedup_high=1.8, verdict="faster"),
                    dict(size="large", speedup=4.0, speedup_low=3.5, speedup_high=4.5, verdict="faster"),
                    dict(size="small", mode="forward", speedup=1.1, speedup_low=0.9, speedup_high=1.3),
                    dict(size="large", mode="forward", speedup=3.1, speedup_low=2.9, speedup_high=3.3)])
    fig = precision.plot_speedup(speed, _lm([("small", 1e8), ("large", 1e9)]), title="t")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_title() == "t"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward+backward", "forward"]
    assert sorted(t.get_text() for t in ax.texts) == ["large", "small"]


def test_device_caveat(capsys):
    assert precision.device_caveat("cuda") is None
    text = precision.device_caveat("cpu")
    assert "timings do not carry over to GPUs" in text and precision.SHARED_CPU_NOTE in text
    precision.show_device_caveat("cuda")
    assert capsys.readouterr().out == ""
    precision.show_device_caveat("cpu")
    assert "Warning" in capsys.readouterr().out


@pytest.mark.parametrize("budget,name", [(70, "02_mixed_precision")])
def test_notebook_holds_no_logic(budget, name):
    from tests.book.profiling.test_present import notebook_code

    lines = notebook_code(name)
    assert len(lines) <= budget, f"{name} has {len(lines)} lines of code (budget {budget})"
    assert not [ln for ln in lines if ln.startswith(("def ", "class ", "for ", "while "))]
    assert all("lambda:" in ln for ln in lines if "lambda" in ln)  # only deferred calls, no arguments
