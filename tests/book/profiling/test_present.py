"""lab.book.profiling.present: notebook 01's settings, tables, plots and generated prose, from small synthetic tables
for CPU and GPU renders (one real profile of a toy model checks the profile tables end to end)."""

import math
from functools import partial

import matplotlib
import pandas as pd
import pytest

from lab.book.precision.bench import speedup_table
from lab.book.profiling import kernels as kernel_profiles
from lab.book.profiling import present as profiling
from lab.book.profiling import warmup
from lab.paths import REPO_ROOT
from tests.book.prose import amounts, bold, clause_of, counts, in_order, numbers, sentence_of, sentence_with, sentences

matplotlib.use("Agg")


def notebook_code(name: str) -> list[str]:
    """The non-blank, non-comment lines of the code cells of notebooks/<name>.py."""
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(REPO_ROOT / "notebooks" / f"{name}.py")
    return [ln.strip() for c in nb.cells if c.cell_type == "code" for ln in c.source.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def test_notebook_holds_no_logic():
    lines = notebook_code("01_profiling")
    assert len(lines) <= 100, f"01_profiling has {len(lines)} lines of code (budget 100)"
    assert not [ln for ln in lines if ln.startswith(("def ", "class ", "for ", "while "))]
    assert all("lambda:" in ln for ln in lines if "lambda" in ln)  # only deferred calls, no arguments
    assert any(ln.startswith("replay = False") for ln in lines)


# ---- settings -------------------------------------------------------------------------------------------


def test_settings_quick_full_and_overrides():
    quick = profiling.settings(quick=True, device="cpu")
    assert quick.sizes == ("tiny", "mini") and quick.contexts == (32, 64) and quick.default_context == 64
    assert quick.dtypes == ("fp32", "bf16") and quick.device == "cpu"
    full = profiling.settings(quick=False, device="cpu")
    assert full.sizes == ("small", "medium", "large", "xl", "2.7B", "10B")
    assert full.contexts == (128, 256, 512, 1024) and full.default_context == 512 and full.profile_size == "2.7B"
    mine = profiling.settings(quick=True, device="cpu", sizes=["tiny"], contexts=[16, 32], default_context=16)
    assert mine.sizes == ("tiny",) and mine.contexts == (16, 32)
    with pytest.raises(ValueError, match="default_context=48 is not one of"):
        profiling.settings(quick=True, device="cpu", default_context=48)
    assert mine.params()["contexts"] == [16, 32]


def test_train_step_only_at_the_default_context():
    s = profiling.settings(quick=True, device="cpu")
    assert s.modes_for("tiny", 64) == ("forward", "forward_backward", "train_step")
    assert s.modes_for("tiny", 32) == ("forward", "forward_backward")


def test_warmup_runs_add_cold_processes():
    assert profiling.settings(device="cpu", cold_runs=2).warmup_runs == (0, 0, 1, 2, 5)
    assert profiling.settings(device="cpu", cold_runs=1).warmup_runs == (0, 1, 2, 5)
    assert profiling.settings(device="cpu", cold_runs=3, warmups=(1, 5)).warmup_runs == (0, 0, 0, 1, 5)


def test_device_caveat_only_on_the_cpu(capsys):
    assert profiling.device_caveat("cuda") is None
    caveat = profiling.device_caveat("cpu")  # the claims that do not carry over to GPUs, named
    assert "GPU" in caveat and all(claim in caveat for claim in ("matmul", "bf16", "first step"))
    profiling.show_device_caveat("cpu")
    assert "Warning" in capsys.readouterr().out


def test_size_table_counts_parameters():
    import torch

    from lab.model import TransformerLM, config_for

    t = profiling.size_table(["tiny", "10B"]).set_index("size")
    torch.manual_seed(0)
    assert t.loc["tiny", "params_M"] == TransformerLM(config_for("tiny")).num_parameters() / 1e6
    assert t.loc["10B", "d_model"] == 4608 and t.loc["10B", "params_M"] > 10_000  # counted on meta, no memory


# ---- synthetic sweeps -----------------------------------------------------------------------------------

TIGHT = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.01]  # 7 samples, as the quick profile times


def _samples(spec):
    """spec: {(size, context, dtype): {phase: [ms...]}} -> a samples_long table."""
    return pd.DataFrame([dict(size=s, context=c, dtype=d, attention="sdpa", compile=False, phase=p, step=i, ms=ms)
                         for (s, c, d), phases in spec.items() for p, values in phases.items()
                         for i, ms in enumerate(values)])


def _lm(rows, device="cpu"):
    base = dict(batch=4, attention="sdpa", status="ok", error="", device=device, fwd_std_ms=0.01, bwd_std_ms=0.01,
                step_std_ms=0.01, fwd_ms=1.0, bwd_ms=1.0, step_ms=math.nan, step_median_ms=math.nan)
    return pd.DataFrame([{**base, **r} for r in rows])


def _sweep_spec():
    spec = {}
    for size, scale in (("a", 10.0), ("b", 40.0)):
        for context in (32, 64):
            for dtype, speed in (("fp32", 1.0), ("bf16", 2.0)):
                fwd = [scale * x / speed * context / 64 for x in TIGHT]
                spec[(size, context, dtype)] = {"fwd": fwd, "bwd": [2 * x for x in fwd],
                                                "fwdbwd": [3 * x for x in fwd]}
    # one configuration whose backward is as noisy as it is slow, and one with a wild outlier
    spec[("a", 32, "bf16")]["bwd"] = [1.0, 30.0, 2.0, 25.0, 5.0, 0.5, 12.0]
    spec[("b", 32, "fp32")]["bwd"] = [80.0, 80.5, 79.5, 80.2, 0.5, 80.1, 79.9]
    return spec


def test_backward_ratios_use_medians_and_verdicts():
    ratios = profiling.backward_ratios(_samples(_sweep_spec())).set_index(["size", "context", "dtype"])
    assert len(ratios) == 8
    assert ratios.loc[("a", 64, "fp32"), "ratio"] == pytest.approx(2.0)
    assert ratios.loc[("a", 64, "fp32"), "verdict"] == "higher"
    assert ratios.loc[("a", 32, "bf16"), "verdict"] == "within noise"
    assert ratios.loc[("b", 32, "fp32"), "verdict"] == "higher"  # one wild sample cannot flip the median
    text = profiling.backward_sentence(ratios.reset_index())
    assert counts(text) == [(7, 8)] and numbers(clause_of(text, "within noise"))[0] == 1  # 7 higher, 1 within noise
    assert 2.0 in numbers(sentence_with(text, "FLOPs"))  # the FLOPs' 2x beside the measured ratios
    answer = profiling.backward_answer(ratios.reset_index())
    assert numbers(answer)[:3] == [2.0, 2.0, 4.0] and counts(answer) == [(7, 8)]  # median, range, verdict count


def test_timing_paragraph_quotes_the_tables():
    lm = _lm([dict(size="a", context=64, dtype="fp32", params=1e6, fwd_median_ms=10.0),
              dict(size="b", context=64, dtype="fp32", params=4e6, fwd_median_ms=40.0),
              dict(size="a", context=32, dtype="fp32", params=1e6, fwd_median_ms=5.0, fwd_ms=5.0, fwd_std_ms=1.0),
              dict(size="b", context=32, dtype="fp32", params=4e6, fwd_median_ms=math.nan, status="oom",
                   error="forward_backward: CUDA out of memory; train_step: CUDA out of memory")])
    ratios = profiling.backward_ratios(_samples(_sweep_spec()))
    text = profiling.timing_paragraph(lm, ratios, 64)
    assert numbers(sentence_of(text, 10, "ms")) == [64, 10, 40]  # context; a's and b's forward
    noisy = sentence_of(text, 20, "%")  # the noisiest configuration's spread
    assert counts(noisy) == [(1, 4)] and 20 in numbers(noisy) and "fwd" in noisy
    from_csv = profiling.timing_paragraph(lm.astype({"context": float}), ratios, 64)  # NaN rows make ints floats
    assert in_order(sentence_of(from_csv, 20, "%"), [32]) and "32.0" not in from_csv
    oom = sentences(text)[-1]  # the configuration that ran out of memory, and in which modes
    assert numbers(oom) == [32] and "b" in oom.split() and "a" not in oom.split() and "fp32" in oom
    assert "forward_backward" in oom and "train_step" in oom and "ms" not in oom
    noisy_fwd = lm.iloc[:2].assign(fwd_std_ms=[2.0, 50.0])  # b's spread exceeds its 40 ms median
    forward = sentence_of(profiling.timing_paragraph(noisy_fwd, ratios, 64), 10, "ms")
    assert numbers(forward) == [64, 10, 50] and "noisy" in forward  # b's 40 ms is not quoted
    quiet = profiling.timing_paragraph(lm.iloc[:2], ratios, 64)
    assert "worst for" not in quiet and 5 in numbers(quiet)  # no noisy configuration; the 5% threshold named


def test_step_answer_per_dtype():
    lm = _lm([dict(size="b", context=64, dtype="fp32", params=4e6, step_median_ms=120.0),
              dict(size="a", context=64, dtype="fp32", params=1e6, step_median_ms=30.0),
              dict(size="a", context=64, dtype="bf16", params=1e6, step_median_ms=20.0),
              dict(size="a", context=32, dtype="fp32", params=1e6)])
    parts = profiling.step_parts(lm, 64)
    assert [(p["dtype"], p["size"], p["median_ms"]) for p in parts] == [("fp32", "a", 30.0), ("fp32", "b", 120.0),
                                                                          ("bf16", "a", 20.0)]
    fp32, bf16 = profiling.step_answer(lm, 64).split(";")
    assert numbers(fp32) == [64, 4, 30, 120] and numbers(bf16) == [20]
    assert profiling.step_parts(lm, 32) == [] and 32 in numbers(profiling.step_answer(lm, 32))


def test_step_answer_leaves_out_noise_and_flags_an_inverted_order():
    lm = _lm([dict(size="a", context=64, dtype="fp32", params=1e6, step_median_ms=354.0, step_std_ms=286.0),
              dict(size="b", context=64, dtype="fp32", params=4e6, step_median_ms=107.0, step_std_ms=2.0),
              dict(size="a", context=64, dtype="bf16", params=1e6, step_median_ms=30.0, step_std_ms=45.0)])
    parts = {(p["dtype"], p["size"]): p for p in profiling.step_parts(lm, 64)}
    assert parts[("fp32", "a")]["quotable"] and not parts[("bf16", "a")]["quotable"]  # std 45 > median 30
    fp32, bf16 = profiling.step_answer(lm, 64).split(";")
    assert "load" in fp32  # the smaller model measured slower: flagged, not explained as a finding
    assert "too noisy" in bf16 and numbers(bf16) == [45, 30]


def test_plot_timings_one_line_per_size_and_dtype():
    rows = [dict(size=s, context=c, dtype=d, params=1, fwd_median_ms=c * 1.0, bwd_median_ms=c * 2.0)
            for s in ("a", "b") for c in (32, 64) for d in ("fp32", "bf16")]
    fig = profiling.plot_timings(_lm(rows))
    left, right = fig.axes
    assert (left.get_title(), right.get_title()) == ("forward", "backward")
    assert len(left.lines) >= 4 and left.get_xscale() == "log"
    assert len(right.get_legend().get_texts()) == 4


# ---- bf16 at every context ------------------------------------------------------------------------------


def test_dtype_paragraph_counts_verdicts_and_warns_on_the_cpu():
    speed = speedup_table(_samples(_sweep_spec()), keys=("size", "context"))
    assert (speed["verdict"] == "faster").all()
    cpu = profiling.dtype_paragraph(speed, "cpu")
    assert counts(sentence_with(cpu, "Forward:")) == [(4, 4)]
    assert 2 in numbers(sentence_with(cpu, "largest speedup")) and "faster" in sentence_with(cpu, "largest speedup")
    caveat = len(cpu) - len(profiling.dtype_paragraph(speed, "cuda"))
    assert caveat > 0 and "GPU" in cpu[-caveat:]  # only the CPU render carries the caveat
    answer = profiling.dtype_answer(speed, "cpu")
    assert counts(answer) == [(4, 4)] and numbers(answer)[-1] == 2  # a 2-2x range prints as one number
    assert "2-2" not in answer
    fig = profiling.plot_speedup_by_context(speed)
    assert [ax.get_title() for ax in fig.axes] == ["bf16 autocast, forward", "bf16 autocast, forward+backward"]


def test_dtype_paragraph_says_within_noise():
    spec = _sweep_spec()
    spec[("a", 64, "bf16")]["fwdbwd"] = [1.0, 100.0, 5.0, 80.0, 30.0, 2.0, 60.0]
    speed = speedup_table(_samples(spec), keys=("size", "context"))
    text = profiling.dtype_paragraph(speed, "cuda")
    fb = sentence_with(text, "Forward+backward:")
    assert counts(fb) == [(3, 4)] and numbers(clause_of(fb, "within noise"))[0] == 1
    assert (speed.set_index(["mode", "size", "context"]).loc[("forward+backward", "a", 64), "verdict"]
            == "within noise")
    assert "within noise" in text[text.index("the smallest"):]


# ---- warm-up --------------------------------------------------------------------------------------------


def _warmup(first=(100.0, 120.0), steady=10.0):
    rows = []
    for run, w in enumerate([0] * len(first) + [1, 5]):
        for i in range(5):
            ms = first[run] if w == 0 and i == 0 else steady * TIGHT[i]
            rows.append(dict(warmup=w, step=i, fwdbwd_ms=ms, status="ok"))
    return pd.DataFrame(rows)


def test_cold_start_compares_first_steps_with_the_steady_state():
    cs = warmup.cold_start(_warmup())
    assert cs.first_ms == [100.0, 120.0] and cs.steady_warmup == 5 and len(cs.steady_ms) == 5
    assert cs.first.verdict == "slower" and cs.first.ratio == pytest.approx(110.0 / 10.0)
    assert cs.second.verdict == "within noise"
    summary = warmup.warmup_summary(_warmup()).set_index("warmup")
    assert summary.loc[0, "processes"] == 2 and summary.loc[0, "steps"] == 10
    assert summary.loc[0, "first_step"] == 110.0 and summary.loc[5, "processes"] == 1


def test_warmup_paragraph_explains_by_the_measured_device():
    gpu = warmup.warmup_paragraph(_warmup(), "cuda")
    first = sentences(gpu)[0]  # the cold first step: median of 2 processes, times the steady state after 5 steps
    assert bold(first) == ["110 ms", "11x"] and in_order(first, [110, 2, 11, 10, 5])
    assert "slower" in first and amounts(first)[-2:] == [(95, "%"), (12, "x")] and in_order(first, [9.9, 12])
    assert warmup.GPU_FIRST_STEP in gpu and "page faults" not in gpu
    cpu = warmup.warmup_paragraph(_warmup(), "cpu")
    assert warmup.CPU_FIRST_STEP in cpu and "cudaMalloc" not in cpu and warmup.GPU_FIRST_STEP not in cpu
    for device, cause, not_cause in (("cpu", "CPU", "cuBLAS"), ("cuda", "cuBLAS", "CPU")):
        answer = warmup.warmup_answer(_warmup(), device)
        assert amounts(answer) == [(11, "x"), (95, "%"), (12, "x")] and "slower" in answer
        assert cause in answer.split(":", 1)[1] and not_cause not in answer  # the cause named for the device measured


def test_warmup_paragraph_makes_no_claim_within_noise():
    flat = _warmup(first=(10.0, 10.1))
    text = warmup.warmup_paragraph(flat, "cpu")
    first = sentences(text)[0]
    assert bold(first) == ["10.1 ms", "1.01x"] and "within noise" in first and "slower" not in text
    assert warmup.CPU_FIRST_STEP not in text and warmup.GPU_FIRST_STEP not in text  # no cause claimed
    answer = warmup.warmup_answer(flat, "cuda")
    assert amounts(answer)[0] == (1.01, "x") and "not" in answer and "slower" not in answer
    one = warmup.warmup_paragraph(_warmup(first=(100.0,)), "cuda")
    first = sentences(one)[0]  # one cold process: a ratio, but no spread and so no verdict
    assert bold(first) == ["100 ms", "10x"] and "no spread" in first and "slower" not in first
    assert "within noise" not in first and numbers(first)[:2] == [100, 10]  # no "median of n" either
    assert warmup.GPU_FIRST_STEP not in one and warmup.CPU_FIRST_STEP not in one
    answer = warmup.warmup_answer(_warmup(first=(100.0,)), "cuda")
    assert answer.startswith("Undecided") and "no spread" in answer and amounts(answer) == [(10, "x")]


def test_warmup_study_that_failed_makes_no_claim():
    failed = pd.DataFrame([dict(warmup=w, step=0, status="oom") for w in (0, 1, 2, 5)])
    assert warmup.cold_start(failed).first is None
    nothing = warmup.warmup_paragraph(failed, "cuda")
    assert not amounts(nothing) and not bold(nothing) and "slower" not in nothing and "within noise" not in nothing
    assert warmup.warmup_answer(failed, "cuda") == "Not measured."


def test_plot_warmup_one_line_per_count():
    fig = warmup.plot_warmup(_warmup(), "tiny")
    ax = fig.axes[0]
    assert len(ax.lines) == 3 and ax.get_yscale() == "log" and ax.get_title().startswith("tiny:")


# ---- kernel profiles ------------------------------------------------------------------------------------


def _kernels(timeline="gpu kernel"):
    rows = []
    for mode, extra in (("forward", 0.0), ("forward_backward", 0.0), ("train_step", 4.0)):
        scale = 1 if mode == "forward" else 3
        rows += [dict(mode=mode, name="sm90_gemm", **{"class": "matmul"}, calls_per_step=10, ms_per_step=8.0 * scale),
                 dict(mode=mode, name="softmax_warp_forward", **{"class": "other"}, calls_per_step=4,
                      ms_per_step=2.0 * scale)]
        if extra:
            rows.append(dict(mode=mode, name="multi_tensor_apply", **{"class": "other"}, calls_per_step=1,
                             ms_per_step=extra))
    df = pd.DataFrame(rows).assign(timeline=timeline)
    return df.assign(share=df["ms_per_step"] / df.groupby("mode")["ms_per_step"].transform("sum"))


def test_class_shares_and_matmul_paragraph_on_a_gpu():
    shares = kernel_profiles.class_shares(_kernels()).set_index(["mode", "class"])["share"]
    assert shares[("forward", "matmul")] == pytest.approx(0.8)
    assert shares[("train_step", "matmul")] == pytest.approx(24 / 34)
    text = kernel_profiles.matmul_paragraph(_kernels())
    shares = sentences(text)[0]  # the matmul share per mode
    assert bold(shares) == ["80%"] and amounts(shares) == [(80, "%"), (80, "%"), (71, "%")] and "GPU" in shares
    assert shares.index("forward") < shares.index("forward+backward") < shares.index("train step")
    largest = sentence_with(text, "`softmax_warp_forward`")  # the largest other kernel: share, calls per step
    assert amounts(largest) == [(20.0, "%")] and numbers(largest) == [20.0, 4] and "memory-bound" in text
    answer = kernel_profiles.matmul_answer(_kernels())
    assert amounts(answer) == [(80, "%"), (80, "%"), (71, "%")] and "GPU" in answer
    assert answer.index("forward") < answer.index("forward+backward") < answer.index("train step")


def test_matmul_paragraph_on_a_cpu_makes_no_gpu_claim():
    text = kernel_profiles.matmul_paragraph(_kernels("cpu op"))
    shares = sentences(text)[0]
    assert "CPU" in shares and "GPU" not in shares and amounts(shares) == [(80, "%"), (80, "%"), (71, "%")]
    assert "`softmax_warp_forward`" in text and "kernel" not in text.split("`softmax_warp_forward`")[0]  # operators
    assert "memory-bound" not in text and "GPU" in sentences(text)[-1]  # no GPU reading of CPU times


def test_top_kernels_tables(capsys):
    top = kernel_profiles.top_kernels(_kernels(), "train_step", n=2)
    assert top["name"].tolist() == ["sm90_gemm", "softmax_warp_forward"]
    kernel_profiles.show_top_kernels(_kernels("cpu op"), n=1)
    # a table saved before the timeline column existed: told by the GPU that measured it
    old = _kernels().drop(columns="timeline")
    assert kernel_profiles.time_unit(old.assign(gpu="NVIDIA H100 80GB HBM3 x2"))[0] == "kernel"
    assert kernel_profiles.time_unit(old.assign(gpu="cpu"))[0] == "operator"
    assert kernel_profiles.time_unit(old)[0] == "operator"  # no gpu column: nothing says it was a GPU
    out = capsys.readouterr().out
    headings = bold(out)  # one table per mode, titled by the CPU's unit: operators
    assert [h.split(", ")[-1] for h in headings] == ["forward", "forward_backward", "train_step"]
    assert all("operators" in h and "kernels" not in h for h in headings)
    fig = kernel_profiles.plot_class_shares(_kernels(), "2.7B")
    assert fig.axes[0].get_title() == "2.7B: matmul vs other"


def _steps(busy=300.0):
    return pd.DataFrame([dict(mode=m, wall_ms=320.0, busy_ms=busy, profiled_steps=3, size="2.7B", context=512,
                              batch=4, attention="naive") for m in ("forward", "forward_backward", "train_step")])


def test_profile_timer_sentence():
    lm = _lm([dict(size="2.7B", context=512, dtype="fp32", fwd_median_ms=309.0),
              dict(size="2.7B", context=512, dtype="bf16", fwd_median_ms=40.0)])
    text = kernel_profiles.profile_timer_sentence(_steps(), lm)
    # wall time, kernels' busy time and its share, the Python timer's median (of the sdpa sweep, not naive)
    assert bold(text) == ["320 ms"] and amounts(text) == [(320, "ms"), (300, "ms"), (94, "%"), (309, "ms")]
    assert "sdpa" in text and "naive" in text and "forward" in text
    cpu = kernel_profiles.profile_timer_sentence(_steps(busy=0.0), lm.iloc[:0])
    assert amounts(cpu) == [(320, "ms")] and len(sentences(cpu)) == 1  # no kernels, no timer to compare
    # H100, 01 at 395bd41: 139 ms "wall" against 324 ms of kernels; said as impossible, not as 234%
    wrong = kernel_profiles.profile_timer_sentence(_steps(busy=324.0).assign(wall_ms=139.0), lm)
    assert amounts(wrong) == [(324, "ms"), (139, "ms")] and "%" not in wrong and "309" not in wrong  # no share
    caption = kernel_profiles.profile_caption(_steps(), _kernels(), REPO_ROOT / "artifacts" / "traces")
    assert bold(caption) == ["2.7B"] and numbers(caption)[:4] == [2.7, 512, 4, 3]  # size, context, batch, steps
    assert "fp32" in caption and "naive" in caption and "GPU" in caption
    assert "`artifacts/traces`" in caption


def _ranges(softmax_ms=2.4):
    return pd.DataFrame([dict(range="attention/scores", calls_per_step=32, ms_per_step=12.9, gflop_per_step=173.0),
                         dict(range="attention/softmax", calls_per_step=32, ms_per_step=softmax_ms,
                              gflop_per_step=5.37),
                         dict(range="attention/final_matmul", calls_per_step=32, ms_per_step=6.5,
                              gflop_per_step=172.0)]).assign(tflop_per_s=lambda d: d.gflop_per_step / d.ms_per_step)


def test_softmax_ratios_and_paragraph():
    r = kernel_profiles.softmax_ratios(_ranges())
    assert r["runtime"] == pytest.approx(2.4 / 19.4) and r["flops"] == pytest.approx(5.37 / 345.0)
    gpu = kernel_profiles.softmax_paragraph(_ranges(), "cuda")
    first = sentences(gpu)[0]  # time share, FLOP share, cost per FLOP, the two rates
    assert bold(first) == ["0.12x", "0.016x"] and "more" in first and "less" not in first
    assert amounts(first) == [(0.12, "x"), (0.016, "x"), (7.9, "x"), (2.24, "TFLOP/s"), (17.8, "TFLOP/s")]
    assert "memory bandwidth" in gpu and "CPU" not in gpu
    cpu = kernel_profiles.softmax_paragraph(_ranges(), "cpu")
    assert sentences(cpu)[0] == first and "CPU" in cpu and "GPU" in sentences(cpu)[-1]  # GPU reading: for GPUs
    cheap = sentences(kernel_profiles.softmax_paragraph(_ranges(softmax_ms=0.1), "cuda"))[0]
    assert amounts(cheap)[:3] == [(0.0052, "x"), (0.016, "x"), (3, "x")] and "less" in cheap and "more" not in cheap
    answer = kernel_profiles.softmax_answer(_ranges())
    assert amounts(answer) == [(0.12, "x"), (0.016, "x"), (7.9, "x")]
    assert list(kernel_profiles.attention_table(_ranges()).columns) == ["range", "calls_per_step", "ms_per_step",
                                                                  "gflop_per_step", "tflop_per_s"]


def test_kernel_profiles_are_taken_on_first_use_only(tmp_path):
    calls = []
    fake = lambda size, **kw: calls.append((size, kw["mode"], kw["trace_path"].name)) or object()
    profiles = kernel_profiles.KernelProfiles(fake, "mini", 64, 4, tmp_path)
    assert calls == []  # a replayed notebook builds the object but never asks for a table
    first = profiles.profiler("forward")
    assert profiles.profiler("forward") is first and calls == [("mini", "forward", "01_mini_forward.json")]


def test_kernel_profiles_of_a_toy_model(tmp_path):
    from lab.bench.lm import profile_lm
    from lab.model import ModelConfig

    cfg = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=2, context_length=16, vocab_size=64)
    profile = partial(profile_lm, device="cpu", warmup=1, steps=1)
    profiles = kernel_profiles.KernelProfiles(profile, cfg, 16, 2, tmp_path)
    kernels = profiles.kernels()
    assert list(dict.fromkeys(kernels["mode"])) == ["forward", "forward_backward", "train_step"]
    assert (kernels["timeline"] == "cpu op").all() and (kernels["class"] == "matmul").any()
    steps = profiles.step_times()
    assert (steps["wall_ms"] > 0).all() and (steps["busy_ms"] == 0).all() and steps["size"].iloc[0] == "d32_L1"
    ranges = profiles.attention_ranges()
    assert ranges["range"].tolist() == ["attention/scores", "attention/softmax", "attention/final_matmul"]
    assert (ranges["gflop_per_step"] > 0).all() and (ranges["calls_per_step"] == 1).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_d32_L1_forward.json", "01_d32_L1_forward_backward.json",
                                                          "01_d32_L1_train_step.json"]
