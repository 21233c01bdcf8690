"""The render-time check: configurations measured twice must agree, a step cannot beat its own
forward+backward; on GPU rows either fails the render, on CPU rows it is a warning."""

import pandas as pd
import pytest

from lab.book.consistency import InconsistentTimings, consistency_report, disagreements, impossible_rows
from tests.book.prose import amounts, numbers


def consistency_sentences(table, notebook):
    return consistency_report(table, notebook)[0]


def small_differences_sentence(table, notebook):
    return consistency_report(table, notebook)[1]

BASE = dict(size="small", context=512, batch=4, dtype="bf16", attention="sdpa", compile=False, fused_loss=False,
            world_size=1, gpu="G", status="ok", steps=10)


def test_disagreement_beyond_noise_is_found_and_agreement_is_not():
    table = pd.DataFrame([
        {**BASE, "source": "02_mixed_precision", "fwdbwd_ms": 25.4, "fwdbwd_std_ms": 0.5},
        {**BASE, "source": "04_attention", "fwdbwd_ms": 47.4, "fwdbwd_std_ms": 0.8},
        {**BASE, "context": 256, "source": "02_mixed_precision", "fwdbwd_ms": 10.0, "fwdbwd_std_ms": 2.0},
        {**BASE, "context": 256, "source": "04_attention", "fwdbwd_ms": 10.5, "fwdbwd_std_ms": 2.0},
    ])
    d = disagreements(table)
    assert len(d) == 1 and d.iloc[0]["context"] == 512 and d.iloc[0]["mode"] == "fwdbwd"
    with pytest.raises(InconsistentTimings) as err:
        consistency_report(table, "04_attention")
    assert "\n" not in str(err.value) and "25.4" in str(err.value) and "47.4" in str(err.value)
    assert consistency_sentences(table, "01_profiling") == []
    on_cpu = table.assign(gpu="cpu")
    assert len(consistency_sentences(on_cpu, "04_attention")) == 1  # a shared CPU's times: warned, not failed


def test_rows_without_spread_or_source_are_not_judged():
    table = pd.DataFrame([{**BASE, "source": "a", "fwd_ms": 1.0, "fwd_std_ms": float("nan")},
                          {**BASE, "source": "b", "fwd_ms": 9.0, "fwd_std_ms": 0.1}])
    assert disagreements(table).empty
    assert disagreements(table.drop(columns="source")).empty


def test_a_percent_between_runs_is_counted_not_failed():
    """H100, 2.7B fwdbwd: 130.5 ms in one notebook, 129.9 ms in another, each with a tiny within-run spread:
    beyond the noise, but run-to-run variation, not a disagreement."""
    table = pd.DataFrame([
        {**BASE, "source": "01_profiling", "fwdbwd_ms": 130.5, "fwdbwd_std_ms": 0.2},
        {**BASE, "source": "02_mixed_precision", "fwdbwd_ms": 129.2, "fwdbwd_std_ms": 0.2},
        {**BASE, "context": 256, "source": "01_profiling", "fwdbwd_ms": 80.4, "fwdbwd_std_ms": 1.0},
        {**BASE, "context": 256, "source": "02_mixed_precision", "fwdbwd_ms": 57.8, "fwdbwd_std_ms": 1.0},
    ])
    d = disagreements(table).set_index("context")
    assert len(d) == 2 and not d.loc[512, "beyond_tolerance"] and d.loc[256, "beyond_tolerance"]
    with pytest.raises(InconsistentTimings, match="80.4"):
        consistency_report(table, "02_mixed_precision")
    assert consistency_report(table.iloc[[0, 1]], "02_mixed_precision")[0] == []
    note = small_differences_sentence(table.iloc[[0, 1]], "02_mixed_precision")
    # one configuration, the other notebook; the largest difference against the run-to-run tolerance
    assert numbers(note)[0] == 1 and "01_profiling" in note and amounts(note) == [(1.0, "%"), (5, "%")]
    assert small_differences_sentence(table.iloc[2:].assign(gpu="cpu"), "02_mixed_precision") == ""


def test_a_step_faster_than_its_own_forward_backward_beyond_noise_fails_the_render():
    """A 04-like eager row: train step 134 ms, its forward+backward 150 ms. With ten steps of 1 ms spread each
    that is beyond the noise; with a spread as wide as the gap it is not."""
    row = {**BASE, "source": "04_attention", "fwd_ms": 59.0, "fwd_std_ms": 1.0, "fwdbwd_ms": 150.0,
           "fwdbwd_std_ms": 1.0, "step_ms": 134.0, "step_std_ms": 1.0}
    bad = impossible_rows(pd.DataFrame([row]))
    assert bad[["faster", "slower"]].values.tolist() == [["step", "fwdbwd"]]
    assert bad.iloc[0]["ratio"] == pytest.approx(134 / 150) and bad.iloc[0]["high"] < 1
    with pytest.raises(InconsistentTimings, match="small@512"):
        consistency_report(pd.DataFrame([row]), "04_attention")
    assert consistency_report(pd.DataFrame([row]), "01_profiling") == ([], "")  # only a notebook's own rows
    noisy = {**row, "fwdbwd_std_ms": 21.0, "step_std_ms": 11.0, "steps": 5}
    assert impossible_rows(pd.DataFrame([noisy])).empty
    backwards = {**row, "fwd_ms": 160.0, "step_ms": 170.0}  # a forward+backward faster than its forward
    assert impossible_rows(pd.DataFrame([backwards]))[["faster", "slower"]].values.tolist() == [["fwdbwd", "fwd"]]
    (warning,) = consistency_sentences(pd.DataFrame([{**row, "gpu": "cpu"}]), "04_attention")
    assert "134" in warning and "150" in warning


def test_rows_timed_another_way_are_not_compared():
    """Rows measured with the interleaved timer are compared only with rows timed the same way: a row that
    predates the ``timer`` column (modes measured one after the other) neither fails nor excuses a new one."""
    table = pd.DataFrame([
        {**BASE, "source": "01_profiling", "timer": "interleaved", "fwdbwd_ms": 25.4, "fwdbwd_std_ms": 0.5},
        {**BASE, "source": "04_attention", "fwdbwd_ms": 47.4, "fwdbwd_std_ms": 0.8},
    ])
    assert disagreements(table).empty
    assert consistency_report(table, "01_profiling")[0] == []
    both = table.assign(timer="interleaved")
    assert len(disagreements(both)) == 1
