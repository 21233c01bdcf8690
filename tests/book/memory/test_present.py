"""lab.book.memory.present: the 03 notebook's claims, tables, ledger entries and plots, from small synthetic
inputs; claims are checked by their numbers and verdicts, never their wording."""

import math

import matplotlib
import pandas as pd
import pytest

from lab.book import claims as cl
from lab.book.memory import present as mb
from lab.book.memory.workload import MemorySetup
from lab.model import ModelConfig

matplotlib.use("Agg")

MiB, GiB = 2**20, 2**30

SETUP = MemorySetup(size="toy", model=ModelConfig(d_model=64, d_ff=256, num_layers=4, num_heads=4, context_length=64,
                                                  vocab_size=1000), batch=4, timeline_context=64, block_context=64,
                    checkpoint_context=64, peak_contexts=(32, 64))


def values(claim) -> dict:
    """Label -> number of a claim's findings (a value's median, a share's fraction, a side-by-side's ratio)."""
    out = {}
    for f in claim.findings:
        if isinstance(f, cl.Value):
            out[f.measured.label] = f.measured.median if f.measured.ok else f.measured.text()
        elif isinstance(f, cl.Share):
            out[f.label] = f.fraction
        elif isinstance(f, cl.Observed):
            out[f.label] = f.seen
    return out


def _phases():
    rows = [("forward", "forward 1", 2.0, 1.0, 1.8), ("forward", "after forward", 1.8, 1.8, 1.0),
            ("train_step", "forward 1", 2.0, 1.0, 1.8), ("train_step", "backward 1", 2.2, 1.8, 1.4),
            ("train_step", "optimizer_step 1", 2.5, 1.4, 1.5), ("train_step", "forward 2", 2.5, 1.5, 2.3),
            ("train_step", "backward 2", 2.7, 2.3, 1.9), ("train_step", "optimizer_step 2", 2.5, 1.9, 1.5)]
    return pd.DataFrame(rows, columns=["recording", "phase", "peak_gib", "start_gib", "end_gib"])


def test_timeline_claims_name_each_peak_and_what_each_phase_holds():
    peaks = [f.seen if isinstance(f, cl.Observed) else f.measured.median for f in mb.timeline_claim(_phases()).findings]
    assert peaks == ["`forward 1`", 2 * GiB, "`backward 2`", pytest.approx(2.7 * GiB)]
    held = list(values(mb.phases_claim(_phases(), parameter_bytes=0.25 * GiB)).values())
    # forward builds 0.8 GiB on 1 GiB; step 1 peaks 2 and 2.2; optimizer state 0.5 GiB = 2 x 0.25 GiB; step 2
    # leaves memory where step 1 did and peaks 0.5 GiB above step 1's backward
    assert held[:6] == pytest.approx([0.8 * GiB, GiB, 2 * GiB, 2.2 * GiB, 0.5 * GiB, 0.5 * GiB])
    assert held[6:] == ["to the byte", pytest.approx(0.5 * GiB)]
    assert not cl.machine_phrases(cl.sentence(mb.phases_claim(_phases(), 0.25 * GiB)))  # no "0 B higher"
    assert mb.phase_peaks_display(_phases(), "train_step")["phase"].iloc[2] == "optimizer step 1"


def test_residual_allocation_and_gradient_claims():
    residual = pd.DataFrame(dict(context=[64], batch=[4], d_model=[64], num_layers=[4], residual_bytes=[65536]))
    assert list(values(mb.residual_claim(residual, SETUP)).values()) == [65536, 4 * 65536]  # 4 x 64 x 64 x 4 B
    largest = pd.DataFrame(dict(size_mib=[0.977, 0.25], origin=["head.py:1:f", "ffn.py:2:g"]))
    origins = pd.DataFrame(dict(origin=["ffn.py:2:g"], count=[8], total_mib=[2.0], share=[0.5]))
    got = list(values(mb.allocations_claim(largest, origins, SETUP)).values())
    # the largest and its line; logits 4 x 64 x 1000 x 4 B, FFN hidden 4 x 64 x 256 x 4 B; the top line's count,
    # bytes and share
    assert got == [0.977 * MiB, "`head.py:1:f`", 4 * 64 * 1000 * 4, 4 * 64 * 256 * 4, "`ffn.py:2:g`", 8, 2 * MiB, 0.5]
    grads = pd.DataFrame(dict(block=[0, 1, 2], measured_bytes=[3 * MiB, MiB, MiB], expected_bytes=[MiB] * 3,
                              measured_mib=[3.0, 1.0, 1.0], expected_mib=[1.0] * 3, ratio=[3.0, 1.0, 1.0]))
    # blocks 1-2: 1 MiB each, as expected; block 0's 2 MiB extra against the embedding's 1000 x 64 x 4 B
    assert list(values(mb.gradients_claim(grads, SETUP)).values()) == [MiB, MiB, 1.0, 2 * MiB, 1000 * 64 * 4]
    assert [p.get_height() for p in mb.gradients_figure(grads).axes[0].patches] == [3.0, 1.0, 1.0]


def test_pages_claim_names_what_opens_offline():
    pages = pd.DataFrame(dict(snapshot=["f", "f"], page=["offline", "memory_viz"], path=["a.html", "b.html"],
                              external=["none", "https://cdn.example/x.js"], works_offline=[True, False]))
    claim = mb.pages_claim(pages)
    assert [f.seen for f in claim.findings] == ["`a.html`", "`b.html`"] and "`cdn.example`" in claim.findings[1].label
    assert mb.pages_claim(pages.iloc[:0]).findings == ()


def _peaks():
    rows = [("forward", 128, "fp32", 10.0, "ok"), ("forward", 128, "bf16", 12.0, "ok"),
            ("forward", 2048, "fp32", 40.0, "ok"), ("forward", 2048, "bf16", 30.0, "ok"),
            ("train_step", 128, "fp32", 50.0, "ok"), ("train_step", 128, "bf16", 50.0, "ok"),
            ("train_step", 2048, "fp32", math.nan, "oom"), ("train_step", 2048, "bf16", 90.0, "ok")]
    return pd.DataFrame(rows, columns=["mode", "context", "dtype", "peak_gib", "status"]).assign(
        limit_gib=79.0, size="toy", batch=4)


def test_peak_pivot_and_mixed_precision_claim():
    pivot = mb.peak_pivot(_peaks())
    assert pivot.columns.tolist() == ["mode", "context", "bf16", "fp32"]
    assert pivot.loc[(pivot["mode"] == "train_step") & (pivot["context"] == 2048), "fp32"].item() == \
        "out of memory at 79 GiB"  # not the allocator's message
    claim = mb.mixed_precision_claim(_peaks())
    got = values(claim)
    # bf16 over fp32 per mode at the shortest and longest context both fit: 1.2 and 0.75 forward, 1 for the step
    assert [v for k, v in got.items() if "over fp32" in k] == [1.2, 0.75, 1.0]
    assert got["train step at context 2048 in fp32"] == "out of memory at 79 GiB"
    assert "more memory" in claim.because and "grows with the context" in claim.because
    assert not cl.machine_phrases(cl.sentence(claim))


def test_the_saving_grows_only_when_it_grows_at_every_context():
    """-0.2%, 0%, +1.1%, -15.5% (03's H200 training step) is not a saving that grows with the context."""
    rows = [("train_step", c, d, v, "ok") for c, f, b in ((128, 100.0, 99.8), (256, 100.0, 100.0),
                                                           (512, 100.0, 101.1), (2048, 100.0, 84.5))
            for d, v in (("fp32", f), ("bf16", b))]
    uneven = mb.mixed_precision_claim(pd.DataFrame(rows, columns=["mode", "context", "dtype", "peak_gib", "status"]))
    assert "does not grow steadily" in uneven.because


def _sweep():
    rows = [("none", math.nan, 60.0, 1000.0, "ok"), ("single", 1, 40.0, 1400.0, "ok"),
            ("single", 2, 41.0, 1350.0, "ok"), ("single", 4, 45.0, 1300.0, "ok"),
            ("single", 8, math.nan, math.nan, "oom"), ("nested", math.nan, 40.2, 2000.0, "ok")]
    df = pd.DataFrame(rows, columns=["strategy", "group_size", "peak_gib", "step_ms", "status"])
    return df.assign(step_spread_ms=df["step_ms"] * 0.01, step_n=5, limit_gib=79.0, size="toy", context=64,
                     batch=4, dtype="fp32")


def test_checkpoint_claim_best_group_neighbours_and_times():
    claim = mb.checkpoint_claim(_sweep(), parameter_bytes=8 * GiB)
    got = values(claim)
    assert got["the best single-level group size k"] == 1 and got["its peak"] == 40 * GiB
    assert got["k = 2"] == 41 * GiB and "k = 4" not in got  # the next larger size measured; no smaller one
    assert got["no checkpointing"] == 60 * GiB and got["nested"] == 40.2 * GiB
    none, nested = (f for f in claim.findings if isinstance(f, cl.Versus))
    assert (none.subject.median, none.reference.median, none.verdict) == (1000.0, 1400.0, "faster")
    assert (nested.subject.median, nested.verdict) == (2000.0, "slower")
    assert got["of the best peak, parameters, gradients and AdamW's moments"] == pytest.approx(32 / 40)
    oom = _sweep()
    oom.loc[3, "peak_gib"] = 30.0  # k = 4 best, its larger neighbour k = 8 out of memory
    got = values(mb.checkpoint_claim(oom, parameter_bytes=GiB))
    assert got["the best single-level group size k"] == 4 and got["k = 8"] == "out of memory at 79 GiB"
    assert got["k = 2"] == 41 * GiB
    assert mb.checkpoint_claim(_sweep().assign(status="oom"), GiB).findings == ()
    fig = mb.checkpoint_figure(_sweep().assign(modelled_peak_gib=50.0), "toy")
    assert [line.get_label() for line in fig.axes[0].lines[:2]] == ["measured peak", "model: 4×params + (N/k)·r + k·A"]
    assert list(fig.axes[0].lines[0].get_xdata()) == [1, 2, 4]


def test_checkpoint_model_claim():
    model = pd.DataFrame(dict(strategy=["none", "single", "single", "nested"], group_size=[math.nan, 1, 2, math.nan],
                              modelled_bytes=[40 * MiB, 14 * MiB, 24 * MiB, 12 * MiB],
                              extra_forwards=[0, 1, 1, 1.5], boundary_bytes=MiB, block_bytes=10 * MiB, k_star=0.63))
    # r, A, k*, the predicted k and its activations, none's, nested's and its extra forwards
    assert list(values(mb.checkpoint_model_claim(model)).values()) == [MiB, 10 * MiB, 0.63, 1, 14 * MiB, 40 * MiB,
                                                                      12 * MiB, 1.5]


def test_ledger_entries_are_keyed_by_what_was_measured():
    entries = mb.ledger_entries(_peaks(), _sweep())
    keys = [e["key"] for e in entries]
    assert len(entries) == 7 + 4  # the seven peaks that fit; k = 1, 2, 4 and nested (k = 8 ran out of memory)
    assert all(e["kind"] == "peak_memory" and e["unit"] == "GiB" for e in entries)
    assert '"checkpoint": "none"' in keys[0] and '"mode": "forward"' in keys[0] and '"context": 128' in keys[0]
    assert [e["median"] for e in entries[-4:]] == [40.0, 41.0, 45.0, 40.2]
    assert '"checkpoint": "k=1"' in keys[7] and '"checkpoint": "nested"' in keys[-1]
    assert len(set(keys)) == len(keys)  # no two entries of one report share a key
