"""lab.book.ddp.present: the claims, tables and ledger entries of notebook 07, from small synthetic benchmark
tables. Values and verdicts are asserted, never the wording."""

import json
import math

import matplotlib
import pandas as pd
import pytest

from lab.accounting import bucket_overhead_ms, optimal_bucket
from lab.book import claims as cl
from lab.book import ledger
from lab.book.ddp import present as ddp_book
from lab.measure.verdicts import FASTER, SLOWER, WITHIN_NOISE

matplotlib.use("Agg")
GRAD_MB = 64.0
O_MS, W_GBPS = 0.5, 10.0  # the overhead model the synthetic buckets follow


def _samples(ms, k=10, spread=0.005, shift=0):
    """Deterministic rounds within +-2 ``spread`` of ``ms``; rows with different ``shift`` go up and down in
    different rounds (so their per-round ratios vary too)."""
    return json.dumps([ms * (1 + spread * ((i * 7 + shift) % 5 - 2)) for i in range(k)])


def _row(impl, bucket_mb, ms, n_buckets, comm=5.0, overlap=0.0, world_size=2):
    return dict(impl=impl, bucket_mb=bucket_mb, world_size=world_size, size="tiny", context=32, batch=2, dtype="fp32",
                step_ms=ms, comm_ms=comm, overlap_frac=overlap, n_buckets=n_buckets, grad_mb=GRAD_MB, trace=None,
                status="ok", error="", config="tiny fp32")


def bench(single=100.0, torch_ddp=110.0, noisy=False, rounds=10):
    """One config: the bucketed rows follow n*o + s/(n*w) on top of the single-device step."""
    total = GRAD_MB * 2**20
    rows = [_row("naive", 0.0, 160.0, 40),
            _row("flat", 0.0, single + bucket_overhead_ms(1, total, O_MS, W_GBPS), 1),
            _row("individual", 0.0, single + bucket_overhead_ms(40, total, O_MS, W_GBPS), 40, overlap=0.8)]
    rows += [_row("bucketed", mb, single + bucket_overhead_ms(GRAD_MB / mb, total, O_MS, W_GBPS), GRAD_MB / mb,
                  overlap=0.7) for mb in (1.0, 8.0, 64.0)]
    rows += [_row("torch_ddp", 25.0, torch_ddp, math.nan, overlap=0.6),
             _row("single_gpu", 0.0, single, math.nan, comm=0.0, overlap=math.nan, world_size=1)]
    for i, r in enumerate(rows):  # each row up and down in its own rounds
        r["step_samples_ms"] = _samples(r["step_ms"], k=rounds, spread=0.2 if noisy else 0.005, shift=i)
    return pd.DataFrame(rows)


def _versus(findings, subject, reference):
    return next(f for f in findings if isinstance(f, cl.Versus) and f.subject.label.startswith(subject)
                and f.reference.label.startswith(reference))


def test_labels_and_step_table():
    assert ddp_book.label("bucketed", 8.0) == "bucketed 8 MB" and ddp_book.label("torch_ddp", 25) == "torch DDP"
    table = ddp_book.step_table(bench())
    assert list(table.columns[:3]) == ["config", "label", "step_ms"]
    assert "bucketed 64 MB" in set(table["label"]) and ddp_book.configs(bench()) == ["tiny fp32"]
    # GPU times where a GPU was profiled; a column nobody measured (a CPU's) left out
    cpu = bench().assign(step_gpu_ms=math.nan, step_compute_gpu_ms=math.nan)
    assert "step_gpu_ms" not in ddp_book.step_table(cpu)
    gpu = bench().assign(step_gpu_ms=60.0, step_compute_gpu_ms=50.0)
    assert ddp_book.step_table(gpu)[["step_gpu_ms", "step_compute_gpu_ms"]].iloc[0].tolist() == [60.0, 50.0]
    rows = ddp_book._ok(gpu)
    host_bound = ddp_book.versus(rows.iloc[-2], rows.iloc[-1])  # torch DDP against one device: GPUs 50% busy
    assert host_bound.verdict == "host-bound" and host_bound.subject.gpu_ms == 50.0  # collectives left out


def test_wrapper_story_is_paired_verdicts():
    findings = ddp_book.wrapper_findings(bench())
    values = [f.measured for f in findings if isinstance(f, cl.Value)]
    assert values[0].median == pytest.approx(100.0, rel=0.01) and values[0].summary.n == 10  # one device
    assert values[1].median == 40  # naive's all-reduce calls
    flat = _versus(findings, "flat", "naive")
    assert flat.paired and flat.verdict == FASTER and 1 / flat.comparison.ratio == pytest.approx(1.48, rel=0.02)
    best = ddp_book.best(ddp_book._ok(bench()))
    assert best["label"] == "bucketed 8 MB"  # 8 buckets: 4 ms + 0.84 ms beats 1 bucket (0.5 + 6.7) and 64 (32 + 0.1)
    assert _versus(findings, "bucketed 8 MB", "flat").verdict == FASTER
    vs_torch = _versus(findings, "bucketed 8 MB", "torch DDP")
    assert vs_torch.verdict == FASTER and vs_torch.comparison.ratio == pytest.approx(104.84 / 110, rel=0.01)
    assert _versus(findings, "bucketed 8 MB", "one device").verdict == SLOWER
    cost = ddp_book.cost_claim(bench())
    assert [f.verdict for f in cost.findings] == [SLOWER] and cost.findings[0].reference.label.startswith("one device")
    noisy = _versus(ddp_book.wrapper_findings(bench(noisy=True, torch_ddp=106.0)), "bucketed 8 MB", "torch DDP")
    assert noisy.verdict == WITHIN_NOISE
    few = _versus(ddp_book.wrapper_findings(bench(rounds=3)), "flat", "naive")
    assert few.verdict == "not decided"  # 3 rounds: fewer than the rule needs


def test_ledger_enters_torch_ddp_rows():
    (e,) = ddp_book.ledger_entries(bench())
    assert e["kind"] == "ddp_step" and e["n"] == 10 and e["median"] == pytest.approx(110.0, rel=0.01)
    assert e["key"] == ledger.key("ddp_step", impl="torch_ddp", size="tiny", context=32, batch=2, dtype="fp32",
                                  world_size=2, bucket_mb=25, optimizer="AdamW, fused on CUDA")


def _timeline(comm_start, comm_end, compute_end=10.0):
    rows = [("main thread", "compute", "aten::mm", 0.0, compute_end),
            ("gloo thread 1", "communication", "gloo:all_reduce", comm_start, comm_end - comm_start),
            ("phase", "phase", "backward", 2.0, compute_end - 2.0)]
    return pd.DataFrame(rows, columns=["lane", "kind", "name", "start_ms", "dur_ms"])


def test_overlap_claim():
    shown = {"naive": _timeline(10.0, 14.0, compute_end=10.0), "bucketed 8 MB": _timeline(6.0, 11.0)}
    overlap = ddp_book.overlap_table(shown).set_index("wrapper")
    assert overlap.loc["naive", "overlap_share"] == 0 and overlap.loc["naive", "exposed_ms"] == pytest.approx(4.0)
    assert overlap.loc["bucketed 8 MB", "overlap_share"] == pytest.approx(0.8)
    claim = ddp_book.overlap_claim(overlap.reset_index(), bench(), "tiny fp32")
    shares = [f.fraction for f in claim.findings if isinstance(f, cl.Share)]
    assert shares == [0, pytest.approx(0.8)]
    (vs_flat,) = [f for f in claim.findings if isinstance(f, cl.Versus)]
    assert vs_flat.verdict == FASTER and vs_flat.reference.label.startswith("flat")
    assert claim.because == ddp_book.OVERLAP_MEANS[FASTER]
    # a saving larger than all of flat's communication is not put down to overlap: flat's communication is shown
    b = bench()
    b.loc[b["impl"] == "flat", "comm_ms"] = 1.0
    odd = ddp_book.overlap_claim(overlap.reset_index(), b, "tiny fp32")
    assert [f.measured.median for f in odd.findings if isinstance(f, cl.Value)] == [1.0]
    assert odd.because != ddp_book.OVERLAP_MEANS[FASTER]
    untraced = ddp_book.overlap_claim(overlap, bench(), None)
    assert untraced.findings == () and untraced.because
    assert ddp_book.shown_timelines(bench()) == (None, {})


def test_overhead_model_recovers_o_and_w_and_cites_06():
    model = ddp_book.overhead_model(bench(), dict(o_ms=O_MS, w_gbps=W_GBPS))
    (r,) = model.itertuples()
    assert r.fit_o_ms == pytest.approx(O_MS, rel=1e-3) and r.fit_w_gbps == pytest.approx(W_GBPS, rel=1e-3)
    expected = optimal_bucket(GRAD_MB * 2**20, O_MS, W_GBPS)["bucket_mb"]
    assert r.fit_best_bucket_mb == pytest.approx(expected, rel=1e-3)
    assert r.nb06_best_bucket_mb == pytest.approx(expected)
    assert r.measured_best_bucket_mb == 8
    claim = ddp_book.overhead_claim(model, bench())
    values = [f.measured for f in claim.findings if isinstance(f, cl.Value)]
    assert values[0].median == 8 and values[0].unit == "MB"
    assert [(v.median, v.unit) for v in values[1:3]] == [(pytest.approx(O_MS * 1e3, rel=1e-3), "µs"),
                                                         (pytest.approx(W_GBPS, rel=1e-3), "GB/s")]
    assert sum(1 for v in values if v.median == pytest.approx(expected, rel=1e-3)) == 2  # the fit's and 06's optimum
    (tally,) = [f for f in claim.findings if isinstance(f, cl.Tally)]
    assert tally.counts() == {SLOWER: 2}  # 1 MB and 64 MB against 8 MB
    assert not claim.because
    table = pd.DataFrame(cl.verdict_table(ddp_book.bucket_comparisons(bench())))
    assert list(table["bucket_mb"]) == [1.0, 64.0] and set(table["verdict"]) == {SLOWER}
    without_06 = ddp_book.overhead_model(bench(), None)
    assert without_06["nb06_best_bucket_mb"].isna().all()
    assert len([f for f in ddp_book.overhead_claim(without_06, bench()).findings if isinstance(f, cl.Value)]) == 5
    fig = ddp_book.plot_overhead_model(bench(), model)
    assert fig.axes[0].get_title() == "tiny fp32"


def test_goal_met_missed_undecided():
    def goals(**kw):
        return {keys["check"]: f.goal_word for keys, f in ddp_book.goal_comparisons(bench(**kw), "tiny fp32", 1.0, 1.1)}
    assert goals(single=100, torch_ddp=120) == {"best bucketed <= 1x torch DDP": "met",
                                                "best bucketed <= 1.1x one device": "met"}
    assert goals(single=100, torch_ddp=90)["best bucketed <= 1x torch DDP"] == "missed"
    assert goals(noisy=True, torch_ddp=106)["best bucketed <= 1x torch DDP"] == "undecided"
    gone = bench()
    gone.loc[gone["impl"] == "torch_ddp", "status"] = "oom"
    checks = ddp_book.goal_comparisons(gone, "tiny fp32")
    assert [(k["config"], k["check"]) for k, _ in checks] == [("tiny fp32", "best bucketed <= 1.1x one device")]
    claim = ddp_book.goal_claim(checks, "tiny fp32")
    assert [f.goal for f in claim.findings] == [1.1]
    assert ddp_book.goal_claim([], "tiny fp32").findings[0].seen == "not measured"
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
    assert ddp_book.cite_alpha_beta(book, "gloo", 2) == dict(o_ms=0.3, w_gbps=6.0)
    assert book.asked == [("collectives_latency_bandwidth", "06_communication")]
    assert ddp_book.cite_alpha_beta(book, "nccl", 2) is None
    assert "nccl" in capsys.readouterr().out
    assert ddp_book.cite_alpha_beta(_Book(None), "gloo", 2) is None
    assert "`collectives_latency_bandwidth`" in capsys.readouterr().out


def test_step_time_plot():
    fig = ddp_book.plot_step_times(bench())
    assert fig.axes[0].get_title() == "tiny fp32" and len(fig.axes[0].get_yticklabels()) == 8


def _hide(ms: dict, busy=0, spread=0.005):
    """A table of DDPRun.hide_more: each entry's rounds, read against the entry one choice away."""
    refs = {"single_gpu": "", "torch_ddp": "single_gpu", "ddp_ready": "torch_ddp", "ddp_ready_bf16": "ddp_ready"}
    return pd.DataFrame([dict(entry=e, reference=refs[e], step_ms=m, busy_host=busy, status="ok",
                              step_samples_ms=_samples(m, spread=spread, shift=i))
                         for i, (e, m) in enumerate(ms.items())])


def test_hiding_more_judges_each_choice_and_says_where_a_busy_host_changes_the_verdict():
    alone = _hide({"single_gpu": 100.0, "torch_ddp": 130.0, "ddp_ready": 120.0, "ddp_ready_bf16": 108.0})
    busy = _hide({"single_gpu": 101.0, "torch_ddp": 150.0, "ddp_ready": 150.0, "ddp_ready_bf16": 130.0}, busy=8)
    alone["loss_curve"] = alone["entry"].map({"ddp_ready": "[4.0, 3.0, 2.0]", "ddp_ready_bf16": "[4.0, 3.003, 2.0]"})
    rows = ddp_book.hide_comparisons(alone)
    assert [(d["entry"], d["reference"], f.verdict) for d, f in rows] == [("torch_ddp", "single_gpu", SLOWER),
                                                                        ("ddp_ready", "torch_ddp", FASTER),
                                                                        ("ddp_ready_bf16", "ddp_ready", FASTER)]
    assert rows[1][1].comparison.ratio == pytest.approx(120 / 130, rel=0.01)  # the median of the rounds' ratios
    claim = ddp_book.hide_claim(alone, busy)
    seen = {f.label: f.seen for f in claim.findings if isinstance(f, cl.Observed)}
    # with the host busy, ours ties torch DDP: only that verdict depends on the host
    tie = seen["ours (the backward's order) with the host busy against torch DDP with the host busy"]
    assert tie.startswith(WITHIN_NOISE) and "depends on the host" in tie
    bf16 = seen["ours (bf16 gradients) with the host busy against ours (the backward's order) with the host busy"]
    assert bf16 == FASTER
    goals = [f for f in claim.findings if isinstance(f, cl.Versus) and f.goal is not None]
    assert [(f.subject.label, f.reference.label, f.goal_word) for f in goals] == [
        ("ours (bf16 gradients)", "torch DDP", "met"), ("ours (bf16 gradients)", "one device", "met")]
    (gap,) = [f.measured.median for f in claim.findings if isinstance(f, cl.Value)]
    assert gap == pytest.approx(0.003 / 3.0)
    # without a busy timing or the loss curves, only the comparisons and the goals
    bare = ddp_book.hide_claim(alone.drop(columns="loss_curve"), None)
    assert not any(isinstance(f, (cl.Observed, cl.Value)) for f in bare.findings)
