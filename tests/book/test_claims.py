"""Claims as data: numbers as a person writes them, verdicts under the one rule, counts that add up, and the
ledger that makes two reports agree. Values and verdicts are asserted, not the wording."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from lab.book import claims as cl
from lab.book import ledger
from lab.measure import verdicts as v
from tests.book import prose


@pytest.mark.parametrize("value,unit,text", [
    (7624.4, "", "7,624"), (999.6, "", "1,000"), (123.456, "", "123"), (0.5, "", "0.5"), (0.021, "", "0.021"),
    (-2500.0, "", "-2,500"), (0.0, "", "0"), (float("nan"), "ms", "n/a"), (None, "", "n/a"),
    (0.0000123, "", "1.2 × 10⁻⁵"), (12510.4, "ms", "12,510 ms"), (1.5, "x", "1.5x"), (3.0, "GiB", "3 GiB"),
    (2.5 * 2**30, "B", "2.5 GiB"), (512, "B", "512 bytes"), (100.0, "ms", "100 ms"), (1.05, "", "1.05"),
])
def test_numbers_read_as_a_person_writes_them(value, unit, text):
    assert cl.number(value, unit) == text
    assert not cl.machine_phrases(cl.number(value, unit))


def test_percent_interval_plural():
    assert cl.percent(0.234) == "23%" and cl.percent(0.045) == "4.5%" and cl.percent(math.nan) == "n/a"
    assert cl.interval(0.791, 0.834) == "0.791-0.834" and cl.interval(1.0, 1.0001) == "1-1.0001"
    assert cl.interval(1.52131, 1.52178) == "1.521-1.522" and cl.interval(2.5, 2.5) == "2.5 at both ends"
    assert cl.interval(-math.inf, math.inf) == "none"
    assert cl.interval(1.003, 1.45) == "1.003-1.45" and cl.interval(0.61, 0.9996) == "0.61-0.9996"  # side of 1
    assert cl.interval(1.0000001, 1.2) == "1-1.2"  # beyond 6 digits an end reads as 1
    assert cl.plural(1, "sample") == "1 sample" and cl.plural(1200, "row") == "1,200 rows"


def _samples(center, spread, n=8, seed=0):
    return list(center + spread * np.random.default_rng(seed).standard_normal(n))


def test_versus_follows_the_rule_and_says_the_ratio():
    ours, stock = cl.Measured.of("ours", _samples(70.0, 0.5)), cl.Measured.of("stock", _samples(100.0, 0.5, seed=1))
    f = cl.Versus(ours, stock, goal=0.8)
    assert f.verdict == "faster" and f.goal_word == "met"
    text = cl.say(f)
    assert prose.has_amount(text, round(1 / f.comparison.ratio, 2), "x", rel=0.01)
    assert ours.text() in text and stock.text() in text
    few = cl.Versus(cl.Measured.of("a", [1.0, 1.1]), stock)
    assert few.verdict == "not decided" and few.comparison.ratio == pytest.approx(1.05 / stock.median)
    assert (2, "") not in prose.counts(cl.say(few))  # the counts are samples, said as such
    spreadless = cl.Versus(cl.Measured.summarized("a", 10.0, float("nan"), 30), stock)
    assert spreadless.verdict == "not decided" and "spread" in cl.say(spreadless)
    noisy = cl.Versus(cl.Measured.of("a", _samples(100.0, 20.0, seed=2)), cl.Measured.of("b", _samples(101.0, 20.0)))
    assert noisy.verdict == "within noise" and noisy.cells()["verdict"] == "within noise"


def test_a_fixed_target_is_met_or_missed_under_the_rule():
    target = cl.Measured.fixed("the course's goal", 4.6)
    assert cl.Versus(cl.Measured.of("ours", _samples(4.0, 0.05)), target, goal=1.0).goal_word == "met"
    assert cl.Versus(cl.Measured.of("ours", _samples(5.1, 0.05)), target, goal=1.0).goal_word == "missed"
    assert cl.Versus(cl.Measured.of("ours", _samples(4.62, 0.3)), target, goal=1.0).goal_word == "undecided"


def test_out_of_memory_is_a_result_not_a_message():
    oom = cl.Measured.out_of_memory("naive at 16k", limit_gib=79.16)
    f = cl.Versus(oom, cl.Measured.of("flash", _samples(5.0, 0.1)), goal=1.0)
    assert f.comparison is None and f.verdict == "out of memory at 79 GiB" and f.goal_word == "missed"
    text = cl.say(f)
    assert prose.has_amount(text, 79, "GiB") and not cl.machine_phrases(text)
    row = pd.Series(dict(status="oom", limit_gib=40.0, fwd_ms=float("nan"), step_ms=float("nan"), fwdbwd_ms=9.0))
    assert cl.Measured.from_row("x", row, "fwd_ms").text() == "out of memory at 40 GiB"
    assert cl.Measured.from_row("x", row, "fwdbwd_ms").median == 9.0  # the modes that fit keep their numbers


def test_rows_are_read_with_their_spread_and_count():
    row = pd.Series(dict(fwd_ms=12.0, fwd_spread_ms=0.3, fwd_n=9, status="ok"))
    m = cl.Measured.from_row("fwd", row, "fwd_ms")
    assert (m.median, m.summary.spread, m.summary.n) == (12.0, 0.3, 9)
    with_samples = pd.Series(dict(step_ms=3.0, step_samples_ms=[1.0, 2.0, 3.0, 4.0, 5.0]))
    assert cl.Measured.from_row("s", with_samples, "step_ms").summary.samples == (1.0, 2.0, 3.0, 4.0, 5.0)
    from_csv = pd.Series(dict(host_step_ms=3.0, host_step_samples_ms="[1.0, 2.0, 3.0, 4.0, 5.0]"))
    assert cl.Measured.from_row("s", from_csv, "host_step_ms").summary.n == 5
    shared_n = pd.Series(dict(peak_gib=3.5, n=1))
    assert cl.Measured.from_row("p", shared_n, "peak_gib", unit="GiB").summary.n == 1


def test_a_step_with_collectives_is_judged_by_its_kernels_other_than_theirs():
    """08's FSDP2 at xl: its kernels ran 568 ms of a 405 ms step (NCCL kernels also run while they wait for the
    other rank), 99 ms of them not collectives: the step is host-bound, and its GPU time is the 99 ms."""
    row = pd.Series(dict(step_ms=405.0, step_n=6, step_gpu_ms=568.0, step_compute_gpu_ms=99.0, status="ok"))
    m = cl.Measured.from_row("fsdp2", row, "step_ms")
    assert m.host_bound and m.gpu_ms == 99.0
    one_gpu = pd.Series(dict(step_ms=100.0, step_n=6, step_gpu_ms=95.0, status="ok"))  # no collectives column
    assert cl.Measured.from_row("one", one_gpu, "step_ms").gpu_ms == 95.0
    unprofiled = row.copy()
    unprofiled["step_compute_gpu_ms"] = float("nan")
    assert cl.Measured.from_row("x", unprofiled, "step_ms").gpu_ms == 568.0


def test_tally_counts_add_up_to_the_whole():
    ref = cl.Measured.of("ref", _samples(10.0, 0.1))
    subjects = [_samples(5.0, 0.1), _samples(10.0, 3.0, seed=3), [9.0, 9.5], _samples(20.0, 0.1)]
    t = cl.Tally("ours against the reference",
                 tuple(cl.Versus(cl.Measured.of(f"s{i}", s), ref, goal=0.9) for i, s in enumerate(subjects)))
    counts = t.counts()
    assert counts == {"faster": 1, "within noise": 1, "not decided": 1, "slower": 1}
    text = cl.say(t)
    found = prose.counts(text)
    assert sum(k for k, _ in found[:-1]) == 4 or sum(counts.values()) == 4
    assert f"of {len(subjects)} comparisons" in text
    assert sum(t.goal_counts().values()) == 4 and t.goal_counts()["met"] == 1


def test_a_claim_is_one_sentence_of_findings_with_its_explanation():
    c = cl.Claim("How long does a step take?", [cl.Value(cl.Measured.of("small at 512", _samples(31.0, 0.4))),
                                                 cl.Share("matrix products", 57.1, 91.6),
                                                 cl.Observed("fc1 output", "bfloat16")],
                 because="The backward computes two products for each of the forward's.")
    text = cl.sentence(c)
    assert text.startswith("*How long does a step take?*")
    assert prose.has_amount(text, 62, "%") and "bfloat16" in text
    assert prose.has_amount(text, round(c.findings[0].measured.median, 1), "ms", rel=0.01)
    assert not cl.machine_phrases(text)


def test_machine_phrases_are_found():
    assert cl.machine_phrases("took 1.283e+04 ms") == ["3e+0"]
    assert cl.machine_phrases("CUDA out of memory. Tried to allocate 2 GiB")
    assert cl.machine_phrases("memory is higher by 0 B") == ["0 B"]
    assert cl.machine_phrases("(ratio 1.52, 95% interval 1.52)") == ["interval 1.52"]
    assert not cl.machine_phrases("(ratio 0.803, 95% interval 0.803-0.804); 512 bytes; interval none")
    assert not cl.machine_phrases("| dp | forward | $\\frac{6 B D F}{N}$ |")  # symbols of a formula
    assert cl.machine_phrases("$x$ grew by 0 B") == ["0 B"]
    assert not cl.machine_phrases(f"(95% interval {cl.interval(2.5, 2.5)}) of a 2.7B model")
    for one_ended in ("interval -0.5)", "interval 12 ms)", "interval 1.52, so"):
        assert cl.machine_phrases(one_ended), one_ended
    assert cl.number(0, "B") == "0 bytes" and cl.number(512, "B") == "512 bytes" and cl.number(2048, "B") == "2 KiB"
    assert cl.number(1, "B") == "1 byte" and cl.number(1023.6, "B") == "1 KiB"


# ----------------------------------------------------------------------------------------------------------
# the ledger


def test_ledger_keys_are_what_was_measured():
    k = ledger.key("lm_step", size="small", context=512.0, batch=4, dtype="bf16", attention="sdpa", compile="False",
                   fused_loss=False, mode="fwdbwd")
    assert json.loads(k)["context"] == 512 and json.loads(k)["compile"] is False
    assert k == ledger.key("lm_step", size="small", context=512, batch=4, dtype="bf16", attention="sdpa",
                           compile=False, fused_loss=False, mode="fwdbwd")
    with pytest.raises(ValueError, match="missing mode"):
        ledger.key("lm_step", size="small", context=512, batch=4, dtype="bf16", attention="sdpa", compile=False,
                   fused_loss=False)
    with pytest.raises(ValueError, match="unknown ledger kind"):
        ledger.key("nonsense")
    assert ledger.gpu_model("NVIDIA H100 80GB HBM3 x2") == "NVIDIA H100 80GB HBM3"


def _entry(ms, spread=0.5, n=8, host_bound=False, gpu_ms=math.nan, **over):
    what = dict(size="small", context=512, batch=4, dtype="bf16", attention="sdpa", compile=False, fused_loss=False,
                mode="fwdbwd") | over
    samples = _samples(ms, spread, n)
    return ledger.entry("lm_step", v.summarize(samples), "ms", f"small fwd+bwd {ms}", host_bound, gpu_ms, **what)


def _prov(gpu="NVIDIA H100 80GB HBM3", cpu="Xeon A", commit="c1"):
    return dict(gpu=gpu, host_cpu=cpu, commit=commit)


def test_two_reports_that_disagree_stop_the_render_naming_both(tmp_path):
    ledger.record([_entry(59.0)], tmp_path, "01_profiling", _prov())
    ledger.record([_entry(31.0)], tmp_path, "02_mixed_precision", _prov(commit="c2"))
    with pytest.raises(ledger.LedgerMismatch) as err:
        ledger.check(tmp_path, "02_mixed_precision")
    assert "01_profiling" in str(err.value) and "02_mixed_precision" in str(err.value)
    d = ledger.disagreements(ledger.load(tmp_path), "02_mixed_precision")
    assert len(d) == 1 and d.iloc[0]["ratio"] == pytest.approx(31.0 / 59.0, rel=0.02)


def test_agreement_within_run_to_run_or_noise_and_only_like_for_like(tmp_path):
    ledger.record([_entry(100.0), _entry(50.0, context=256)], tmp_path, "01_profiling", _prov())
    ledger.record([_entry(103.0), _entry(80.0, context=1024)], tmp_path, "04_attention", _prov())
    assert ledger.check(tmp_path, "04_attention") == []  # 3%: within run to run; 1024 has no partner
    ledger.record([_entry(200.0)], tmp_path, "05_flash", _prov(gpu="NVIDIA H200"))
    assert ledger.check(tmp_path, "05_flash") == []  # another GPU model
    ledger.record([_entry(130.0, host_bound=True)], tmp_path, "10_fastest_step", _prov(cpu="Xeon B"))
    assert ledger.check(tmp_path, "10_fastest_step") == []  # host-bound on another host CPU
    ledger.record([_entry(110.0, spread=100.0)], tmp_path, "02_mixed_precision", _prov())
    assert ledger.check(tmp_path, "02_mixed_precision") == []  # within noise: the spread covers the gap


def test_a_source_replaces_its_own_entries_and_cpu_rows_only_warn(tmp_path):
    ledger.record([_entry(100.0)], tmp_path, "01_profiling", _prov(gpu="cpu"))
    ledger.record([_entry(100.0)], tmp_path, "01_profiling", _prov(gpu="cpu"))
    assert len(ledger.load(tmp_path)) == 1
    ledger.record([_entry(150.0)], tmp_path, "02_mixed_precision", _prov(gpu="cpu"))
    lines = ledger.check(tmp_path, "02_mixed_precision")
    assert len(lines) == 1 and "01_profiling" in lines[0]


def test_lm_step_rows_enter_the_ledger_mode_by_mode(tmp_path):
    from lab.bench.lm import benchmark_lm
    from lab.model import ModelConfig

    tiny = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=4, context_length=16, vocab_size=64)
    row = benchmark_lm(tiny, context=16, batch=2, warmup=1, steps=5, device="cpu")
    table = pd.DataFrame([row, {**row, "status": "oom"}])
    entries = ledger.lm_step_entries(table)
    assert [json.loads(e["key"])["mode"] for e in entries] == ["fwd", "fwdbwd", "step"]
    assert entries[1]["median"] == row["fwdbwd_ms"] and entries[1]["n"] == 5
    saved = table.drop(columns=[c for c in table if c.endswith("_samples_ms")])  # as read back from a CSV
    assert [e["median"] for e in ledger.lm_step_entries(saved)] == [e["median"] for e in entries]


def test_a_quantity_other_than_time_is_lower_or_higher_and_paired_ratios_say_so():
    small = cl.Measured.of("sharded", _samples(20.0, 0.1), "GiB")
    big = cl.Measured.of("ddp", _samples(40.0, 0.1), "GiB")
    assert cl.Versus(small, big).verdict == "lower" and cl.Versus(big, small).verdict == "higher"
    assert "faster" not in cl.say(cl.Versus(small, big))
    a, b = [9.0, 9.0, 27.0, 9.0, 9.0, 9.0], [10.0, 10.0, 30.0, 10.0, 10.0, 10.0]
    paired = cl.Versus(cl.Measured.of("a", a), cl.Measured.of("b", b), paired=True)
    assert paired.verdict == "faster" and "per-round ratio" in cl.say(paired)


def test_verdict_table_refuses_keys_that_hide_its_columns():
    f = cl.Versus(cl.Measured.of("a", _samples(1.0, 0.01)), cl.Measured.of("b", _samples(2.0, 0.01)))
    row = cl.verdict_table([({"shape": "x"}, f)])[0]
    assert row["verdict"] == "faster" and row["against"] == f.reference.text()
    with pytest.raises(ValueError, match="verdict"):
        cl.verdict_table([({"verdict": "mine"}, f)])


def test_host_bound_rows_agree_by_their_gpu_time_and_their_walls_within_the_idle_time(tmp_path):
    # one H200, minutes apart: a host-bound bf16 forward took 106 ms, then 73 ms; its GPU time was 44 ms both times;
    # a partly host-bound fp32 step: 54.3 ms with 8.4 ms idle against 49.7 ms with 3.8 ms idle; GPU 45.9 both
    ledger.record([_entry(106.0, spread=1.0, host_bound=True, gpu_ms=44.0),
                   _entry(54.3, spread=0.3, gpu_ms=45.9, mode="step")], tmp_path, "01_profiling", _prov())
    ledger.record([_entry(73.0, spread=1.0, host_bound=True, gpu_ms=44.3),
                   _entry(49.7, spread=0.3, gpu_ms=45.9, mode="step")], tmp_path, "02_mixed_precision", _prov())
    assert ledger.check(tmp_path, "02_mixed_precision") == []
    # the GPU did 10% more work in one report: that does not depend on the host, on any host CPU
    ledger.record([_entry(73.0, spread=1.0, host_bound=True, gpu_ms=48.4)], tmp_path, "04_attention",
                  _prov(cpu="Xeon B"))
    with pytest.raises(ledger.LedgerMismatch, match="GPU time"):
        ledger.check(tmp_path, "04_attention")
    # walls 20% apart where one row's GPU time is unknown: no idle time explains it, the wall time disagrees
    ledger.record([_entry(100.0, spread=0.3, gpu_ms=98.0, mode="fwd")], tmp_path, "03_memory", _prov())
    ledger.record([_entry(120.0, spread=0.3, mode="fwd")], tmp_path, "05_flash", _prov())
    d = ledger.disagreements(ledger.load(tmp_path), "05_flash")
    assert list(d["what"]) == ["wall time"] and d.iloc[0]["ratio"] == pytest.approx(1.2, rel=0.01)


def _lm_row(wall, gpu=math.nan, host_bound=False, spread=0.01):
    samples = [wall * (1 + spread * x) for x in (0, 1, -1, 0.5, -0.5, 0.2)]
    return {"fwd_ms": wall, "fwd_samples_ms": samples, "fwd_gpu_ms": gpu, "host_bound": host_bound, "status": "ok"}


def test_a_host_bound_time_decides_only_beyond_what_a_host_can_move():
    # host-bound by the time's own GPU share where profiled (the row's flag only where not)
    assert cl.Measured.from_row("a", _lm_row(100.0, gpu=50.0), "fwd_ms").host_bound
    assert not cl.Measured.from_row("a", _lm_row(100.0, gpu=95.0, host_bound=True), "fwd_ms").host_bound
    assert cl.Measured.from_row("a", _lm_row(100.0, host_bound="True"), "fwd_ms").host_bound  # read from a CSV
    eager = cl.Measured.from_row("eager", _lm_row(30.0, gpu=10.0), "fwd_ms")
    near = cl.Versus(cl.Measured.from_row("compiled", _lm_row(20.0, gpu=19.0), "fwd_ms"), eager, goal=0.8)
    assert near.verdict == "host-bound" and near.goal_word == "undecided" and near.gpu_ratio == pytest.approx(1.9)
    far = cl.Versus(cl.Measured.from_row("compiled", _lm_row(10.0, gpu=9.5), "fwd_ms"), eager, goal=0.8)
    assert far.verdict == "faster" and far.goal_word == "met"  # 3x: no host moves it that far
    slow = cl.Versus(eager, cl.Measured.from_row("compiled", _lm_row(10.0, gpu=9.5), "fwd_ms"))
    assert slow.verdict == "slower" and not slow.cells().get("gpu_ratio")
    assert "gpu_ratio" in near.cells()


def test_host_bound_rows_without_a_gpu_time_are_not_compared_on_one_host_either(tmp_path):
    ledger.record([_entry(106.0, spread=0.5, host_bound=True)], tmp_path, "01_profiling", _prov())
    ledger.record([_entry(73.0, spread=0.5, host_bound=True, gpu_ms=44.0)], tmp_path, "02_mixed_precision", _prov())
    assert ledger.check(tmp_path, "02_mixed_precision") == []  # same host CPU model, 1.45x apart: the host's pace
    ledger.record([_entry(73.0, spread=0.5)], tmp_path, "04_attention", _prov())
    assert ledger.check(tmp_path, "04_attention") == []  # its partners are host-bound, one without a GPU time
    ledger.record([_entry(120.0, spread=0.5)], tmp_path, "05_flash", _prov())
    d = ledger.disagreements(ledger.load(tmp_path), "05_flash")  # two rows the GPU paced: their walls must agree
    assert list(d["source_b"]) == ["04_attention"] and list(d["what"]) == ["wall time"]
