"""lab.book.flash.present: notebook 05's settings and its claims about correctness, the course's test and the model,
and the rows it enters into the ledger, from synthetic tables (values and verdicts)."""

import json
import math

import pandas as pd
import pytest

from lab.bench.attention_grid import Shape
from lab.book import ledger
from lab.book.claims import Observed, Value, Versus
from lab.book.flash import bench as fl
from lab.book.flash import present
from tests.book.flash.rows import GPU, grid_row, table


def _knobs(**given):
    knobs = dict(check_impls=None, check_ds=None, check_dtypes=["bf16", "fp32"], check_seq=None, impls=None,
                 shapes=None, dtypes=None, pytorch_flash_max_seq=None, pytorch_flash_dtypes=["bf16"],
                 fp32_impls=["triton", "sdpa", "pytorch_naive"], fp32_seqs=None, fp32_ds=None, warmup_ms=5, rep_ms=20,
                 cpu_steps=5, course_shape=None, course_compile=None, course_goal_ms=4.6, lm_size=None,
                 lm_context=None, lm_batch=None, lm_dtype=None, lm_compile=None, lm_warmup=None, lm_steps=None,
                 ceiling_n=None)
    return {**knobs, **given}


def test_settings_profiles_shapes_and_variants():
    full = present.settings(False, "cuda", **_knobs())
    assert full.shapes == fl.LM_SHAPES and full.check_ds == (64, 80, 96, 128) and full.lm_size == "2.7B"
    assert full.dtypes == ("bf16", "fp16") and full.lm_steps >= 5 and "flex" in full.impls
    assert full.lm_variants == [dict(attention="sdpa", compile=False), dict(attention="flash_triton", compile=False),
                                dict(attention="sdpa", compile=True), dict(attention="flash_triton", compile=True)]
    sweeps = full.sweeps
    assert sweeps["lm"]["graph_max_seq"] == fl.GRAPH_MAX_SEQ and sweeps["fp32"]["dtypes"] == ("fp32",)
    assert len(sweeps["fp32"]["shapes"]) == 6 and sweeps["lm"]["skip"]("pytorch_flash", fl.LM_SHAPES[0], "bf16")
    quick = present.settings(True, "cpu", **_knobs(shapes=[[1, 2, 32, 16, True]]))
    assert quick.shapes == (Shape(1, 2, 32, 16, True),) and quick.dtypes == ("bf16",) and quick.lm_steps >= 5
    assert "flex" not in quick.impls and quick.course_compile == (False,) and quick.cpu_steps >= 5
    assert quick.params()["shapes"] == [[1, 2, 32, 16, True]]


def _errors(impl, dtype, d, worst, status="ok"):
    e = worst if status == "ok" else math.nan
    return dict(impl=impl, dtype=dtype, d=d, seq_len=64, out=e / 2, dq=e, dk=e / 3, dv=e / 4, status=status,
                note="" if status == "ok" else "not supported")


def test_correctness_summary_and_claim():
    errors = pd.DataFrame([
        _errors("pytorch_naive", "bf16", 64, 1e-2), _errors("pytorch_naive", "bf16", 80, 2e-2),
        _errors("triton", "bf16", 64, 2e-2), _errors("triton", "bf16", 80, 0, status="unsupported"),
        _errors("sdpa_cudnn", "bf16", 64, 0, status="unsupported"), _errors("sdpa_cudnn", "bf16", 80, 0, "x"),
        _errors("pytorch_naive", "fp32", 64, 5e-8), _errors("sdpa", "fp32", 64, 2e-7)])
    s = present.correctness_summary(errors).set_index(["impl", "dtype"])
    assert s.loc[("triton", "bf16"), "ratio_to_naive"] == pytest.approx(2.0)
    assert s.loc[("triton", "bf16"), "verdict"] == "agrees" and s.loc[("triton", "bf16"), "unsupported_d"] == "80"
    assert s.loc[("sdpa_cudnn", "bf16"), "verdict"] == "not supported"
    # naive fp32's error 5e-8 is below one fp32 epsilon: the ratio is taken to the floor
    assert s.loc[("sdpa", "fp32"), "ratio_to_naive"] == pytest.approx(2e-7 / 2**-23)
    claim = present.correctness_claim(present.correctness_summary(errors))
    worst, beyond, unsupported = claim.findings
    assert worst.measured.median == pytest.approx(2.0) and "triton" in worst.measured.label
    assert beyond.seen == "none" and "triton bf16" in unsupported.seen and "sdpa_cudnn bf16" in unsupported.seen
    bad = pd.concat([errors, pd.DataFrame([_errors("triton", "fp32", 64, 1e-3)])], ignore_index=True)
    claim = present.correctness_claim(present.correctness_summary(bad))
    assert claim.findings[0].measured.median == pytest.approx(1e-3 / 2**-23) and claim.findings[1].seen == "triton fp32"


def _course(ms, spread, gpu, compiled=True, n=20):
    return dict(compiled=compiled, batch=16, seq_len=16384, d=64, dtype="bf16", causal=True, fwdbwd_ms=ms,
                fwdbwd_spread_ms=spread, fwdbwd_n=n, gpu=gpu)


def test_course_claim_applies_the_goal_on_its_card_only():
    course = pd.DataFrame([_course(4.0, 0.05, GPU), _course(4.59, 0.3, GPU, compiled=False)])
    shape = Shape(1, 16, 16384, 64)
    bench = table(grid_row("triton", shape, ms=1.0, factors=(1.0, 3.0, 5.2)),
                  grid_row("sdpa", shape, ms=1.0, factors=(1.0, 3.0, 4.4)))
    compiled, eager, grid_vs, allowed = present.course_claim(course, bench).findings
    assert compiled.goal == 1.0 and compiled.goal_word == "met" and compiled.comparison.ratio == pytest.approx(4 / 4.6)
    assert eager.goal_word == "undecided"  # its spread covers the gap to the goal
    assert grid_vs.comparison.ratio == pytest.approx(5.2 / 4.4) and grid_vs.verdict == "slower"
    assert allowed.measured.median == pytest.approx(4.6 / 4.4)
    h200 = present.course_claim(pd.DataFrame([_course(5.0, 0.05, "NVIDIA H200")]), bench)
    assert h200.findings[0].goal is None and h200.findings[0].verdict == "slower" and h200.because
    cpu = present.course_claim(pd.DataFrame([_course(400.0, 10.0, "cpu", compiled=False, n=5)]), bench.iloc[:0])
    assert [type(f) for f in cpu.findings] == [Value] and present.INTERPRETED in cpu.because


def _lm(attention, compile, step, spread=0.01, device="cuda:0", status="ok"):
    return dict(size="2.7B", context=512, batch=4, dtype="bf16", attention=attention, compile=compile,
                fused_loss=False, step_ms=step, step_spread_ms=spread * step, step_n=7, step_peak_gib=40.0,
                device=device, status=status, limit_gib=79.2, host_bound=False)


def test_lm_claim():
    lm = pd.DataFrame([_lm("sdpa", False, 400.0), _lm("flash_triton", False, 380.0),
                       _lm("sdpa", True, 300.0), _lm("flash_triton", True, 301.0, spread=0.2)])
    findings = present.lm_claim(lm).findings
    assert [f.verdict for f in findings] == ["faster", "within noise", "faster", "faster"]
    assert findings[0].comparison.ratio == pytest.approx(380 / 400)
    assert findings[3].comparison.ratio == pytest.approx(301 / 380)  # flash_triton compiled against eager
    failed = pd.DataFrame([_lm("sdpa", False, 400.0), _lm("flash_triton", False, math.nan, status="oom")])
    (oom,) = present.lm_claim(failed).findings
    assert oom.comparison is None and oom.verdict == "out of memory at 79 GiB"
    cpu = pd.DataFrame([_lm("sdpa", False, 40.0, device="cpu"), _lm("flash_triton", False, 400.0, device="cpu")])
    assert present.INTERPRETED in present.lm_claim(cpu).because


def test_attention_entries_are_the_2_7b_rows_measured_with_samples():
    short = fl.SHAPE_2_7B
    bench = table(grid_row("triton", short, timing="graph", bwd_n=0), grid_row("sdpa", short, timing="graph"),
                  grid_row("sdpa_cudnn", short, status="unsupported"), grid_row("triton", Shape(1, 16, 4096, 64)))
    entries = ledger.attention_entries(bench)
    keys = [json.loads(e["key"]) for e in entries]
    assert [(k["impl"], k["pass"]) for k in keys] == [("triton", "fwd"), ("triton", "e2e"), ("sdpa", "fwd"),
                                                     ("sdpa", "bwd"), ("sdpa", "e2e")]
    assert all(k["timing"] == "graph" and k["seq_len"] == 512 and k["d"] == 80 for k in keys)
    assert [(k["kernel"], k["bwd_kernel"]) for k in keys][::3] == [("triton", "triton"), ("", "")]  # triton, sdpa
    assert entries[0]["median"] == 1.0 and entries[0]["n"] == 50 and not entries[0]["host_bound"]


def test_the_grid_holds_the_leaderboard_and_2_7b_shapes():
    assert Shape(1, 32, 32768, 128) in fl.LM_SHAPES and fl.SHAPE_2_7B in fl.LM_SHAPES
    # only the 2.7B shape is short enough to be replayed from CUDA graphs
    assert [s for s in fl.LM_SHAPES if s.seq <= fl.GRAPH_MAX_SEQ] == [fl.SHAPE_2_7B]


def test_claims_read_as_numbers_not_machine_phrases():
    from lab.book.claims import machine_phrases, sentence

    lm = pd.DataFrame([_lm("sdpa", False, 12345.0), _lm("flash_triton", False, math.nan, status="oom")])
    text = sentence(present.lm_claim(lm))
    assert not machine_phrases(text) and "12,345" in text
    assert isinstance(present.lm_claim(lm).findings[0], Versus)
    assert isinstance(present.correctness_claim(pd.DataFrame(columns=["verdict"])).findings, tuple)
    assert not any(isinstance(f, Observed) for f in present.correctness_claim(pd.DataFrame(columns=["verdict"]))
                   .findings)
