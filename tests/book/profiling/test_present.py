"""lab.book.profiling: notebook 01's settings, tables, plots and claims, from small synthetic tables for CPU and
GPU renders; the claims' values, counts and verdicts are checked, never their wording."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book import claims as cl
from lab.book.profiling import kernels as kernel_profiles
from lab.book.profiling import present as profiling
from lab.book.profiling import warmup
from lab.paths import REPO_ROOT
from tests.book.notebook_code import assert_thin

matplotlib.use("Agg")


def found(claim_or_findings, kind):
    findings = claim_or_findings.findings if isinstance(claim_or_findings, cl.Claim) else claim_or_findings
    return [f for f in findings if isinstance(f, kind)]


def values(claim_or_findings) -> dict:
    """label -> number (Value: its median; Share: its fraction) or text (Observed)."""
    out = {}
    for f in found(claim_or_findings, (cl.Value, cl.Share, cl.Observed)):
        label = f.measured.label if isinstance(f, cl.Value) else f.label
        out[label] = f.measured if isinstance(f, cl.Value) else f.fraction if isinstance(f, cl.Share) else f.seen
    return out


def test_notebook_holds_no_logic():
    assert_thin("01_profiling", 100)


# ---- settings -------------------------------------------------------------------------------------------


def test_settings_quick_full_and_overrides():
    quick = profiling.ProfilingSettings(quick=True, device="cpu")
    assert quick.sizes == ("tiny", "mini") and quick.contexts == (32, 64) and quick.default_context == 64
    assert quick.dtypes == ("fp32", "bf16") and quick.device == "cpu" and quick.steps >= 5 and quick.warmup >= 2
    full = profiling.ProfilingSettings(quick=False, device="cpu")
    assert full.sizes == ("small", "medium", "large", "xl", "2.7B", "10B")
    assert full.contexts == (128, 256, 512, 1024) and full.default_context == 512 and full.profile_size == "2.7B"
    mine = profiling.ProfilingSettings(quick=True, device="cpu", sizes=["tiny"], contexts=[16, 32], default_context=16)
    assert mine.sizes == ("tiny",) and mine.contexts == (16, 32) and mine.params()["contexts"] == [16, 32]
    with pytest.raises(ValueError, match="default_context=48 is not one of"):
        profiling.ProfilingSettings(quick=True, device="cpu", default_context=48)
    assert quick.modes_for("tiny", 64) == ("forward", "forward_backward", "train_step")
    assert quick.modes_for("tiny", 32) == ("forward", "forward_backward")


def test_warmup_runs_give_the_first_step_enough_samples():
    assert profiling.ProfilingSettings(device="cpu").warmup_runs == (0, 0, 0, 0, 0, 1, 2, 5)
    assert profiling.ProfilingSettings(device="cpu", cold_runs=1).warmup_runs == (0, 1, 2, 5)
    assert profiling.ProfilingSettings(device="cpu", cold_runs=3, warmups=(1, 5)).warmup_runs == (0, 0, 0, 1, 5)


def test_device_caveat_only_on_the_cpu(capsys):
    profiling.show_device_caveat("cuda")
    assert capsys.readouterr().out == ""
    profiling.show_device_caveat("cpu")
    assert "Warning" in capsys.readouterr().out


def test_size_table_counts_parameters():
    import torch

    from lab.model import TransformerLM, config_for

    t = profiling.size_table(["tiny", "10B"]).set_index("size")
    torch.manual_seed(0)
    assert t.loc["tiny", "params_M"] == TransformerLM(config_for("tiny")).num_parameters() / 1e6
    assert t.loc["10B", "d_model"] == 4608 and t.loc["10B", "params_M"] > 10_000


# ---- synthetic sweeps -----------------------------------------------------------------------------------

TIGHT = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.01]


def _row(size, context, dtype, params, fwd, bwd=None, step=None, **extra):
    """One lm_step row with every sample: ``fwd`` (ms, or a list), backward ``bwd`` (default 2x), forward+backward
    their sum, the train step ``step``."""
    fwd = [fwd * x for x in TIGHT] if isinstance(fwd, (int, float)) else fwd
    bwd = [2 * x for x in fwd] if bwd is None else bwd
    row = dict(size=size, context=context, batch=4, dtype=dtype, attention="sdpa", compile=False, fused_loss=False,
               params=params, status="ok", device="cpu", gpu_busy=math.nan, host_bound=False, limit_gib=79.2)
    for col, samples in (("fwd", fwd), ("bwd", bwd), ("fwdbwd", [a + b for a, b in zip(fwd, bwd)] if fwd else []),
                         ("step", [step * x for x in TIGHT] if step else [])):
        s = cl.Measured.of(col, samples).summary
        row.update({f"{col}_ms": s.median, f"{col}_spread_ms": s.spread, f"{col}_n": s.n, f"{col}_samples_ms": samples})
    return {**row, **extra}


def _sweep(device="cpu"):
    rows = []
    for size, scale, params in (("a", 10.0, 1e6), ("b", 40.0, 4e6)):
        for context in (32, 64):
            for dtype, speed in (("fp32", 1.0), ("bf16", 2.0)):
                rows.append(_row(size, context, dtype, params, scale / speed * context / 64,
                                 step=4 * scale / speed if context == 64 else None))
    rows[2]["bwd_samples_ms"] = [1.0, 30.0, 2.0, 25.0, 5.0, 0.5, 12.0]  # a at 64 fp32: a backward as noisy as slow
    rows[2].update(bwd_ms=5.0, bwd_spread_ms=6.0)
    rows.append(_row("c", 64, "fp32", 1e10, [], [], status="oom"))  # nothing fit
    rows.append(_row("c", 64, "bf16", 1e10, 500.0, [], status="oom"))  # the forward fit, the backward did not
    return pd.DataFrame(rows).assign(device=device)


def test_backward_claim_pairs_rounds_and_counts_every_configuration():
    claim = profiling.backward_claim(_sweep())
    (tally,) = found(claim, cl.Tally)
    assert tally.counts() == {"slower": 7, "within noise": 1}  # the backward costs more in 7 of the 8 measured
    assert all(f.paired for f in tally.comparisons)
    v = values(claim)
    assert v["median ratio of medians"].median == pytest.approx(2.0) and v["largest ratio of medians"].median == 2.0
    assert v["smallest ratio of medians"].median == pytest.approx(0.5)  # a's noisy backward: 5 ms against 10
    assert "2x" in claim.because  # the FLOPs' prediction beside the measured ratios


def test_step_claim_per_dtype_and_an_inverted_order():
    lm = _sweep()
    claim = profiling.step_claim(lm, 64)
    medians = [(f.measured.label, f.measured.median) for f in found(claim, cl.Value)]
    assert [label for label, _ in medians] == ["a, fp32", "b, fp32", "c, fp32", "a, bf16", "b, bf16", "c, bf16"]
    assert [m for _, m in medians if math.isfinite(m)] == [40.0, 160.0, 20.0, 80.0]
    texts = [f.measured.text() for f in found(claim, cl.Value)]
    assert texts[2] == texts[5] == "out of memory at 79 GiB"
    assert claim.because == "" and "64" in claim.question
    inverted = lm.copy()
    inverted.loc[(inverted["size"] == "a") & (inverted["context"] == 64) & (inverted["dtype"] == "fp32"),
                 ["step_ms", "step_samples_ms"]] = [500.0, None]
    assert "host" in profiling.step_claim(inverted, 64).because  # a smaller model slower: flagged


def test_timing_findings_quote_forwards_spread_and_out_of_memory():
    v = values(profiling.timing_findings(_sweep(), 64))
    assert v["forward, a at context 64, fp32"].median == 10.0 and v["forward, b at context 64, fp32"].median == 40.0
    assert v["configurations whose spread exceeds 5% of their median"] == pytest.approx(1 / 9)
    assert v["the largest, a at context 64, fp32, backward: spread over median"] == pytest.approx(6.0 / 5.0)
    assert v["c at context 64, fp32 (forward, forward+backward, train step)"].text() == "out of memory at 79 GiB"
    assert v["c at context 64, bf16 (forward+backward, train step)"].status == "oom"  # its forward fit


def test_host_bound_rows_are_named_on_a_gpu():
    gpu = _sweep("cuda:0").assign(gpu_busy=0.95)
    gpu.loc[0, ["gpu_busy", "host_bound"]] = [0.4, True]
    shares = found(profiling.host_bound_findings(gpu), cl.Share)
    assert [(s.label.split(" (")[0], s.fraction) for s in shares] == [("GPU busy during a at context 32, fp32", 0.4)]
    none = profiling.host_bound_findings(gpu.assign(host_bound=False))
    assert [o.seen for o in found(none, cl.Observed)] == ["none"]
    assert profiling.host_bound_findings(_sweep()) == []  # a CPU has no launches to wait for


def test_dtype_claim_counts_add_up_and_out_of_memory_counts():
    pairs = profiling.dtype_comparisons(_sweep())
    assert [(k["size"], k["context"], k["mode"]) for k, _ in pairs][:2] == [("a", 32, "forward"),
                                                                          ("a", 32, "forward+backward")]
    claim = profiling.dtype_claim(pairs, _sweep())
    fb, fwd = found(claim, cl.Tally)
    assert sum(fb.counts().values()) == 5 and fb.counts()["out of memory at 79 GiB"] == 1
    assert fwd.counts()["faster"] == 4 and sum(fwd.counts().values()) == 5
    ends = found(claim, cl.Versus)
    assert len(ends) == 2 and all(f.verdict == "faster" for f in ends) and "CPU" in claim.because
    table = profiling.speedup_table(pairs)
    assert list(table.columns[:5]) == ["size", "context", "mode", "bf16", "fp32"] and len(table) == 10
    fig = profiling.plot_speedup_by_context(pairs)
    assert [ax.get_title() for ax in fig.axes] == ["bf16 autocast, forward", "bf16 autocast, forward+backward"]


def test_timing_table_and_plot():
    shown = profiling.timing_table(_sweep())
    assert {"fwd_ms", "fwd_spread_ms", "step_ms", "params_M"} <= set(shown) and "fwd_median_ms" not in shown
    assert "gpu_busy" not in shown  # nobody measured it on the CPU
    left, right = profiling.plot_timings(_sweep()).axes
    assert (left.get_title(), right.get_title()) == ("forward", "backward") and left.get_xscale() == "log"


# ---- warm-up --------------------------------------------------------------------------------------------


def _warmup(first=(100.0, 120.0, 110.0, 105.0, 115.0), steady=10.0):
    rows = []
    for run, w in enumerate([0] * len(first) + [1, 5]):
        for i in range(7):
            ms = first[run] if w == 0 and i == 0 else steady * TIGHT[i]
            rows.append(dict(warmup=w, step=i, fwdbwd_ms=ms, status="ok"))
    return pd.DataFrame(rows)


def test_cold_start_claim_slower_beyond_noise_with_the_device_cause():
    gpu = warmup.cold_start_claim(_warmup(), "cuda")
    first, second = found(gpu, cl.Versus)
    assert first.verdict == "slower" and first.comparison.ratio == pytest.approx(110.0 / 10.0)
    assert first.subject.summary.n == 5 and first.reference.summary.n == 7
    assert second.verdict == "within noise" and gpu.because == warmup.GPU_FIRST_STEP
    assert warmup.cold_start_claim(_warmup(), "cpu").because == warmup.CPU_FIRST_STEP
    summary = warmup.warmup_summary(_warmup()).set_index("warmup")
    assert summary.loc[0, "processes"] == 5 and summary.loc[0, "steps"] == 35 and summary.loc[0, "first_step_ms"] == 110
    assert summary.loc[5, "median_ms"] == 10.0 and "spread_ms" in summary and "mean" not in summary


def test_cold_start_claim_makes_no_claim_within_noise_or_without_samples():
    flat = warmup.cold_start_claim(_warmup(first=(10.0, 10.1, 9.9, 10.0, 10.05)), "cpu")
    assert found(flat, cl.Versus)[0].verdict == "within noise" and flat.because not in (warmup.CPU_FIRST_STEP,
                                                                                        warmup.GPU_FIRST_STEP)
    two = warmup.cold_start_claim(_warmup(first=(100.0, 120.0)), "cuda")
    assert found(two, cl.Versus)[0].verdict == "not decided" and two.because != warmup.GPU_FIRST_STEP
    failed = pd.DataFrame([dict(warmup=w, step=0, status="oom") for w in (0, 1, 2, 5)])
    claim = warmup.cold_start_claim(failed, "cuda")
    assert not found(claim, cl.Versus) and found(claim, cl.Observed)
    ax = warmup.plot_warmup(_warmup(), "tiny").axes[0]
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


def test_top_kernels_one_table_per_mode(capsys):
    kernel_profiles.show_top_kernels(_kernels("cpu op"), n=1)
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line.startswith("**")]
    assert [h.split(", ")[-1].split("*")[0] for h in headings] == ["forward", "forward_backward", "train_step"]
    assert all("operators" in h for h in headings) and out.count("sm90_gemm") == 3 and "softmax_warp" not in out


def test_matmul_claim_on_a_gpu_and_a_cpu():
    gpu = kernel_profiles.matmul_claim(_kernels())
    assert [s.fraction for s in found(gpu, cl.Share)] == pytest.approx([0.8, 0.8, 24 / 34, 0.2])
    v = values(gpu)
    assert v["the forward's largest other kernel"] == "`softmax_warp_forward`" and v["its calls per step"].median == 4
    assert "memory-bound" in gpu.because and "optimizer" in gpu.because
    cpu = kernel_profiles.matmul_claim(_kernels("cpu op"))
    assert "the forward's largest other operator" in values(cpu) and "memory-bound" not in cpu.because
    assert all("CPU operator time" in s.label for s in found(cpu, cl.Share)[:3])
    old = _kernels().drop(columns="timeline")  # a table saved before the timeline column: told by its GPU
    assert kernel_profiles.time_unit(old.assign(gpu="NVIDIA H100 80GB HBM3 x2"))[0] == "kernel"
    assert kernel_profiles.time_unit(old.assign(gpu="cpu"))[0] == "operator"
    assert kernel_profiles.plot_class_shares(_kernels(), "2.7B").axes[0].get_title() == "2.7B: matmul vs other"


def _steps(busy=300.0, wall=320.0):
    return pd.DataFrame([dict(mode=m, wall_ms=wall, busy_ms=busy, profiled_steps=3, size="2.7B", context=512,
                              batch=4, attention="naive") for m in ("forward", "forward_backward", "train_step")])


def test_profile_findings_against_the_python_timer():
    lm = pd.DataFrame([_row("2.7B", 512, "fp32", 2.7e9, 309.0), _row("2.7B", 512, "bf16", 2.7e9, 40.0)])
    trace = REPO_ROOT / "artifacts" / "traces"
    v = values(kernel_profiles.profile_findings(_steps(), _kernels(), lm, trace))
    assert v["the profiled forward step's wall time"].median == 320 and v["kernels busy"] == pytest.approx(300 / 320)
    assert v["the Python timer's forward (sdpa attention, no profiler)"].median == 309.0
    assert "`artifacts/traces`" in v["profiled"] and "naive" in v["profiled"]
    cpu = values(kernel_profiles.profile_findings(_steps(busy=0.0), _kernels("cpu op"), lm.iloc[:0], trace))
    assert set(cpu) == {"profiled", "the profiled forward step's wall time"}  # no kernels, no timer to compare
    # H100: 139 ms "wall" against 324 ms of kernels: said as impossible, not as a 234% share
    wrong = kernel_profiles.profile_findings(_steps(busy=324.0, wall=139.0), _kernels(), lm, trace)
    assert not found(wrong, cl.Share) and values(wrong)["its kernels' busy time"].median == 324


def _ranges(softmax_ms=2.4):
    return pd.DataFrame([dict(range="attention/scores", calls_per_step=32, ms_per_step=12.9, gflop_per_step=173.0),
                         dict(range="attention/softmax", calls_per_step=32, ms_per_step=softmax_ms,
                              gflop_per_step=5.37),
                         dict(range="attention/final_matmul", calls_per_step=32, ms_per_step=6.5,
                              gflop_per_step=172.0)]).assign(tflop_per_s=lambda d: d.gflop_per_step / d.ms_per_step)


def test_softmax_claim():
    gpu = kernel_profiles.softmax_claim(_ranges(), "cuda")
    got = [(f.measured.median, f.measured.unit) for f in found(gpu, cl.Value)]
    assert got == [(pytest.approx(2.4 / 19.4), "x"), (pytest.approx(5.37 / 345.0), "x"),
                   (pytest.approx((2.4 / 19.4) / (5.37 / 345.0)), "x"), (pytest.approx(2.2375), "TFLOP/s"),
                   (pytest.approx(345 / 19.4), "TFLOP/s")]
    assert "memory bandwidth" in gpu.because
    cpu = kernel_profiles.softmax_claim(_ranges().assign(tflop_per_s=1e-5), "cpu")
    assert [f.measured.unit for f in found(cpu, cl.Value)][3] == "GFLOP/s" and "CPU" in cpu.because
    assert list(kernel_profiles.attention_table(_ranges()).columns) == ["range", "calls_per_step", "ms_per_step",
                                                                        "gflop_per_step", "tflop_per_s"]
