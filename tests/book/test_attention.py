"""lab.book.attention: notebook 04's settings, tables and sentences, from small synthetic tables."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book import attention as present

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
    assert text.startswith("2 of 4 configurations ran out of memory on NVIDIA H100 80GB HBM3")
    assert "shortest sequence that did not fit is 4096 tokens (d=64), in the forward pass" in text
    assert "d=16 from 8192, d=64 from 4096 tokens" in text
    fits = present.fit_sentence(pd.DataFrame([_grid_row(16, 256, gpu="cpu")]))
    assert fits == "All 1 configurations fit on this CPU (longest: 256 tokens, batch 8, fp32)."


def test_timing_sentence_compares_time_growth_with_flops():
    grid = pd.DataFrame([_grid_row(16, 1024, fwd=1.0, bwd=2.0), _grid_row(16, 4096, fwd=10.0, bwd=20.0),
                         _grid_row(128, 4096, fwd=12.0, bwd=30.0)])
    text = present.timing_sentence(grid)
    assert "At 4096 tokens a forward pass takes 10–12 ms and a backward pass 20–30 ms over d = 16, 128" in text
    assert "the backward is 2.2x the forward (median)" in text
    assert "multiplies the forward time by 1.2x for 8x the FLOPs, far less than the FLOPs" in text
    proportional = pd.DataFrame([_grid_row(16, 64, fwd=1.0), _grid_row(32, 64, fwd=1.9)])
    assert "roughly in step with the FLOPs" in present.timing_sentence(proportional)


def test_memory_terms_and_accounting_sentence():
    row = pd.Series(_grid_row(64, 16384))
    terms = present.memory_terms(row)
    assert terms.set_index("term").loc["probabilities P (saved)", "MiB"] == 8192.0
    check = pd.DataFrame([dict(quantity="saved for backward beyond q, k, v", predicted_mib=8192.0,
                               measured_mib=8192.0, measured_over_predicted=1.0)])
    text = present.accounting_sentence(row, "largest_fit", check)
    assert "For the largest configuration that fit (batch 8, seq 16384, d 64, fp32)" in text
    assert "8 × 16384² × 4 B = 8 GiB" in text
    assert "8192 MiB measured vs 8192 MiB predicted (1.000x)" in text
    oom = pd.Series(_grid_row(64, 65536, status="oom"))
    text = present.accounting_sentence(oom, "oom", check.assign(measured_mib=math.nan))
    assert "smallest configuration that ran out of memory" in text and "This GPU has 80 GiB" in text
    assert "cannot fit" in text and "no allocator statistics" in text


def test_saved_memory_curves_and_scaling_sentence():
    from lab.bench import attention as ab
    from lab.bench import attention_costs as costs

    grid = pd.DataFrame([_grid_row(16, s) for s in (256, 1024)] + [_grid_row(64, s) for s in (256, 1024)])
    curves = present.saved_memory_curves(grid)
    assert len(curves) == 8 and set(curves["method"]) == {"naive (measured)", "FlashAttention (closed form)"}
    flash = curves[(curves["method"] == "FlashAttention (closed form)") & (curves["d"] == 64)
                   & (curves["seq_len"] == 1024)]["MiB"].item()
    assert flash == costs.flash_attention_saved_bytes(8, 1024, 64, "fp32") / 2**20
    text = present.scaling_sentence(ab.saved_memory_scaling(grid), curves)
    assert "seq^2.00–seq^2.00" in text and "i.e. quadratic" in text and "At 1024 tokens" in text
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
    assert "the compiled forward is faster beyond the noise in 1 of 3 configurations, slower in 0" in text
    assert "the compiled backward is faster beyond the noise in 0 of 3 configurations, slower in 1" in text
    assert "The forward gains most at seq 256, d 16 (2x)" in text
    assert "Compiling cost 3 s for 3 shapes" in text
    assert "does not remove the seq × seq tensor" in text
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
    sp = present.lm_compile_speedups(lm).set_index(["size", "mode"])
    assert sp.loc[("small", "train step"), "speedup"] == pytest.approx(2.5)
    assert sp.loc[("small", "train step"), "verdict"] == "faster"
    assert sp.loc[("xl", "train step"), "verdict"] == "within noise"
    assert sp.loc[("10B", "forward"), "speedup"] == pytest.approx(4 / 3)
    assert ("10B", "train step") not in sp.index  # neither side ran
    text = present.lm_compile_sentence(present.lm_compile_speedups(lm), lm)
    assert text.startswith("Whole model (context 512, batch 4, bf16)")
    assert "small train step 50 → 20 ms (2.5x" in text and "compiled faster" in text
    assert "xl train step 100 → 98 ms" in text and "compiled within noise of eager" in text
    assert "10B forward" in text and "Did not fit (every mode or some): 10B eager, 10B compiled" in text
    assert present.plot_lm_compile(present.lm_compile_speedups(lm)) is not None
    assert list(present.lm_table(lm).columns)[:3] == ["size", "compile", "fwd_ms"]
    assert list(present.lm_table(lm).columns)[-2:] == ["status", "error"]


def test_size_text():
    assert present.size_text(512) == "512 MiB" and present.size_text(8192) == "8 GiB"
    assert present.size_text(math.nan) == "n/a"
