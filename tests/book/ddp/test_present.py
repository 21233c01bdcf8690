"""lab.book.ddp.present: the sentences, tables and goal checks of notebook 07, from small synthetic benchmark tables."""

import json
import math

import matplotlib
import pandas as pd
import pytest

from lab.book.ddp import bench as ddp_bench
from lab.book.ddp import present as ddp_book
from tests.book.prose import amounts, has_amount, in_order, numbers, sentence_with

matplotlib.use("Agg")
GRAD_MB = 64.0
O_MS, W_GBPS = 0.5, 10.0  # the overhead model the synthetic buckets follow


def _samples(ms, k=10, spread=0.005, shift=0):
    """Deterministic rounds within +-2 ``spread`` of ``ms``; rows with different ``shift`` go up and down in
    different rounds (so their per-round ratios vary too)."""
    return json.dumps([ms * (1 + spread * ((i * 7 + shift) % 5 - 2)) for i in range(k)])


def _row(impl, bucket_mb, ms, n_buckets, comm=5.0, overlap=0.0, spread=0.005, world_size=2):
    return dict(impl=impl, bucket_mb=bucket_mb, world_size=world_size, size="tiny", context=32, batch=2, dtype="fp32",
                step_ms=ms, step_iqr_ms=ms * spread, rounds=10, step_samples_ms=_samples(ms, spread=spread),
                comm_ms=comm, overlap_frac=overlap, n_buckets=n_buckets, grad_mb=GRAD_MB, trace=None, status="ok",
                error="", config="tiny fp32")


def bench(single=100.0, torch_ddp=110.0, noisy=False):
    """One config: the bucketed rows follow n*o + s/(n*w) on top of the single-device step."""
    total = GRAD_MB * 2**20
    spread = 0.2 if noisy else 0.005
    rows = [_row("naive", 0.0, 160.0, 40, spread=spread),
            _row("flat", 0.0, single + ddp_bench.bucket_overhead_ms(1, total, O_MS, W_GBPS), 1, spread=spread),
            _row("individual", 0.0, single + ddp_bench.bucket_overhead_ms(40, total, O_MS, W_GBPS), 40, overlap=0.8,
                 spread=spread)]
    for mb in (1.0, 8.0, 64.0):
        n = GRAD_MB / mb
        rows.append(_row("bucketed", mb, single + ddp_bench.bucket_overhead_ms(n, total, O_MS, W_GBPS), n,
                         overlap=0.7, spread=spread))
    rows += [_row("torch_ddp", 25.0, torch_ddp, math.nan, overlap=0.6, spread=spread),
             _row("single_gpu", 0.0, single, math.nan, comm=0.0, overlap=math.nan, spread=spread, world_size=1)]
    for i, r in enumerate(rows):  # each row up and down in its own rounds
        r["step_samples_ms"] = _samples(r["step_ms"], spread=spread, shift=i)
    return pd.DataFrame(rows)


def test_labels_and_step_table():
    b = bench()
    assert ddp_book.label("bucketed", 8.0) == "bucketed 8 MB" and ddp_book.label("naive", 0.0) == "naive"
    table = ddp_book.step_table(b)
    assert list(table.columns[:3]) == ["config", "label", "step_ms"]
    assert "bucketed 64 MB" in set(table["label"]) and ddp_book.configs(b) == ["tiny fp32"]


def test_wrapper_sentences_take_their_words_from_the_verdicts():
    text = ddp_book.wrapper_sentences(bench())
    head, flat, hooked, vs_torch, vs_one = [p for p in text.split(". ") if p]
    assert head.startswith("**tiny fp32**") and numbers(head) == [10, 100]  # rounds, the single-device ms
    assert numbers(flat)[0] == 40 and "faster" in flat and 1.4 <= numbers(flat)[1] < 1.6  # 40 calls; speedup
    best = ddp_book.best(ddp_book._ok(bench()))
    assert best["label"] == "bucketed 8 MB"  # 8 buckets: 4 ms + 0.84 ms beats 1 bucket (0.5 + 6.7) and 64 (32 + 0.1)
    assert "bucketed 8 MB" in hooked and "faster" in hooked
    assert "faster" in vs_torch and 1.0 <= numbers(vs_torch)[1] < 1.1  # after the "8" of "8 MB"
    assert "slower" in vs_one
    noisy = ddp_book.wrapper_sentences(bench(noisy=True, torch_ddp=106.0))
    vs_torch = sentence_with(noisy, "torch DDP")
    assert "within noise" in vs_torch and "faster" not in vs_torch and "slower" not in vs_torch


def test_cost_answer():
    answer = ddp_book.cost_answer(bench())
    assert "bucketed 8 MB" in answer and in_order(answer, [8, 105, 100]) and "slower" in answer
    assert 1.0 <= numbers(answer)[-1] < 1.1  # the median per-round ratio


def _timeline(comm_start, comm_end, compute_end=10.0):
    rows = [("main thread", "compute", "aten::mm", 0.0, compute_end),
            ("gloo thread 1", "communication", "gloo:all_reduce", comm_start, comm_end - comm_start),
            ("phase", "phase", "backward", 2.0, compute_end - 2.0)]
    return pd.DataFrame(rows, columns=["lane", "kind", "name", "start_ms", "dur_ms"])


def test_overlap_table_and_sentences():
    shown = {"naive": _timeline(10.0, 14.0, compute_end=10.0), "bucketed 8 MB": _timeline(6.0, 11.0)}
    overlap = ddp_book.overlap_table(shown).set_index("wrapper")
    assert overlap.loc["naive", "overlap_share"] == 0 and overlap.loc["naive", "exposed_ms"] == pytest.approx(4.0)
    assert overlap.loc["bucketed 8 MB", "overlap_share"] == pytest.approx(0.8)
    text = ddp_book.overlap_sentences(overlap.reset_index(), bench(), "tiny fp32")
    assert "no spread" in text  # one profiled step each
    shares = text[text.index("),") + 2:text.index("hook-based")]
    assert numbers(shares) == [0, 80]  # naive 0%, the one hook-based wrapper 80% (one number, not "80%-80%")
    verdict = sentence_with(text, "faster than flat")
    assert "bucketed 8 MB" in verdict and "saves" in verdict
    # a saving larger than all of flat's communication is not put down to overlap
    b = bench()
    b.loc[b["impl"] == "flat", "comm_ms"] = 1.0
    flat_ms = float(b.loc[b["impl"] == "flat", "step_ms"].iloc[0])
    saved = flat_ms - float(ddp_book.best(ddp_book._ok(b), ddp_book.HOOKED)["step_ms"])
    assert saved > 1.0
    odd = sentence_with(ddp_book.overlap_sentences(overlap.reset_index(), b, "tiny fp32"), "faster than flat")
    assert "saves" not in odd and "cannot account" in odd and in_order(odd, [float(f"{saved:.3g}"), 1])
    for untraced in (ddp_book.overlap_answer(overlap, bench(), None),
                     ddp_book.overlap_sentences(overlap, bench(), None)):
        assert "trace" in untraced and numbers(untraced) == [] and "faster" not in untraced  # no share, no verdict
    assert ddp_book.timeline_config(bench()) is None and ddp_book.shown_timelines(bench(), None) == {}


def test_overhead_model_recovers_o_and_w_and_cites_06():
    model = ddp_book.overhead_model(bench(), dict(o_ms=O_MS, w_gbps=W_GBPS))
    (r,) = model.itertuples()
    assert r.fit_o_ms == pytest.approx(O_MS, rel=1e-3) and r.fit_w_gbps == pytest.approx(W_GBPS, rel=1e-3)
    expected = ddp_bench.optimal_bucket(GRAD_MB * 2**20, O_MS, W_GBPS)["bucket_mb"]
    assert r.fit_best_bucket_mb == pytest.approx(expected, rel=1e-3)
    assert r.nb06_best_bucket_mb == pytest.approx(expected)
    assert r.measured_best_bucket_mb == 8 and r.within_noise_of_best_mb == ""
    text = ddp_book.overhead_model_sentences(model)
    assert in_order(sentence_with(text, "fit gives"), [500, 10])  # o in µs, w in GB/s
    assert in_order(sentence_with(text, "Notebook 06"), [6, 500, 10, float(f"{expected:.3g}")])
    assert in_order(ddp_book.overhead_answer(model), [8])
    large = ddp_book.overhead_model_sentences(model.assign(grad_mb=7624.4, nb06_best_bucket_mb=1234.5))
    assert "7,620 MiB of gradients" in large and "1,230 MB." in large and "e+" not in large
    without_06 = ddp_book.overhead_model(bench(), None)
    assert "nb06_o_ms" not in without_06 and "Notebook 06" not in ddp_book.overhead_model_sentences(without_06)
    fig = ddp_book.plot_overhead_model(bench(), model)
    assert fig.axes[0].get_title() == "tiny fp32"


def test_goal_checks_met_missed_undecided():
    met = ddp_book.goal_checks(bench(single=100, torch_ddp=120), "tiny fp32", 1.0, 1.1).set_index("reference")
    assert met.loc["torch DDP", "result"] == "met" and met.loc["one device", "result"] == "met"
    missed = ddp_book.goal_checks(bench(single=100, torch_ddp=90), "tiny fp32", 1.0, 1.01).set_index("reference")
    assert missed.loc["torch DDP", "result"] == "missed" and missed.loc["one device", "result"] == "missed"
    noisy = ddp_book.goal_checks(bench(noisy=True, torch_ddp=106), "tiny fp32", 1.0, 1.1).set_index("reference")
    assert noisy.loc["torch DDP", "result"] == "undecided (within noise)"
    gone = bench()
    gone.loc[gone["impl"] == "torch_ddp", "status"] = "oom"
    assert ddp_book.goal_checks(gone, "tiny fp32").set_index("reference").loc["torch DDP", "result"] == "not measured"
    text = ddp_book.goal_answer(met.reset_index(), "tiny fp32")
    vs_torch, vs_one = text.split(";")
    assert vs_torch.startswith("tiny fp32") and "torch DDP" in vs_torch and "met" in vs_torch
    assert amounts(vs_torch)[0] == (1, "x") and 0.8 <= numbers(vs_torch)[1] < 0.9  # the goal, then the ratio
    assert "one device" in vs_one and has_amount(vs_one, 1.1, "x") and "met" in vs_one
    assert ddp_book.goal_config(pd.concat([bench(), bench().assign(config="2.7B bf16")])) == "2.7B bf16"


class _Book:
    def __init__(self, table=None):
        self.table, self.results_dir, self.asked = table, "results/somewhere", []

    def other(self, name, source=None):
        self.asked.append((name, source))
        if self.table is None:
            raise FileNotFoundError(name)
        return self.table


def test_cite_alpha_beta_reads_06_or_warns(capsys):
    fits = pd.DataFrame([dict(backend="gloo", op="all_reduce", world_size=2, latency_ms=0.3, bandwidth_gbps=6.0),
                         dict(backend="gloo", op="all_gather", world_size=2, latency_ms=9.0, bandwidth_gbps=1.0)])
    book = _Book(fits)
    assert ddp_book.cite_alpha_beta(book, "gloo", 2) == dict(backend="gloo", world_size=2, o_ms=0.3, w_gbps=6.0)
    assert book.asked == [("collectives_latency_bandwidth", "06_communication")]
    assert ddp_book.cite_alpha_beta(book, "nccl", 2) is None
    out = capsys.readouterr().out
    assert "nccl" in out and numbers(out)[-1] == 2 and "gloo" not in out  # the backend and ranks it lacks
    assert ddp_book.cite_alpha_beta(_Book(None), "gloo", 2) is None
    out = capsys.readouterr().out
    assert "`collectives_latency_bandwidth`" in out and "results/somewhere" in out and "06" in out  # what, where


def test_step_time_plot():
    fig = ddp_book.plot_step_times(bench())
    assert fig.axes[0].get_title() == "tiny fp32" and len(fig.axes[0].get_yticklabels()) == 8
