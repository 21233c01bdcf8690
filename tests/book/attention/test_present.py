"""lab.book.attention.present: notebook 04's settings, tables and sentences, from small synthetic tables."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book.attention import present, whole_model
from tests.book.prose import amounts, amounts_in_order, counts, has_amount, numbers, sentence_of, sentence_with

matplotlib.use("Agg")


def _grid_row(d, seq, compile=False, fwd=1.0, bwd=2.0, status="ok", note="", std=0.01, passes=100, batch=8,
              dtype="fp32", gpu="NVIDIA H100 80GB HBM3", **extra):
    e = 4 if dtype == "fp32" else 2
    saved = batch * seq * seq * e / 2**20
    row = dict(impl="naive", compile=compile, batch=batch, seq_len=seq, d=d, dtype=dtype, causal=False,
               passes=passes, fwd_ms=fwd, fwd_std_ms=std * fwd, bwd_ms=bwd, bwd_std_ms=std * bwd,
               mem_baseline_mib=64.0, mem_before_bwd_mib=64.0 + saved + 5 * batch * seq * d * e / 2**20,
               peak_mib=math.nan, saved_mib=saved, predicted_saved_mib=saved,
               predicted_before_bwd_mib=saved + 5 * batch * seq * d * e / 2**20,
               predicted_peak_mib=3 * saved + 5 * batch * seq * d * e / 2**20, compile_s=1.0 if compile else math.nan,
               gpu=gpu, gpu_memory_gib=80.0, status=status, note=note)
    if status != "ok":
        row.update(fwd_ms=math.nan, bwd_ms=math.nan, saved_mib=math.nan, mem_before_bwd_mib=math.nan)
    row.update(extra)
    return row


def test_settings_fill_profile_defaults_and_keep_given_values():
    cfg = present.settings(True, "cpu", ds=None, seqs=[32], batch=8, dtype="fp32", causal=False, passes=None,
                           warmup=None, compile_grid=True, lm_sizes=None, lm_context=None, lm_batch=4, lm_dtype=None,
                           lm_warmup=None, lm_steps=None)
    assert cfg.ds == (16, 32) and cfg.seqs == (32,) and cfg.passes == 3 and cfg.lm_sizes == ("tiny",)
    assert cfg.compile_modes == (False, True) and cfg.params()["device"] == "cpu"
    full = present.settings(False, "cuda", ds=None, seqs=None, batch=8, dtype="fp32", causal=False, passes=None,
                            warmup=None, compile_grid=False, lm_sizes=None, lm_context=None, lm_batch=4,
                            lm_dtype=None, lm_warmup=None, lm_steps=None)
    assert full.seqs == (256, 1024, 4096, 8192, 16384) and full.passes == 100 and full.compile_modes == (False,)
    assert full.lm_sizes == ("small", "medium", "large", "xl", "2.7B", "10B") and full.lm_dtype == "bf16"


def test_fit_sentence_names_the_shortest_oom_and_each_d():
    grid = pd.DataFrame([_grid_row(16, 4096), _grid_row(16, 8192, status="oom", note="out of memory in backward: x"),
                         _grid_row(64, 2048), _grid_row(64, 4096, status="oom", note="out of memory in forward: y")])
    text = present.fit_sentence(grid)
    first, per_d = text.split(". ")
    assert counts(first) == [(2, 4)] and "NVIDIA H100 80GB HBM3" in first
    assert numbers(first)[-2:] == [4096, 64] and "forward" in first  # the shortest OOM and its pass
    assert numbers(per_d) == [16, 8192, 64, 4096]  # per head dimension, the first length that did not fit
    fits = present.fit_sentence(pd.DataFrame([_grid_row(16, 256, gpu="cpu")]))
    assert numbers(fits) == [1, 256, 8] and "CPU" in fits and "fp32" in fits


def test_timing_sentence_compares_time_growth_with_flops():
    grid = pd.DataFrame([_grid_row(16, 1024, fwd=1.0, bwd=2.0), _grid_row(16, 4096, fwd=10.0, bwd=20.0),
                         _grid_row(128, 4096, fwd=12.0, bwd=30.0)])
    text = present.timing_sentence(grid)
    times, growth = text.split(" Going from ")
    assert numbers(times) == [4096, 10, 12, 20, 30, 16, 128, 2.2]  # length, fwd range, bwd range, d's, bwd/fwd
    assert present.d_growth(grid) == dict(d_low=16, d_high=128, time_ratio=1.2, flop_ratio=8.0, verdict="slower")
    assert numbers(growth)[2:4] == [8, 1.2] and "far less" in growth
    proportional = pd.DataFrame([_grid_row(16, 64, fwd=1.0), _grid_row(32, 64, fwd=1.9)])
    assert "in step" in present.timing_sentence(proportional)
    # 74x the time for 2x the FLOPs is not the matmuls' doing: the sentence must not say it is
    runaway = present.timing_sentence(pd.DataFrame([_grid_row(16, 64, fwd=1.0), _grid_row(32, 64, fwd=74.0)]))
    assert numbers(runaway.split(" Going from ")[1])[2:4] == [2, 74] and "in step" not in runaway
    assert "far more" in runaway


def test_timing_sentence_reads_d_growth_only_beyond_the_noise():
    quieter = pd.DataFrame([_grid_row(16, 4096, fwd=10.0), _grid_row(32, 4096, fwd=9.0)])  # faster with 2x FLOPs
    g = present.d_growth(quieter)
    assert g["verdict"] == "faster" and g["flop_ratio"] == 2.0
    assert "load" in present.timing_sentence(quieter) and "memory traffic" not in present.timing_sentence(quieter)
    noisy = pd.DataFrame([_grid_row(16, 4096, fwd=10.0, std=0.5), _grid_row(32, 4096, fwd=9.0, std=0.5)])
    assert present.d_growth(noisy)["verdict"] == "within noise"
    assert "within noise" in present.timing_sentence(noisy)
    same = pd.DataFrame([_grid_row(16, 4096, fwd=10.0, bwd=20.0), _grid_row(32, 4096, fwd=10.0, bwd=20.0)])
    times = present.timing_sentence(same).split(" Going from ")[0]
    assert "10–10" not in times and numbers(times)[:3] == [4096, 10, 20]  # equal ends print once


def test_memory_terms_and_accounting_sentence():
    row = pd.Series(_grid_row(64, 16384))
    terms = present.memory_terms(row)
    assert terms.set_index("term").loc["probabilities P (saved)", "MiB"] == 8192.0
    check = pd.DataFrame([dict(quantity="saved for backward beyond q, k, v", predicted_mib=8192.0,
                               measured_mib=8192.0, measured_over_predicted=1.0)])
    text = present.accounting_sentence(row, "largest_fit", check)
    assert numbers(text)[:3] == [8, 16384, 64] and "out of memory" not in text  # batch, seq, d of a fit
    assert "8 × 16384² × 4 B = 8 GiB" in text  # the formula with its numbers
    assert amounts_in_order(text, [(8, "GiB"), (8.16, "GiB"), (24.2, "GiB")])  # P, before the backward, its peak
    assert numbers(sentence_with(text, "measured"))[-3:] == [8192, 8192, 1.0]  # measured, predicted, ratio
    oom = pd.Series(_grid_row(64, 65536, status="oom"))
    text = present.accounting_sentence(oom, "oom", check.assign(measured_mib=math.nan))
    assert "out of memory" in text and numbers(text)[:3] == [8, 65536, 64]
    assert amounts_in_order(text, [(128, "GiB"), (129, "GiB"), (385, "GiB")])  # P, before the backward, its peak
    assert "allocator" in text and not [a for a in amounts(text) if a[1] == "MiB"]  # nothing measured, said so
    assert amounts(sentence_of(text, 80, "GiB")) == [(80, "GiB"), (385, "GiB")] and "cannot" in sentence_of(
        text, 80, "GiB")  # the GPU's memory against the predicted peak: the verdict


def test_saved_memory_curves_and_scaling_sentence():
    from lab.book.attention import bench as ab
    from lab.accounting import attention as costs

    grid = pd.DataFrame([_grid_row(16, s) for s in (256, 1024)] + [_grid_row(64, s) for s in (256, 1024)])
    curves = present.saved_memory_curves(grid)
    assert len(curves) == 8 and set(curves["method"]) == {"naive (measured)", "FlashAttention (closed form)"}
    flash = curves[(curves["method"] == "FlashAttention (closed form)") & (curves["d"] == 64)
                   & (curves["seq_len"] == 1024)]["MiB"].item()
    assert flash == costs.flash_attention_saved_bytes(8, 1024, 64, "fp32") / 2**20
    text = present.scaling_sentence(ab.saved_memory_scaling(grid), curves)
    assert "seq^2.00" in text and "–seq^" not in text  # every d grows as seq^2: one exponent, not a range
    assert "quadratic" in text and 1024 in numbers(text)
    assert present.plot_saved_memory(curves, "t") is not None
    assert "could be fitted" in present.scaling_sentence(pd.DataFrame(), curves)


def test_compile_table_and_sentence_use_verdicts():
    grid = pd.DataFrame([
        _grid_row(16, 256, fwd=1.0), _grid_row(16, 256, compile=True, fwd=0.5),           # 2x, tight: faster
        _grid_row(16, 1024, fwd=1.0, std=0.2), _grid_row(16, 1024, compile=True, fwd=0.99, std=0.2),  # noise
        _grid_row(16, 4096, fwd=1.0, bwd=2.0), _grid_row(16, 4096, compile=True, fwd=1.0, bwd=3.0)])  # bwd slower
    versus = present.compile_table(grid)
    assert versus["fwd_verdict"].tolist() == ["faster", "within noise", "within noise"]
    assert versus["bwd_verdict"].tolist() == ["within noise", "within noise", "slower"]
    text = present.compile_sentence(versus, grid)
    forward, backward = text.split(". ")[0].split(";")  # one clause per pass
    assert counts(forward) == [(1, 3)] and "slower in 0" in forward  # faster in 1 of 3, slower in 0
    assert counts(backward) == [(0, 3)] and "slower in 1" in backward
    assert numbers(sentence_with(text, "gains most")) == [256, 16, 2]
    assert numbers(sentence_with(text, "Compiling cost")) == [3, 3]
    saved = sentence_with(text, "seq^2.00")
    assert "seq × seq" in saved and has_amount(saved, 1.0, "x")  # compiled saves as much as eager, still seq²
    assert present.plot_compile_speedups(versus) is not None
    eager_only = pd.DataFrame([_grid_row(16, 256)])
    assert present.compile_table(eager_only).empty
    assert "eagerly only" in present.compile_sentence(present.compile_table(eager_only), eager_only)


def _lm_row(size, compile, step, std=0.01, steps=5, status="ok", **extra):
    row = dict(size=size, context=512, batch=4, dtype="bf16", attention="sdpa", compile=compile, steps=steps,
               fwd_ms=step / 3, fwd_std_ms=std * step / 3, fwdbwd_ms=step * 0.9, fwdbwd_std_ms=std * step,
               step_ms=step, step_std_ms=std * step, fwd_peak_gib=1.0, fwdbwd_peak_gib=2.0, step_peak_gib=3.0,
               status=status, error="")
    row.update(extra)
    return row


def test_lm_compile_speedups_and_sentence():
    lm = pd.DataFrame([_lm_row("small", False, 50.0), _lm_row("small", True, 20.0),
                       _lm_row("xl", False, 100.0, std=0.3), _lm_row("xl", True, 98.0, std=0.3),
                       _lm_row("10B", False, math.nan, status="oom", fwdbwd_ms=math.nan, fwd_ms=40.0),
                       _lm_row("10B", True, math.nan, status="oom", fwdbwd_ms=math.nan, fwd_ms=30.0)])
    sp = whole_model.lm_compile_speedups(lm).set_index(["size", "mode"])
    assert sp.loc[("small", "train step"), "speedup"] == pytest.approx(2.5)
    assert sp.loc[("small", "train step"), "verdict"] == "faster"
    assert sp.loc[("xl", "train step"), "verdict"] == "within noise"
    assert sp.loc[("10B", "forward"), "speedup"] == pytest.approx(4 / 3)
    assert ("10B", "train step") not in sp.index  # neither side ran
    text = whole_model.lm_compile_sentence(whole_model.lm_compile_speedups(lm), lm)
    assert numbers(text)[:2] == [512, 4] and "bf16" in text.split(":")[0]
    small = text[text.index("small train step"):].split(";")[0]
    assert numbers(small)[:3] == [50, 20, 2.5] and "faster" in small
    xl = text[text.index("xl train step"):].split(";")[0]
    assert numbers(xl)[:2] == [100, 98] and "within noise" in xl
    ten = text[text.index("10B forward"):].split(";")[0]
    assert numbers(ten)[1:4] == [40, 30, 1.33] and "within noise" in ten  # eager, compiled, speedup, verdict
    failed = sentence_with(text, "10B eager", "10B compiled")  # the configurations that did not fit, by name
    assert "small" not in failed and "xl" not in failed and not amounts(failed)
    assert whole_model.plot_lm_compile(whole_model.lm_compile_speedups(lm)) is not None
    assert list(whole_model.lm_table(lm).columns)[:3] == ["size", "compile", "fwd_ms"]
    assert list(whole_model.lm_table(lm).columns)[-2:] == ["status", "error"]


def test_size_text():
    assert present.size_text(512) == "512 MiB" and present.size_text(8192) == "8 GiB"
    assert present.size_text(math.nan) == "n/a"
