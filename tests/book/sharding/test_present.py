"""lab.book.sharding.present: the claims, tables and ledger entries of notebook 08, from small synthetic benchmark
tables. Values and verdicts are asserted, never the wording."""

import json
import math

import matplotlib
import pandas as pd
import pytest

from lab.bench import traffic as sharding_traffic
from lab.bench.sharding import expected_state_bytes, expected_state_table
from lab.book import claims as cl
from lab.book import ledger
from lab.book.sharding import present as sharding_book
from lab.measure.traces import overlap_summary
from lab.measure.verdicts import FASTER, HIGHER, LOWER, SLOWER, WITHIN_NOISE

matplotlib.use("Agg")
#           impl: (median step ms, peak after step GiB, overall peak GiB, state GiB: params, grads, optimizer)
ROWS = {"ddp": (100, 38.0, 39.0, (7.4, 7.4, 14.9)), "sharded_optimizer": (150, 23.0, 31.0, (7.4, 7.4, 7.45)),
        "zero1": (110, 22.5, 31.0, (7.4, 7.4, 7.45)), "fsdp": (120, 19.0, 19.0, (3.7, 3.7, 7.45)),
        "torch_zero": (130, 26.6, 31.0, (7.4, 7.4, 7.45)), "torch_fsdp2": (140, 19.0, 18.0, (3.7, 3.7, 7.45))}


def _samples(ms, spread, shift, k=10):
    return json.dumps([ms * (1 + spread * ((i * 7 + shift) % 5 - 2)) for i in range(k)])


def table(gpu=True, spread=0.005, size="xl", rounds=10):
    rows = []
    for impl, (ms, after, peak, (p, g, o)) in ROWS.items():
        e = expected_state_bytes(impl, 2e9, 2)
        peaks = {f"{k}_gib": v if gpu else math.nan for k, v in (("peak_before_step", peak), ("peak_after_step", after),
                                                                ("peak", peak))}
        rows.append(dict(impl=impl, size=size, context=512, batch=2, dtype="bf16", world_size=2, status="ok", error="",
                         step_ms=ms, step_samples_ms=_samples(ms, spread, len(rows), rounds), peak_init_gib=math.nan,
                         **peaks, **{k.replace("_gib", "_samples_gib"): json.dumps([v] * 5 if gpu else [])
                                     for k, v in peaks.items()},
                         reduce_dtype="fp32", param_gib=p, grad_gib=g, optimizer_state_gib=o,
                         activations_gib=(peak - p - g - o) if gpu else math.nan, limit_gib=80.0,
                         expected_param_gib=e["params"] / 2**30, expected_grad_gib=e["grads"] / 2**30,
                         expected_optimizer_state_gib=e["optimizer_state"] / 2**30, trace=None))
    return pd.DataFrame(rows)


def _values(claim):
    return [f.measured for f in claim.findings if isinstance(f, cl.Value)]


def test_state_and_traffic_claims():
    expected = expected_state_table(["tiny"], world_size=2)
    findings = sharding_book.state_findings(expected)
    values = [f.measured.median for f in findings if isinstance(f, cl.Value)]
    assert values[0] == pytest.approx(1_411_392) and values[1] == pytest.approx(0.021, rel=0.02)
    assert [f.fraction for f in findings if isinstance(f, cl.Share)] == [pytest.approx(0.25), pytest.approx(0.5)]
    closed = sharding_traffic.closed_form_traffic("tiny", 2)
    recorded = [("ddp", "all_reduce", 10, 10), ("sharded_optimizer", "all_reduce", 10, 10),
                ("sharded_optimizer", "broadcast", 5, 5), ("zero1", "reduce_scatter", 5, 5),
                ("zero1", "all_gather", 5, 5), ("fsdp", "all_gather", 8, math.nan)]
    traffic = pd.DataFrame(recorded, columns=["impl", "collective", "measured_bytes", "expected_bytes"])
    traffic["measured_ratio_to_ddp"] = traffic["impl"].map({"ddp": 1.0, "sharded_optimizer": 1.5, "zero1": 1.0,
                                                            "fsdp": 0.8})
    claim = sharding_book.traffic_claim(closed, traffic)
    assert claim.findings[0].seen == "equal byte for byte"
    ratios = [v.median for v in _values(claim) if v.unit == "x"]
    assert ratios == [pytest.approx(1.5), pytest.approx(1.0, abs=1e-4), 1.5, 1.0, 0.8]  # closed form, then counted
    traffic.loc[4, "measured_bytes"] = 6
    assert "not" in sharding_book.traffic_claim(closed, traffic).findings[0].seen


def test_time_comparisons_are_paired_against_ddp_and_the_reference():
    t = sharding_book.time_comparisons(table())
    verdicts = {(k["impl"], k["reference"]): f.verdict for k, f in t}
    assert ("zero1", "torch_zero") in verdicts and ("fsdp", "torch_fsdp2") in verdicts
    assert ("ddp", "ddp") not in verdicts and ("torch_zero", "torch_zero") not in verdicts
    assert verdicts[("zero1", "torch_zero")] == FASTER and verdicts[("sharded_optimizer", "ddp")] == SLOWER
    assert all(f.paired for _, f in t)
    noisy = {(k["impl"], k["reference"]): f.verdict for k, f in sharding_book.time_comparisons(table(spread=0.3))}
    assert noisy[("zero1", "ddp")] == WITHIN_NOISE
    few = sharding_book.time_comparisons(table(rounds=4))
    assert {f.verdict for _, f in few} == {"not decided"}
    rows = cl.verdict_table(t)  # the notebook's table of them: one row a comparison, its verdict among the columns
    assert [(r["impl"], r["reference"], r["verdict"]) for r in rows] == [(k["impl"], k["reference"], f.verdict)
                                                                         for k, f in t]
    claim = sharding_book.time_claim(table())
    assert [f.reference.label.startswith("DDP") for f in claim.findings] == [True] * 5 and not claim.because
    ratio = next(f for f in claim.findings if f.subject.label.startswith("sharded optimizer")).comparison.ratio
    assert ratio == pytest.approx(1.5, rel=0.02)
    bf16 = table()
    bf16.loc[bf16["impl"].isin(["fsdp", "torch_fsdp2"]), "reduce_dtype"] = "bf16"
    mixed = sharding_book.time_claim(bf16)
    (dtypes,) = [f for f in mixed.findings if isinstance(f, cl.Observed)]
    assert "FSDP, FSDP2 bf16" in dtypes.seen and "DDP fp32" in dtypes.seen and mixed.because


def test_goals_under_the_rule_memory_in_its_own_words():
    goals = {(k["impl"], k["measure"]): f for k, f in sharding_book.goal_comparisons(table())}
    assert goals[("sharded_optimizer", "peak after the step")].goal_word == "met"  # 23 <= 26.6
    assert goals[("sharded_optimizer", "peak after the step")].verdict == LOWER
    assert goals[("sharded_optimizer", "step time")].goal_word == "missed"  # 150 vs 130, beyond the noise
    assert goals[("zero1", "step time")].goal_word == "met" and goals[("fsdp", "step time")].goal_word == "met"
    fsdp_peak = goals[("fsdp", "overall peak")]
    assert fsdp_peak.goal_word == "met" and fsdp_peak.verdict == HIGHER  # 19 GiB against 18, at most 1.1x
    tight = {(k["impl"], k["measure"]): f for k, f in sharding_book.goal_comparisons(table(), 1.05)}
    assert tight[("fsdp", "overall peak")].goal_word == "missed"
    cpu = sharding_book.goal_comparisons(table(gpu=False))
    assert {k["measure"] for k, _ in cpu} == {"step time"}  # no peaks on the CPU: no memory goal
    noisy = {(k["impl"], k["measure"]): f for k, f in sharding_book.goal_comparisons(table(spread=0.3))}
    assert noisy[("zero1", "step time")].goal_word == "undecided"
    oom = table()
    oom.loc[oom["impl"] == "torch_fsdp2", "status"] = "oom"
    gone = {(k["impl"], k["measure"]): f for k, f in sharding_book.goal_comparisons(oom)}
    assert gone[("fsdp", "step time")].verdict == "out of memory at 80 GiB"
    claim = sharding_book.goals_claim(sharding_book.goal_comparisons(table()))
    tally = claim.findings[0]
    assert tally.goal_counts() == {"met": 5, "missed": 1} and len(tally.comparisons) == 6
    assert [f.subject.label for f in claim.findings[1:]] == ["sharded optimizer's step time (xl)"]
    assert sharding_book.goals_claim([], has_gpu_peaks=False).because


def test_memory_claims():
    claim = sharding_book.memory_claim(table())
    values = _values(claim)
    assert values[0].median == pytest.approx(29.7) and values[0].unit == "GiB"  # DDP's state per rank
    assert [v.median for v in values[1:6]] == [pytest.approx(x, rel=0.01) for x in (0.75, 0.75, 0.5, 0.75, 0.5)]
    peaks = values[6:]
    assert [p.median for p in peaks] == [39, 31, 31, 19, 31, 18] and all(p.summary.n == 5 for p in peaks)
    cpu = sharding_book.memory_claim(table(gpu=False))
    assert len(_values(cpu)) == 6 and cpu.because
    after = _values(sharding_book.peak_claim(table()))
    assert [v.median for v in after] == [38, 23, 22.5, 26.6]
    no_gpu = sharding_book.peak_claim(table(gpu=False))
    assert not _values(no_gpu) and no_gpu.because
    oom = table()
    oom.loc[0, ["status", "error"]] = ["oom", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"]
    ran = [c for c in oom.columns if c.endswith(("_ms", "_gib")) and c != "limit_gib"]
    oom.loc[0, ran] = float("nan")  # nothing ran
    assert [f.seen for f in sharding_book.failures(oom)] == ["out of memory at 80 GiB"]
    assert _values(sharding_book.peak_claim(oom))[0].text() == "out of memory at 80 GiB"
    assert sharding_book.failures(table())[0].seen == "ran to the end"
    text = " ".join(cl.sentence(c) for c in (sharding_book.memory_claim(oom), sharding_book.peak_claim(oom)))
    assert not cl.machine_phrases(text)


def test_breakdown_and_fsdp_saving():
    breakdown = sharding_book.memory_breakdown(table())
    assert list(breakdown["part"][:4]) == sharding_book.PARTS
    claim = sharding_book.breakdown_claim(breakdown)
    n, worst = (v.median for v in _values(claim))
    assert n == 6 and worst == pytest.approx(100 * (1 - 7.4 / (2e9 * 4 / 2**30)), rel=1e-6)  # 7.4 of 7.45 GiB
    assert sharding_book.plot_breakdown(breakdown) is not None
    assert sharding_book.plot_breakdown(sharding_book.memory_breakdown(table(gpu=False))) is None
    saving = [v.median for v in _values(sharding_book.saving_claim(table()))]
    assert saving == [pytest.approx(2e9 * 8 / 2**30), pytest.approx(29.7 - 14.85), pytest.approx(20.0)]
    cpu = sharding_book.saving_claim(table(gpu=False))
    assert len(_values(cpu)) == 2 and cpu.because


def test_ledger_enters_the_ddp_rows_as_torch_ddp():
    (e,) = sharding_book.ledger_entries(table())
    assert e["kind"] == "ddp_step" and e["n"] == 10 and e["median"] == pytest.approx(100, rel=0.01)
    assert e["key"] == ledger.key("ddp_step", impl="torch_ddp", size="xl", context=512, batch=2, dtype="bf16",
                                  world_size=2, bucket_mb=25, optimizer=sharding_book.OPTIMIZER)


def _timeline(gather_end, compute_start):
    """A forward of 10 ms: communication from 0 to ``gather_end``, compute from ``compute_start`` to 10."""
    rows = [("phase", "phase", "forward", 0.0, 10.0), ("main thread", "compute", "aten::mm", compute_start,
                                                       10.0 - compute_start),
            ("gloo thread 1", "communication", "gloo:all_gather", 0.0, gather_end)]
    return pd.DataFrame(rows, columns=["lane", "kind", "name", "start_ms", "dur_ms"])


def test_forward_readings(tmp_path, monkeypatch):
    readings = {}
    for name, (gather_end, compute_start) in {"in time": (0.5, 0.5), "late": (6.0, 6.0), "host": (1.0, 6.0)}.items():
        monkeypatch.setattr(sharding_book, "read_trace", lambda path, tl=_timeline(gather_end, compute_start): tl)
        trace = tmp_path / "t.json"
        trace.write_text("{}")
        df = table().assign(trace=str(trace))
        overlap, claim = sharding_book.fsdp_overlap(df, "fsdp")
        readings[name] = claim
        assert list(overlap["size"].unique()) == ["xl"]
    late = readings["late"]
    forward, idle, beside, exposed, share = late.findings[:5]
    assert forward.measured.median == 10 and idle.fraction == pytest.approx(0.6)
    assert exposed.measured.median == pytest.approx(6.0) and share.fraction == pytest.approx(1.0)
    assert len({c.because for c in readings.values()}) == 3  # three readings, chosen by the data
    empty, none = sharding_book.fsdp_overlap(table(), "fsdp")
    assert empty.empty and none.findings == () and "trace" in none.because
    assert overlap_summary(_timeline(1.0, 6.0)).set_index("phase").loc["forward", "compute_idle_ms"] == 6.0


def test_plots():
    assert sharding_book.plot_step_times(table()).axes[0].get_title() == "xl"
    assert sharding_book.plot_peaks(table()) is not None and sharding_book.plot_peaks(table(gpu=False)) is None
    assert list(sharding_book.benchmark_table(table()).columns[:4]) == ["size", "impl", "status", "step_ms"]


def test_torch_ddp_in_07_and_08_meets_in_the_ledger_under_one_optimizer(tmp_path, monkeypatch):
    """A torch DDP step measured by 07 (``torch_ddp``) and 08 (``ddp``) is one measurement where both step the
    same optimizer: 188 ms against 270 ms on one GPU model stops the render, naming both rows. 07's fused AdamW
    and 08's foreach AdamW are two measurements, and never compared."""
    from lab.book.ddp import present as ddp_book
    from lab.measure import step

    sharding = table(size="2.7B")
    sharding.loc[sharding["impl"] == "ddp", "step_samples_ms"] = _samples(270.0, 0.005, 0)
    ddp = pd.DataFrame([dict(impl="torch_ddp", bucket_mb=25.0, world_size=2, size="2.7B", context=512, batch=2,
                             dtype="bf16", config="2.7B bf16", status="ok", step_samples_ms=_samples(188.0, 0.005, 1))])
    h200 = dict(gpu="NVIDIA H200", host_cpu="x86_64")
    (ours,), (theirs,) = sharding_book.ledger_entries(sharding), ddp_book.ledger_entries(ddp)
    assert ours["key"] != theirs["key"]
    ledger.record([theirs], tmp_path, "07_ddp", dict(h200, commit="a"))
    ledger.record([ours], tmp_path, "08_sharding", dict(h200, commit="b"))
    assert ledger.check(tmp_path, "08_sharding") == []
    monkeypatch.setattr(sharding_book, "OPTIMIZER", step.OPTIMIZER)
    (ours,) = sharding_book.ledger_entries(sharding)
    assert ours["key"] == theirs["key"]
    ledger.record([ours], tmp_path, "08_sharding", dict(h200, commit="b"))
    with pytest.raises(ledger.LedgerMismatch, match="07_ddp"):
        ledger.check(tmp_path, "08_sharding")


def test_host_bound_torch_ddp_steps_meet_in_the_ledger_by_their_gpu_time(tmp_path, monkeypatch):
    """Both steps host-bound (the GPU ran kernels for 90 of 188 and of 270 ms) and stepping one optimizer: the
    ledger compares the GPU's own work (kernels other than the collectives'), which agrees here, and stops the
    render where it does not."""
    from lab.book.ddp import present as ddp_book
    from lab.measure import step

    monkeypatch.setattr(sharding_book, "OPTIMIZER", step.OPTIMIZER)

    def entries(compute_07, compute_08):
        sharding = table(size="2.7B")
        sharding.loc[sharding["impl"] == "ddp", "step_samples_ms"] = _samples(270.0, 0.005, 0)
        sharding = sharding.assign(step_gpu_ms=90.0, step_compute_gpu_ms=compute_08)
        ddp = pd.DataFrame([dict(impl="torch_ddp", bucket_mb=25.0, world_size=2, size="2.7B", context=512, batch=2,
                                 dtype="bf16", config="2.7B bf16", status="ok", step_gpu_ms=90.0,
                                 step_samples_ms=_samples(188.0, 0.005, 1), step_compute_gpu_ms=compute_07)])
        return sharding_book.ledger_entries(sharding), ddp_book.ledger_entries(ddp)

    (ours,), (theirs,) = entries(80.0, 81.0)
    assert ours["host_bound"] and theirs["host_bound"] and (ours["gpu_ms"], theirs["gpu_ms"]) == (81.0, 80.0)
    h200 = dict(gpu="NVIDIA H200", host_cpu="x86_64")
    ledger.record([theirs], tmp_path, "07_ddp", dict(h200, commit="a"))
    ledger.record([ours], tmp_path, "08_sharding", dict(h200, commit="b"))
    assert ledger.check(tmp_path, "08_sharding") == []
    (ours,), _ = entries(80.0, 88.0)  # the GPU's own work 10% apart: not the same measurement
    ledger.record([ours], tmp_path, "08_sharding", dict(h200, commit="c"))
    with pytest.raises(ledger.LedgerMismatch, match="GPU time"):
        ledger.check(tmp_path, "08_sharding")
