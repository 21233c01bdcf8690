"""The render-time cross-notebook check finds configurations measured twice that disagree beyond noise."""

import pandas as pd

from lab.book.consistency import consistency_report, disagreements


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
    (sentence,) = consistency_sentences(table, "04_attention")
    assert "25.4 ms in 02_mixed_precision" in sentence and "47.4 ms in 04_attention" in sentence
    assert consistency_sentences(table, "01_profiling") == []


def test_rows_without_spread_or_source_are_not_judged():
    table = pd.DataFrame([{**BASE, "source": "a", "fwd_ms": 1.0, "fwd_std_ms": float("nan")},
                          {**BASE, "source": "b", "fwd_ms": 9.0, "fwd_std_ms": 0.1}])
    assert disagreements(table).empty
    assert disagreements(table.drop(columns="source")).empty


def test_a_percent_between_runs_is_counted_not_warned():
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
    (warning,) = consistency_sentences(table, "02_mixed_precision")
    assert "80.4 ms in 01_profiling" in warning
    note = small_differences_sentence(table, "02_mixed_precision")
    assert note.startswith("1 more time measured again in 01_profiling differs") and "at most 1.0%" in note
    assert small_differences_sentence(table.iloc[2:], "02_mixed_precision") == ""
