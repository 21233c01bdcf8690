"""lab.book.accounting.present: the 09 notebook's equations, sentences, plots and the reading of other notebooks'
results (absent, old format, new format), from small synthetic tables."""

import json
import math

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from lab.book.accounting import bench as ba  # noqa: E402
from lab.book.accounting import present as ab  # noqa: E402
from lab.book.report import Chapter  # noqa: E402
from lab.measure import results as store  # noqa: E402
from tests.book.prose import counts, in_order, numbers, sentence_with  # noqa: E402


def test_equations_are_latex_of_the_closed_forms(capsys):
    assert ab.show_equation("x", 2) == "x = 2"
    assert "$$x = 2$$" in capsys.readouterr().out  # plain Python: printed, not displayed
    collectives = ab.show_collective_equations()
    assert len(collectives) == 5 and collectives[-1].endswith(r"= \frac{N}{2}")
    table = ab.ffn_cost_table(3)
    assert table.loc[(table.strategy == "dp") & (table.phase == "train"), "flops_per_device"].item() == \
        r"$\frac{18 B D F}{N}$"


def test_collective_and_simulator_sentences():
    import lab.accounting as acc

    coll = acc.collective_table(1e9, [2, 4, 64], 450e9)
    text = ab.collectives_sentence(coll)
    assert in_order(text, [2.22, 2, 4.38, 64]) and in_order(text, [140.0, 32, 64])  # ms per N; the all-gather
    pivot = ab.collectives_pivot(coll, devices=(2, 64))
    assert pivot["devices"].tolist() == ["2", "64"] and pivot["all_reduce"].iloc[0] == pytest.approx(2.2222, 1e-4)
    assert ab.collectives_figure(coll).axes[0].get_yscale() == "log"
    sim = pd.DataFrame(dict(devices=[2, 4], size_bytes=[8, 8], match=[True, False]))
    assert counts(ab.simulator_sentence(sim))[0] == (1, 2)


def test_language_model_sentences_and_figure():
    memory = pd.DataFrame([dict(size="big", precision=p, params_gib=a, grads_gib=a, optimizer_gib=2 * a,
                                weight_copies_gib=w, activations_gib=act, total_gib=4 * a + w + act)
                           for p, a, w, act in [("fp32", 10, 0, 20), ("bf16_autocast", 10, 5, 12), ("bf16", 5, 0, 10)]])
    text = ab.memory_sentence(memory, 4, 512)
    assert in_order(text, [60.0, 33])  # fp32 total, share of saved activations
    assert in_order(text, [57.0, 8.0, 5.0])  # autocast: total, activations saved, weight copies added
    assert in_order(text, [30.0])  # pure bf16 total
    assert len(ab.memory_figure(memory, 4, 512).axes) == 3
    flops = pd.DataFrame(dict(size=["a", "b"], attention_share=[0.07, 0.02]))
    assert in_order(ab.flops_sentence(flops, 512), [7.0, 2.0])


def test_limits_and_sweep_sentences():
    limits = ba.ffn_limits_table(65536, 989e12, 450e9, 3)
    assert numbers(ab.limits_sentence(limits, 65536, 989e12, 450e9))[-5:] == [46, 31, 56, 1711, 450]
    sweep = ba.ffn_sweep_table(65536, 989e12, 450e9, devices=(2, 64), matrices=3)
    text = ab.ffn_sweep_sentence(sweep)
    assert in_order(sentence_with(text, "FSDP"), [64, 47, 32])  # devices; % of peak overlapped, not
    assert ab.ffn_sweep_figure(sweep, 65536) is not None


# ---------------------------------------------------------------------------------------------- measured results


def _lm_rows():
    return pd.DataFrame([dict(size="small", context=128, batch=4, dtype="fp32", attention="sdpa", compile=False,
                              world_size=1, fwd_ms=1.0, fwdbwd_ms=2.0, step_ms=3.0, fwd_peak_gib=1.0,
                              fwdbwd_peak_gib=2.0, step_peak_gib=3.9, status="ok")])


def test_measured_results_absent_other_source_and_new_format(tmp_path, capsys):
    book = Chapter("09_accounting", {}, str(tmp_path))
    assert ab.measured_results(book, "lm_step", "01_profiling") is None
    assert "No `" in capsys.readouterr().out
    store.save_results(_lm_rows(), "lm_step", str(tmp_path), source="04_attention")
    assert ab.measured_results(book, "lm_step", "01_profiling") is None
    out = capsys.readouterr().out
    assert "01_profiling" in out and "04_attention" not in out  # the source it lacks, not the one it has
    store.save_results(_lm_rows(), "lm_step", str(tmp_path), source="01_profiling")
    df = ab.measured_results(book, "lm_step", "01_profiling")
    assert len(df) == 1 and (df["source"] == "01_profiling").all()
    out = capsys.readouterr().out
    assert "`lm_step`" in out and "01_profiling" in out and "CPU" in out  # table, source, machine


def test_measured_results_old_format(tmp_path, capsys):
    """A table written before rows had a source: read whole, provenance from its sidecar (a list of runs in
    lm_step's old format), and a clear sentence when the per-mode peak columns are missing."""
    old = _lm_rows().drop(columns=["fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib"]).assign(peak_gib=3.9)
    old.to_csv(tmp_path / "lm_step.csv", index=False)
    run = dict(gpu_count=1, gpu_name="NVIDIA H200", torch="2.11", triton="3.6", commit="abc", date="2026-11-26T02")
    (tmp_path / "lm_step.json").write_text(json.dumps({"table": "lm_step", "sources": [run, run]}))
    book = Chapter("09_accounting", {}, str(tmp_path))
    assert ab.measured_results(book, "lm_step", "01_profiling") is None
    out = capsys.readouterr().out
    old_rows = sentence_with(out, "`source`")
    assert numbers(old_rows)[0] == 1 and "`lm_step`" in old_rows  # how many rows, of which table
    # the two identical runs of the sidecar are named once: machine, torch, triton, commit, date
    assert out.count("NVIDIA H200") == 1 and in_order(out, [2.11, 3.6]) and "abc" in out and "2026-11-26" in out
    missing = sentence_with(out, "`fwd_peak_gib`")
    assert "`fwdbwd_peak_gib`" in missing and "`step_peak_gib`" in missing
    # the same old format with the per-mode columns is read and compared
    _lm_rows().to_csv(tmp_path / "lm_step.csv", index=False)
    df = ab.measured_results(book, "lm_step", "01_profiling")
    assert df is not None and ba.predicted_vs_measured(df, None)["impl"].tolist() == [
        "forward", "forward_backward", "train_step"]


def _check():
    return pd.DataFrame(dict(table=["lm_step", "lm_step", "sharding_benchmark"], impl=["forward", "train_step", "ddp"],
                             size="small", context=128, batch=4, dtype="fp32", world_size=[1, 1, 2],
                             predicted_gib=[1.0, 4.0, 2.0], measured_gib=[1.1, 2.0, 2.0], ratio=[1.1, 0.5, 1.0]))


def test_memory_check_lists_disagreements_plainly(capsys):
    check = _check()
    bad = ab.disagreements(check, 0.25)
    assert bad["impl"].tolist() == ["train_step"]
    text = ab.memory_check_sentence(check, 0.25)
    lm_part = text[:text.index("`sharding_benchmark`")]
    assert counts(lm_part) == [(1, 2)] and in_order(lm_part, [25, 0.5, 1.1, 0.8, 1])  # agree, range, median, not
    assert counts(text[text.index("`sharding_benchmark`"):])[0] == (1, 1)
    assert in_order(text[text.rindex(". ") + 1:], [1, 25])  # then the disagreeing rows are listed
    assert "because" not in text and "transient" not in text  # numbers, not explanations
    shown = ab.show_memory_check(check, 0.25, [check, None])
    assert shown["impl"].tolist() == ["train_step"] and "| train_step" in capsys.readouterr().out
    lm_answer, sharding_answer = ab.memory_check_answer(check, 0.25).split(";")
    assert counts(lm_answer) == [(1, 2)] and "`lm_step`" in lm_answer
    assert counts(sharding_answer) == [(1, 1)] and "`sharding_benchmark`" in sharding_answer
    lm_answer, sharding_answer = ab.memory_check_answer(check[check["table"] == "sharding_benchmark"], 0.25).split(";")
    assert "`lm_step`" in lm_answer and counts(lm_answer) == [] and numbers(lm_answer) == []  # nothing compared
    assert "`sharding_benchmark`" in sharding_answer and counts(sharding_answer)[0] == (1, 1)
    for part, table in zip(ab.memory_check_answer(pd.DataFrame(), 0.25).split(";"), ["lm_step", "sharding_benchmark"]):
        assert f"`{table}`" in part and numbers(part) == []  # each table named, with no count
    assert ab.memory_check_figure(check, 0.25) is not None
    empty = pd.DataFrame()
    nothing_read, nothing_measured = (ab.memory_check_sentence(empty, 0.25, tables_read=k) for k in (0, 1))
    assert numbers(nothing_read) == [] and numbers(nothing_measured) == [] and nothing_read != nothing_measured
    assert "CPU" in nothing_measured and "CPU" not in nothing_read  # a table was read: the CPU measured no peak
    assert ab.show_comparisons(empty, 0.25) is None and ab.memory_check_display(empty).empty
    assert math.isclose(ab.disagreements(check, 1.0).shape[0], 0)


def test_memory_check_is_saved_unless_replaying(tmp_path):
    book = Chapter("09_accounting", {"quick": True}, str(tmp_path))
    ab.save_memory_check(book, _check())
    saved = store.load_results("accounting_memory_check", str(tmp_path), source="09_accounting")
    assert saved["ratio"].tolist() == [1.1, 0.5, 1.0]
    ab.save_memory_check(book, pd.DataFrame())  # an empty comparison replaces the older one
    assert store.load_results("accounting_memory_check", str(tmp_path)).empty
    replaying = Chapter("09_accounting", {}, str(tmp_path / "other"), replay=True)
    ab.save_memory_check(replaying, _check())
    assert not (tmp_path / "other").exists()


def test_an_old_memory_check_is_replaced_whole(tmp_path):
    """The old check named the compared table in a `source` column; saving must not keep its rows as if they
    came from another notebook."""
    old = _check().rename(columns={"table": "source"})
    old.to_csv(tmp_path / "accounting_memory_check.csv", index=False)
    (tmp_path / "accounting_memory_check.json").write_text("{}")
    ab.save_memory_check(Chapter("09_accounting", {}, str(tmp_path)), _check().iloc[:1])
    saved = store.load_results("accounting_memory_check", str(tmp_path))
    assert len(saved) == 1 and saved["source"].tolist() == ["09_accounting"] and saved["table"].tolist() == ["lm_step"]
