"""lab.book.sharding.present: the sentences, tables and goals of notebook 08, from small synthetic benchmark tables."""

import json
import math

import matplotlib
import pandas as pd
import pytest

from lab.book.sharding import bench as sharding_bench
from lab.book.sharding import present as sharding_book
from lab.book.sharding import traffic as sharding_traffic
from lab.measure.traces import overlap_summary
from tests.book.prose import amounts, bold, clause_of, in_order, numbers, sentence_of, sentence_with, sentences

matplotlib.use("Agg")
#           impl: (median step ms, peak after step GiB, overall peak GiB, state GiB: params, grads, optimizer)
ROWS = {"ddp": (100, 38.0, 39.0, (7.4, 7.4, 14.9)), "sharded_optimizer": (150, 23.0, 31.0, (7.4, 7.4, 7.45)),
        "zero1": (110, 22.5, 31.0, (7.4, 7.4, 7.45)), "fsdp": (120, 19.0, 19.0, (3.7, 3.7, 7.45)),
        "torch_zero": (130, 26.6, 31.0, (7.4, 7.4, 7.45)), "torch_fsdp2": (140, 19.0, 18.0, (3.7, 3.7, 7.45))}


def _samples(ms, spread, shift):
    return json.dumps([ms * (1 + spread * ((i * 7 + shift) % 5 - 2)) for i in range(10)])


def table(gpu=True, spread=0.005, size="xl"):
    rows = []
    for impl, (ms, after, peak, (p, g, o)) in ROWS.items():
        e = sharding_bench.expected_state_bytes(impl, 2e9, 2)
        rows.append(dict(impl=impl, size=size, world_size=2, status="ok", error="", step_ms=ms, step_iqr_ms=ms * spread,
                         rounds=10, step_samples_ms=_samples(ms, spread, len(rows)), peak_init_gib=math.nan,
                         peak_before_step_gib=peak if gpu else math.nan, peak_after_step_gib=after if gpu else math.nan,
                         peak_gib=peak if gpu else math.nan, reduce_dtype="fp32", param_gib=p, grad_gib=g,
                         optimizer_state_gib=o, activations_gib=(peak - p - g - o) if gpu else math.nan,
                         expected_param_gib=e["params"] / 2**30, expected_grad_gib=e["grads"] / 2**30,
                         expected_optimizer_state_gib=e["optimizer_state"] / 2**30, trace=None))
    return pd.DataFrame(rows)


def test_state_and_traffic_sentences():
    expected = sharding_bench.expected_state_table(["tiny"], world_size=2)
    text = sharding_book.state_sentence(expected, 2)
    assert "tiny" in text and in_order(text, [1.411, 2, 0.021])  # parameters (M), ranks, DDP's GiB
    assert in_order(text, [25, 50])  # the two sharded layouts' savings, in percent
    closed = sharding_traffic.closed_form_traffic("tiny", 2)
    recorded = [("ddp", "all_reduce", 10, 10), ("sharded_optimizer", "all_reduce", 10, 10),
                ("sharded_optimizer", "broadcast", 5, 5), ("zero1", "reduce_scatter", 5, 5),
                ("zero1", "all_gather", 5, 5), ("fsdp", "all_gather", 8, math.nan)]
    traffic = pd.DataFrame(recorded, columns=["impl", "collective", "measured_bytes", "expected_bytes"])
    traffic["measured_ratio_to_ddp"] = traffic["impl"].map({"ddp": 1.0, "sharded_optimizer": 1.5, "zero1": 1.0,
                                                            "fsdp": 0.8})
    text = sharding_book.traffic_sentences(closed, traffic)
    match = sentences(text)[0]
    assert "match" in match and "not" not in match and not bold(text) and "FSDP" in text  # no stressed mismatch
    assert amounts(text.split(". ")[-1]) == [(1.5, "x"), (1.0, "x"), (0.8, "x")]  # measured, to DDP's bytes
    traffic.loc[4, "measured_bytes"] = 6
    mismatch = sentences(sharding_book.traffic_sentences(closed, traffic))[0]
    assert bold(mismatch) and "not" in bold(mismatch)[0]  # the mismatch, stressed
    assert numbers(sharding_book.traffic_answer(closed, traffic))[:2] == [1.5, 1.0]  # sharded optimizer, ZeRO-1
    assert 1.5 in numbers(sharding_book.difference_sentence(closed, 2))


def test_time_comparisons_against_ddp_and_the_reference():
    t = sharding_book.time_comparisons(table())
    pairs = list(zip(t["impl"], t["reference"]))
    assert ("zero1", "ddp") in pairs and ("zero1", "torch_zero") in pairs and ("fsdp", "torch_fsdp2") in pairs
    assert ("ddp", "ddp") not in pairs and ("torch_zero", "torch_zero") not in pairs
    v = t.set_index(["impl", "reference"])["verdict"]
    assert v[("zero1", "torch_zero")] == "faster" and v[("sharded_optimizer", "ddp")] == "slower"
    text = sharding_book.time_sentences(t)
    first = text.split(";")[0]  # one clause per comparison, in the table's order
    assert bold(text)[0] == "xl:" and "sharded_optimizer" in first and "ddp" in first
    assert "slower" in first and 1.5 <= numbers(first)[0] < 1.6
    fsdp = sentence_with(text, "fsdp is", "torch_fsdp2")
    assert "faster" in fsdp and 1.1 <= numbers(fsdp)[0] < 1.2
    noisy = sharding_book.time_comparisons(table(spread=0.3))
    assert (noisy.set_index(["impl", "reference"])["verdict"][("zero1", "ddp")]) == "within noise"
    answer = sharding_book.time_answer(t)
    sharded, zero1 = answer[answer.index("sharded_optimizer"):answer.index("zero1")], answer[answer.index("zero1"):]
    assert answer.startswith("xl") and "slower" in sharded and 1.5 <= numbers(sharded)[0] < 1.6
    assert "slower" in zero1.split(",")[0] and 1.1 <= numbers(zero1)[1] < 1.2  # after the "1" of "zero1"


def test_goals_time_from_verdicts_memory_direct():
    g = sharding_book.goals(table()).set_index(["impl", "goal"])["result"]
    assert g[("sharded_optimizer", "peak after step <= torch_zero")] == "met"  # 23 <= 26.6
    assert g[("sharded_optimizer", "step time <= torch_zero")] == "missed"  # 150 vs 130, beyond the noise
    assert g[("zero1", "step time <= torch_zero")] == "met"
    assert g[("fsdp", "step time <= torch_fsdp2")] == "met"
    assert g[("fsdp", "peak memory <= 1.1 x torch_fsdp2")] == "met"  # 19 <= 1.1 * 18
    assert sharding_book.goals(table(), 1.05).set_index(["impl", "goal"])["result"][
        ("fsdp", "peak memory <= 1.05 x torch_fsdp2")] == "missed"
    cpu = sharding_book.goals(table(gpu=False)).set_index(["impl", "goal"])["result"]
    assert cpu[("zero1", "peak after step <= torch_zero")] == "not measured"
    noisy = sharding_book.goals(table(spread=0.3)).set_index(["impl", "goal"])["result"]
    assert noisy[("zero1", "step time <= torch_zero")] == "undecided (within noise)"
    oom = table()
    oom.loc[oom["impl"] == "torch_fsdp2", "status"] = "oom"
    assert sharding_book.goals(oom).set_index(["impl", "goal"])["result"][("fsdp", "step time <= torch_fsdp2")] == \
        "not measured"
    answer = sharding_book.goals_answer(sharding_book.goals(table()))
    assert numbers(answer)[:3] == [6, 5, 1]  # checks, met, missed
    missed = answer[answer.index("missed:"):]
    assert "sharded_optimizer" in missed and "torch_zero" in missed and 1.1 <= numbers(missed)[0] < 1.2


def test_memory_sentences_and_answers():
    df = table()
    memory = sharding_book.memory_sentences(df)  # after the step: DDP, sharded, ZeRO-1, torch's; then the FSDPs
    assert amounts(memory) == [(38, "GiB"), (23, "GiB"), (22.5, "GiB"), (26.6, "GiB"), (19, "GiB"), (18, "GiB")]
    assert memory.index("DDP") < memory.index("ZeRO-1") < memory.index("FSDP") < memory.index("FSDP2")
    no_gpu = sharding_book.memory_sentences(table(gpu=False))
    assert not amounts(no_gpu) and no_gpu.count("n/a") == 6 and "GPU" in no_gpu
    answer = sharding_book.memory_answer(df)
    assert in_order(answer, [29.7, 0.75, 0.5, 39])  # DDP's state, two ratios to it, DDP's overall peak
    assert "overall peak" in answer
    assert "overall peak" not in sharding_book.memory_answer(table(gpu=False))
    cpu = sharding_book.peaks_sentence(table(gpu=False))
    assert sharding_book.peaks_sentence(df) == "" and "CPU" in cpu and not amounts(cpu)
    assert "|" not in sharding_book.failures(df)  # no table of failures
    oom = df.assign(status=["oom"] + ["ok"] * 5, error=["OutOfMemoryError: CUDA out of memory"] + [""] * 5)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in sharding_book.failures(oom).splitlines()[2:]]
    assert rows == [["xl", "ddp", "oom", "OutOfMemoryError: CUDA out of memory"]]
    memory = sharding_book.memory_sentences(oom)
    assert memory.count("n/a") == 1 and memory.index("DDP") < memory.index("oom") < memory.index("sharded optimizer")
    assert amounts(memory)[0] == (23, "GiB")  # the others keep their peaks
    nothing = sharding_book.peaks_sentence(df.assign(status="oom"))  # every row ran out of memory: not "no GPU"
    assert not amounts(nothing) and "GPU" not in nothing and "CPU" not in nothing and nothing


def test_breakdown_and_fsdp_saving():
    df = table()
    breakdown = sharding_bench.memory_breakdown(df)
    text = sharding_book.breakdown_sentence(breakdown, 2)
    assert numbers(text)[0] == 6 and "within" in text
    assert sharding_book.plot_breakdown(breakdown) is not None
    assert sharding_book.plot_breakdown(sharding_bench.memory_breakdown(table(gpu=False))) is None
    expected = pd.DataFrame([dict(size="xl", impl="ddp", total_gib=29.8), dict(size="xl", impl="fsdp", total_gib=14.9)])
    saving = sharding_book.fsdp_saving(df, expected)
    (r,) = saving.itertuples()
    assert r.expected_saving_gib == pytest.approx(14.9) and r.measured_state_saving_gib == pytest.approx(29.7 - 14.85)
    assert r.measured_peak_saving_gib == pytest.approx(20.0)
    text = sharding_book.fsdp_saving_sentences(saving)  # closed form, state tensors, peak
    assert amounts(text) == [(14.9, "GiB"), (14.9, "GiB"), (20, "GiB")] and "lower" in clause_of(text, "20 GiB")
    cpu = sharding_book.fsdp_saving_sentences(sharding_book.fsdp_saving(table(gpu=False), expected))
    assert amounts(cpu) == [(14.9, "GiB"), (14.9, "GiB")] and "not measured" in cpu and "CPU" in cpu


def _timeline(gather_end, compute_start):
    """A forward of 10 ms: communication from 0 to ``gather_end``, compute from ``compute_start`` to 10."""
    rows = [("phase", "phase", "forward", 0.0, 10.0), ("main thread", "compute", "aten::mm", compute_start,
                                                       10.0 - compute_start),
            ("gloo thread 1", "communication", "gloo:all_gather", 0.0, gather_end)]
    return pd.DataFrame(rows, columns=["lane", "kind", "name", "start_ms", "dur_ms"])


def test_forward_readings():
    in_time = overlap_summary(_timeline(gather_end=0.5, compute_start=0.5))
    text = sharding_book.forward_sentence(in_time, "xl")  # forward, busy, idle (share); communication exposed
    assert amounts(text.split(";")[0]) == [(10, "ms"), (9.5, "ms"), (0.5, "ms"), (5, "%")]
    assert "critical path" not in text and "host" not in text  # gaps too small to read a cause into
    late = overlap_summary(_timeline(gather_end=6.0, compute_start=6.0))
    text = sharding_book.forward_sentence(late, "xl", timed_step_ms=7.0)
    assert text.startswith("xl") and amounts(text.split(";")[0]) == [(10, "ms"), (4, "ms"), (6, "ms"), (60, "%")]
    assert "critical path" in text and "host" not in sentence_with(text, "critical path")
    assert amounts(sentence_of(text, 7, "ms")) == [(10, "ms"), (7, "ms")]  # profiled step against the timed median
    host = sharding_book.forward_sentence(overlap_summary(_timeline(gather_end=1.0, compute_start=6.0)), "xl")
    assert "critical path" not in host and "host" in sentence_of(host, 17, "%")  # 1 of the 6 idle ms exposed
    answer = sharding_book.forward_answer(pd.concat([late.assign(size="xl")]))
    assert answer.startswith("xl") and "critical path" in answer
    nothing = sharding_book.forward_answer(pd.DataFrame())
    assert "trace" in nothing and not numbers(nothing)
    table_, text = sharding_book.fsdp_overlap(table(), "fsdp")
    assert table_.empty and "fsdp" in text and "trace" in text and not amounts(text)


def test_plots():
    assert sharding_book.plot_step_times(table()).axes[0].get_title() == "xl"
    assert sharding_book.plot_peaks(table()) is not None and sharding_book.plot_peaks(table(gpu=False)) is None
    assert list(sharding_book.benchmark_table(table()).columns[:4]) == ["size", "impl", "status", "step_ms"]


def test_reduce_precision_note_names_who_reduces_in_another_dtype():
    from lab.book.sharding.traffic import reduce_precision_note

    df = pd.DataFrame(dict(impl=["ddp", "zero1", "fsdp", "torch_fsdp2"], reduce_dtype=["fp32", "fp32", "bf16", "bf16"],
                           status="ok"))
    note = reduce_precision_note(df)
    assert "fsdp, torch_fsdp2 in bf16" in note and "ddp reduces its gradients in fp32" in note and "zero1" not in note
    assert reduce_precision_note(df.assign(reduce_dtype="fp32")) == ""
    assert reduce_precision_note(df.drop(columns="reduce_dtype")) == ""
