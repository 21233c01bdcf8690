"""lab.book.precision.present: notebook 02's settings, tables, plot and generated prose, from small synthetic tables
(and the real, fast arithmetic experiments), on CPU and GPU data."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book.precision import bench as experiments
from lab.book.precision import present as precision
from tests.book.profiling.test_present import notebook_code
from tests.book.prose import amounts, bold, counts, has_amount, in_order, numbers, sentence_of, sentence_with, sentences

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
    fp16 = sentences(text)[0]
    assert "fp16" in fp16 and bold(fp16) == ["9.95312"] and numbers(fp16) == [9.95312, 0.0469]  # result, error
    stall = sentence_of(text, 60, "%")  # bf16 stalls at 4 once 0.01 is below half an ulp of the sum
    assert "bf16" in stall and bold(stall) == ["4"] and numbers(stall) == [8, 4, 60, 0.01, 0.0156]  # 2^(2-8)
    upcast = sentence_with(text, "upcast")  # the implicit and explicit upcast agree: no difference
    assert numbers(upcast) == [10.002136, 10.002136] and "no " in upcast
    answer = precision.accumulation_answer(acc)  # the target, then fp16, bf16 and fp32-accumulated results
    assert numbers(answer) == [10, 9.95312, 4, 10.0021] and answer.index("fp16") < answer.index("bf16")


def test_accumulation_paragraph_follows_the_data():
    acc = experiments.accumulation_experiment(count=10)  # too few additions for bf16 to stall
    row = acc.set_index(["accumulator", "addend", "upcast"])
    assert row.loc[("bf16", "bf16", False), "result"] > 0.09
    text = precision.accumulation_paragraph(acc)
    bf16 = sentence_of(text, 0, "%")
    assert "bf16" in bf16 and numbers(bf16) == [8, 0.0996094, 0]  # no stall: no addend or ulp to explain one
    changed = acc.copy()
    changed.loc[(changed.accumulator == "fp32") & (changed.addend == "fp16") & ~changed.upcast, "result"] = 0.5
    upcast = sentence_with(precision.accumulation_paragraph(changed), "upcast")
    assert numbers(upcast) == [0.5, 0.10002136] and "no " not in upcast  # implicit, explicit: they differ


# ---- 2. autocast probe ----------------------------------------------------------------------------------


def test_autocast_paragraph_on_a_cpu_render():
    probe = experiments.autocast_dtype_tables("cpu")
    text = precision.autocast_paragraph(probe)
    fp16 = sentences(text)[0]
    assert "cpu" in fp16.split(",")[0] and "fp16" in fp16.split(",")[1]  # the device, then the autocast dtype
    # parameters, first Linear's output, LayerNorm output, logits, loss, parameter gradients
    assert bold(fp16) == ["fp32", "fp16", "fp16", "fp16", "fp32", "fp32"]
    assert fp16.index("parameters") < fp16.index("Linear") < fp16.index("LayerNorm") < fp16.index("logits")
    assert "GPU" in text  # the CPU's LayerNorm rule is said not to hold on GPUs
    cast, kept, layer_norm = precision.autocast_answer(probe).split(";")
    assert "cpu" in cast and "matmul" in cast and "logits" in cast and "bf16" in cast and "fp32" not in cast
    assert all(w in kept for w in ("parameters", "loss", "gradients", "fp32")) and "bf16" not in kept
    assert "LayerNorm" in layer_norm and "bf16" in layer_norm and "fp32" not in layer_norm


def test_autocast_paragraph_compares_gpu_and_cpu():
    cpu = experiments.autocast_dtype_tables("cpu")
    cuda = cpu.assign(device="cuda")
    ln = cuda["tensor"] == "ln output"
    cuda.loc[ln, ["autocast fp16", "autocast bf16"]] = "fp32"  # what CUDA's autocast does
    probe = pd.concat([cuda, cpu], ignore_index=True)
    tables = precision.autocast_tables(probe)
    assert list(tables) == ["cuda", "cpu"]
    text = precision.autocast_paragraph(probe)
    fp16 = sentences(text)[0]
    assert "cuda" in fp16.split(",")[0] and bold(fp16) == ["fp32", "fp16", "fp32", "fp16", "fp32", "fp32"]
    devices = sentence_with(text, "cuda", "CPU")  # the LayerNorm output per device
    assert "LayerNorm" in devices and bold(devices) == ["fp32", "bf16"] and devices.index("cuda") < devices.index("CPU")
    assert "GPU" not in text  # measured on a GPU: no caveat about GPUs


def test_show_autocast_tables_prints_one_table_per_device(capsys):
    cpu = experiments.autocast_dtype_tables("cpu")
    precision.show_autocast_tables(pd.concat([cpu.assign(device="cuda"), cpu], ignore_index=True))
    out = capsys.readouterr().out
    assert [heading.split()[-1] for heading in bold(out)] == ["cuda", "cpu"]  # one titled table per device


# ---- 3. norm statistics ---------------------------------------------------------------------------------


def test_norm_paragraph_overflow_and_cancellation():
    norm = experiments.norm_statistics_demo(d_model=256)
    text = precision.norm_paragraph(norm)
    overflow, cancellation = sentences(text)[:2]
    assert "N(0, 300^2)" in overflow and "fp16" in overflow and bold(overflow) == ["inf"] and "collapses" in overflow
    assert in_order(overflow, [90855, 65504, 3.8]) and has_amount(overflow, 0.01, "%")  # squares, fp16 max, errors
    assert "N(100, 1)" in cancellation and bold(cancellation) == ["4"]  # bf16's variance, should be 1.04
    assert in_order(cancellation, [1.04, 4, 0, 1.036, 9997, 64])  # E[x^2] ~ 1e4 in [8192, 16384): 2^13 / 2^7
    answer = precision.norm_answer(norm)
    assert "N(0, 300^2)" in answer and "inf" in answer and "N(100, 1)" in answer and has_amount(answer, 286, "%")
    table = precision.norm_error_table(norm)
    assert {"bf16", "fp16", "fp32"} <= set(table.columns) and len(table) == 9


def test_norm_paragraph_without_overflow():
    norm = experiments.norm_statistics_demo(d_model=64, scales=(1.0, 50.0))  # squares up to ~4e4 < 65504
    text = precision.norm_paragraph(norm)
    no_overflow = sentences(text)[0]
    assert "N(0, 50^2)" in no_overflow and bold(no_overflow) == ["2,472"] and "inf" not in no_overflow
    assert amounts(no_overflow) == [(0.0, "%"), (0.03, "%")] and "collapses" not in text  # fp16, bf16 errors


# ---- 4. timings -----------------------------------------------------------------------------------------


def _speed(rows):
    base = dict(mode="forward+backward", phase="fwdbwd", fp32_median_ms=10.0, bf16_median_ms=5.0, n_fp32=5, n_bf16=5)
    return pd.DataFrame([{**base, **r} for r in rows])


def _lm(sizes, device="cuda:0"):
    return pd.DataFrame([dict(size=s, params=p, device=device, dtype=d) for s, p in sizes for d in ("fp32", "bf16")])


def test_speedup_clause_words_come_from_the_verdict():
    row = dict(speedup=2.0, speedup_low=1.8, speedup_high=2.2)
    faster = precision.speedup_clause(pd.Series({**row, "verdict": "faster"}))
    assert "faster" in faster and amounts(faster)[0] == (2, "x") and numbers(faster) == [2, 95, 1.8, 2.2]
    noise = precision.speedup_clause(pd.Series({**row, "verdict": "within noise"}))
    assert "within noise" in noise and "faster" not in noise and numbers(noise) == [2, 95, 1.8, 2.2]
    slow = dict(speedup=0.5, speedup_low=0.4, speedup_high=0.6, verdict="slower")
    slower = precision.speedup_clause(pd.Series(slow))
    assert "slower" in slower and amounts(slower)[0] == (0.5, "x") and numbers(slower) == [0.5, 95, 0.4, 0.6]
    none = dict(speedup=3.0, speedup_low=math.nan, speedup_high=math.nan, verdict="within noise")
    unspread = precision.speedup_clause(pd.Series(none))
    assert "no spread" in unspread and numbers(unspread) == [3] and "faster" not in unspread  # no interval


def test_verdict_counts_and_phrase():
    speed = _speed([dict(size="a", verdict="faster"), dict(size="b", verdict="within noise"),
                    dict(size="c", verdict="not measured")])
    tally = precision.verdict_counts(speed, "forward+backward")
    assert tally == {"faster": 1, "within noise": 1, "slower": 0, "not measured": 1}
    phrase = precision.counts_phrase(tally)
    assert counts(phrase) == [(1, 2)] and numbers(phrase) == [1, 2, 1, 1] and "slower" not in phrase
    assert phrase.index("faster") < phrase.index("within noise") < phrase.index("not measured")
    assert "out of memory" in phrase


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
    (forward,) = [s for s in sentences(gpu) if counts(s) == [(0, 1)]]  # the forward: faster in 0 of 1
    assert "forward" in forward and "within noise" in forward and numbers(forward) == [0, 1, 1]
    assert precision.CPU_BF16_CAVEAT not in gpu and "matmuls" in sentence_with(gpu, "grows")  # the GPU's reason
    cpu = precision.speedup_paragraph(speed, _lm([("small", 1e8), ("large", 1e9)], device="cpu"))
    assert cpu.endswith(precision.CPU_BF16_CAVEAT) and "matmuls" not in sentence_with(cpu, "grows")
    answer = precision.speedup_answer(speed, _lm([("small", 1e8), ("large", 1e9)], device="cpu"))
    assert in_order(answer, [1.5, 4]) and answer.count("(faster)") == 2 and "GPU" in answer


def test_speedup_paragraph_when_nothing_fits():
    speed = _speed([dict(size="a", speedup=math.nan, speedup_low=math.nan, speedup_high=math.nan,
                         verdict="not measured")])
    nothing = precision.speedup_paragraph(speed, _lm([("a", 1e8)]))
    assert not amounts(nothing) and not counts(nothing) and "out of memory" in nothing and "faster" not in nothing
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
    assert "timings" in sentence_with(text, "GPU") and precision.SHARED_CPU_NOTE in text
    precision.show_device_caveat("cuda")
    assert capsys.readouterr().out == ""
    precision.show_device_caveat("cpu")
    assert "Warning" in capsys.readouterr().out


@pytest.mark.parametrize("budget,name", [(70, "02_mixed_precision")])
def test_notebook_holds_no_logic(budget, name):
    lines = notebook_code(name)
    assert len(lines) <= budget, f"{name} has {len(lines)} lines of code (budget {budget})"
    assert not [ln for ln in lines if ln.startswith(("def ", "class ", "for ", "while "))]
    assert all("lambda:" in ln for ln in lines if "lambda" in ln)  # only deferred calls, no arguments
