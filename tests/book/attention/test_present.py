"""lab.book.attention: notebook 04's claims, tables and plots, from small synthetic grids and lm_step rows. The
claims are checked by their numbers and verdicts, never by their wording."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book import claims as cl
from lab.book import report
from lab.book.attention import present, whole_model

matplotlib.use("Agg")

MiB = 2**20


def _grid_row(d, seq, compile=False, fwd=1.0, bwd=2.0, status="ok", oom_phase="", spread=0.01, n=100, batch=8,
              dtype="fp32", **extra):
    e = 4 if dtype == "fp32" else 2
    saved = batch * seq * seq * e / MiB
    row = dict(impl="naive", compile=compile, batch=batch, seq_len=seq, d=d, dtype=dtype, causal=False,
               fwd_ms=fwd, fwd_spread_ms=spread * fwd, fwd_n=n, bwd_ms=bwd, bwd_spread_ms=spread * bwd, bwd_n=n,
               mem_baseline_mib=64.0, mem_before_bwd_mib=64.0 + saved + 5 * batch * seq * d * e / MiB,
               peak_mib=math.nan, saved_mib=saved, predicted_saved_mib=saved,
               predicted_before_bwd_mib=saved + 5 * batch * seq * d * e / MiB,
               predicted_peak_mib=3 * saved + 5 * batch * seq * d * e / MiB, compile_s=1.0 if compile else math.nan,
               gpu="NVIDIA H100 80GB HBM3", limit_gib=80.0, status=status, oom_phase=oom_phase, error="")
    if status != "ok":
        row.update(fwd_ms=math.nan, bwd_ms=math.nan, saved_mib=math.nan, mem_before_bwd_mib=math.nan)
    return {**row, **extra}


def _values(claim) -> dict:
    return {f.measured.label: f.measured for f in claim.findings if isinstance(f, cl.Value)}


def _versus(claim) -> list:
    return [f for f in claim.findings if isinstance(f, cl.Versus)]


def test_profile_defaults_fill_the_knobs_a_notebook_leaves_none():
    quick = report.with_profile_defaults(dict(ds=None, seqs=[32], passes=None, lm_steps=None), present.QUICK)
    assert quick == dict(ds=(16, 32), seqs=(32,), passes=5, lm_steps=5)  # five samples: the fewest a verdict takes
    full = report.with_profile_defaults(dict(seqs=None, lm_sizes=None, lm_dtype=None), present.FULL)
    assert full["seqs"] == (256, 1024, 4096, 8192, 16384) and full["lm_dtype"] == "bf16" and len(full["lm_sizes"]) == 6


def test_fit_claim_counts_the_oom_rows_and_names_the_first():
    grid = pd.DataFrame([_grid_row(16, 4096), _grid_row(16, 8192, status="oom", oom_phase="backward"),
                         _grid_row(64, 2048), _grid_row(64, 4096, status="oom", oom_phase="forward")])
    claim = present.fit_and_time_claim(grid)
    values = _values(claim)
    assert values["configurations measured"].median == 4 and values["out of memory"].median == 2
    first = next(m for m in values.values() if m.status == "oom")
    assert "d=64, 4096 tokens" in first.label and first.limit_gib == 80.0  # the shortest length that did not fit
    assert first.text() == "out of memory at 80 GiB"
    assert [f.seen for f in claim.findings if isinstance(f, cl.Observed)] == ["forward"]
    assert values["shortest length out of memory at d=16"].median == 8192
    assert values["shortest length out of memory at d=64"].median == 4096
    assert not cl.machine_phrases(cl.sentence(claim))


def test_time_claim_compares_backward_with_forward_and_d_with_flops():
    grid = pd.DataFrame([_grid_row(16, 1024, fwd=1.0, bwd=2.0), _grid_row(16, 4096, fwd=10.0, bwd=20.0),
                         _grid_row(128, 4096, fwd=12.0, bwd=30.0)])
    claim = present.fit_and_time_claim(grid)
    backward, growth = _versus(claim)
    assert (backward.subject.median, backward.reference.median, backward.verdict) == (30.0, 12.0, "slower")
    assert (growth.subject.median, growth.reference.median, growth.verdict) == (12.0, 10.0, "slower")
    assert _values(claim)["the FLOP ratio of the two"].median == 8
    assert "far less" in claim.because  # 1.2x the time for 8x the FLOPs
    in_step = present.fit_and_time_claim(pd.DataFrame([_grid_row(16, 64, fwd=1.0), _grid_row(32, 64, fwd=1.9)]))
    assert "in step" in in_step.because
    runaway = present.fit_and_time_claim(pd.DataFrame([_grid_row(16, 64, fwd=1.0), _grid_row(32, 64, fwd=74.0)]))
    assert "far more" in runaway.because  # 74x the time for 2x the FLOPs: not the matmuls' doing


def test_d_growth_is_read_only_beyond_the_noise():
    quieter = present.fit_and_time_claim(pd.DataFrame([_grid_row(16, 4096, fwd=10.0), _grid_row(32, 4096, fwd=9.0)]))
    assert _versus(quieter)[1].verdict == "faster" and "load" in quieter.because
    noisy = pd.DataFrame([_grid_row(16, 4096, fwd=10.0, spread=0.5), _grid_row(32, 4096, fwd=9.0, spread=0.5)])
    claim = present.fit_and_time_claim(noisy)
    assert _versus(claim)[1].verdict == "within noise" and "within noise" in claim.because
    few = pd.DataFrame([_grid_row(16, 4096, fwd=10.0, n=3), _grid_row(32, 4096, fwd=20.0, n=3)])
    claim = present.fit_and_time_claim(few)
    assert _versus(claim)[1].verdict == "not decided" and claim.because == ""


def test_accounting_claim_for_the_smallest_oom_and_the_largest_fit():
    row = _grid_row(16, 16384, status="oom", oom_phase="backward", limit_gib=20.0)
    grid = pd.DataFrame([_grid_row(16, 4096), row])
    claim = present.accounting_claim(grid)
    values = _values(claim)
    assert values["the probability matrix alone, batch × seq² × element size"].median == 8 * 16384**2 * 4
    assert values["predicted backward peak, at least"].median == row["predicted_peak_mib"] * MiB
    assert values["the GPU's memory"].median == 20 * 2**30
    assert "exceeds" in claim.because  # three 8 GiB score-sized tensors: past 20 GiB
    fits = present.accounting_claim(pd.DataFrame([_grid_row(16, 1024), _grid_row(16, 4096)]))
    assert "4096 tokens" in fits.findings[0].seen
    ratios = [m.median for label, m in _values(fits).items() if "measured over predicted" in label]
    assert ratios == [1.0, 1.0]  # saved and allocated before the backward; the peak was not measured (NaN)
    check = present.naive_memory_check(pd.Series(_grid_row(16, 64, peak_mib=100.0)))
    assert check["measured_mib"].iloc[2] == 36.0  # the peak above the configuration's 64 MiB baseline


def test_accounting_claim_says_when_the_prediction_fits_the_gpu():
    row = _grid_row(16, 4096, status="oom", oom_phase="forward", limit_gib=80.0)
    assert row["predicted_peak_mib"] / 1024 < 80
    assert "below" in present.accounting_claim(pd.DataFrame([row])).because


def test_scaling_claim_fits_the_exponent_and_sets_naive_against_flash():
    grid = pd.DataFrame([_grid_row(d, s) for d in (16, 64) for s in (1024, 4096)])
    scaling = present.saved_memory_scaling(grid)
    assert scaling["p_longest"].tolist() == pytest.approx([2.0, 2.0])
    claim = present.scaling_claim(grid)
    values = _values(claim)
    assert values["exponent p of saved memory ∝ seqᵖ between the two longest lengths"].median == pytest.approx(2.0)
    # d=16 at 4096 tokens: P 8 x 4096² x 4 B = 512 MiB, plus q, k, v 3 x 8 x 4096 x 16 x 4 B = 6 MiB
    assert values["kept by naive attention at the longest length, q, k, v included, lowest"].median == 518 * MiB
    assert "Quadratic" in claim.because
    curves = present.saved_memory_curves(grid)
    assert set(curves["method"]) == {"naive (measured)", "FlashAttention (closed form)"}
    assert present.scaling_claim(grid.iloc[:1]).findings == ()


def _compiled_grid():
    rows = [_grid_row(16, 64, fwd=2.0, bwd=4.0), _grid_row(16, 64, compile=True, fwd=1.0, bwd=8.0),
            _grid_row(16, 128, fwd=1.0, bwd=4.0, spread=0.2), _grid_row(16, 128, compile=True, fwd=0.99, bwd=4.0,
                                                                         spread=0.2)]
    return pd.DataFrame(rows)


def test_compile_table_and_claim_follow_the_rule():
    grid = _compiled_grid()
    table = present.compile_table(grid)
    assert table["fwd_verdict"].tolist() == ["faster", "within noise"]
    assert table["bwd_verdict"].tolist() == ["slower", "within noise"]
    assert table["fwd_ratio"].tolist() == [0.5, 0.99]  # compiled / eager
    claim = present.compile_claim(grid)
    forward, backward = (f for f in claim.findings if isinstance(f, cl.Tally))
    assert forward.counts() == {"faster": 1, "within noise": 1} and backward.counts() == {"slower": 1,
                                                                                            "within noise": 1}
    best = _versus(claim)[0]
    assert best.comparison.speedup == 2.0 and "d=16, 64 tokens" in best.subject.label
    assert _values(claim)["compile time, every shape together"].median == 2.0
    assert "Fusing" in claim.because  # the compiled graph still saves a quadratic tensor
    eager_only = present.compile_claim(present.rows(grid).assign(compile=False))
    assert eager_only.findings == () and "eagerly only" in eager_only.because
    assert present.plot_compile_ratios(table) is not None


def test_compile_claim_counts_configurations_that_fit_only_compiled():
    grid = pd.DataFrame([_grid_row(16, 64), _grid_row(16, 64, compile=True),
                         _grid_row(16, 128, status="oom", oom_phase="forward"), _grid_row(16, 128, compile=True)])
    claim = present.compile_claim(grid)
    assert _values(claim)["configurations out of memory eagerly that fit compiled"].median == 1
    forward = next(f for f in claim.findings if isinstance(f, cl.Tally))
    assert forward.counts()["out of memory at 80 GiB"] == 1


# ---------------------------------------------------------------------------------------------------------
# the whole model


def _lm_row(size, compile, fwd, step, status="ok", spread=0.01, n=5, **extra):
    return dict(size=size, compile=compile, context=512, batch=4, dtype="bf16", attention="sdpa", fused_loss=False,
                fwd_ms=fwd, fwd_spread_ms=spread * fwd, fwd_n=n, fwdbwd_ms=math.nan, fwdbwd_spread_ms=math.nan,
                fwdbwd_n=0, step_ms=step, step_spread_ms=spread * step if step == step else math.nan,
                step_n=n if step == step else 0, fwd_peak_gib=1.0, step_peak_gib=2.0, status=status,
                limit_gib=80.0, **extra)


def test_lm_claim_compares_compiled_with_eager_size_by_size():
    lm = pd.DataFrame([_lm_row("small", False, 10.0, 40.0), _lm_row("small", True, 5.0, 30.0),
                       _lm_row("10B", False, 100.0, math.nan, status="oom"),
                       _lm_row("10B", True, 100.5, math.nan, status="oom", spread=0.2)])
    table = whole_model.lm_table(lm)
    assert table[["size", "mode"]].values.tolist() == [["small", "forward"], ["small", "train step"],
                                                        ["10B", "forward"], ["10B", "forward+backward"],
                                                        ["10B", "train step"]]  # a mode out of memory is a row
    assert table["verdict"].tolist() == ["faster", "faster", "within noise"] + ["out of memory at 80 GiB"] * 2
    assert table["ratio"].iloc[0] == 0.5 and table["compiled_peak_gib"].iloc[1] == 2.0
    claim = whole_model.lm_claim(lm)
    small, big, tally = claim.findings
    assert (small.subject.median, small.reference.median) == (30.0, 40.0)  # the train step, where it ran
    assert big.verdict == "out of memory at 80 GiB"
    assert tally.counts() == {"faster": 2, "within noise": 1, "out of memory at 80 GiB": 2}
    assert whole_model.plot_lm_compile(lm) is not None
    few = pd.DataFrame([_lm_row("tiny", False, 10.0, 40.0, n=3), _lm_row("tiny", True, 5.0, 20.0, n=3)])
    assert {v.verdict for _, _, v in whole_model.lm_versus(few)} == {"not decided"}


def test_lm_eager_vs_compiled_runs_each_size_eager_then_compiled(monkeypatch):
    calls = []

    def fake_compare(size, variants, **kwargs):
        calls.append((size, [dict(v) for v in variants]))
        return pd.DataFrame([dict(size=size, compile=bool(v.get("compile", False))) for v in variants])

    monkeypatch.setattr(whole_model, "compare_variants", fake_compare)
    df = whole_model.lm_eager_vs_compiled(["tiny", "mini"], context=32, device="cpu", progress=False)
    assert calls == [(s, [dict(attention="sdpa"), dict(attention="sdpa", compile=True)]) for s in ("tiny", "mini")]
    assert df["compile"].tolist() == [False, True] * 2
