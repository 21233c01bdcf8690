"""The chapter machinery: measured or replayed tables with provenance, answers linked to sections."""

import json

import pandas as pd
import pytest
import torch

from lab.book import claims as cl
from lab.book import ledger, report
from lab.measure import verdicts as v
from tests.book.prose import bold, has_amount, numbers


def test_table_measures_saves_and_replays(tmp_path, capsys):
    book = report.Chapter("01_profiling", {"quick": True}, str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return pd.DataFrame({"size": ["tiny"], "fwd_ms": [1.5]})

    df = book.table("lm_step", measure)
    assert calls == [1] and df["fwd_ms"].tolist() == [1.5]
    replay = report.Chapter("01_profiling", {"quick": True}, str(tmp_path), replay=True)
    again = replay.table("lm_step", measure)
    assert calls == [1]  # not measured again
    assert again["fwd_ms"].tolist() == [1.5] and again["source"].tolist() == ["01_profiling"]
    out = capsys.readouterr().out  # the replayed table, named with the machine and torch that measured it
    assert "`lm_step`" in out and "torch" in out and torch.__version__.split("+")[0] in out
    with pytest.raises(FileNotFoundError):
        report.Chapter("05_flash", {}, str(tmp_path), replay=True).table("lm_step", measure)


def test_replay_some_tables_and_measure_the_others(tmp_path, capsys):
    report.Chapter("10_fastest_step", {}, str(tmp_path)).table("fused_loss", lambda: pd.DataFrame({"ms": [2.0]}))
    book = report.Chapter("10_fastest_step", {}, str(tmp_path), replay=["fused_loss"])
    calls = []
    loss = book.table("fused_loss", lambda: calls.append("loss") or pd.DataFrame({"ms": [9.0]}))
    step = book.table("fastest_step", lambda: calls.append("step") or pd.DataFrame({"ms": [5.0]}))
    assert calls == ["step"] and loss["ms"].tolist() == [2.0] and step["ms"].tolist() == [5.0]
    capsys.readouterr()  # the replayed table's own provenance line
    book.show_machine()
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "`fused_loss`" in line]
    assert bold(note) and "`fastest_step`" not in note  # the replayed table named, stressed; the measured one not
    with pytest.raises(ValueError, match="list of table names"):
        report.Chapter("10_fastest_step", {}, str(tmp_path), replay="fused_loss")


def test_answers_are_collected_with_links():
    book = report.Chapter("01_profiling", {}, "results")
    first = cl.Measured.of("the first step", [23.0, 23.1, 22.9, 23.2, 23.0])
    steady = cl.Measured.of("the steady state", [10.0, 10.1, 9.9, 10.05, 10.0])
    book.answer(cl.Claim("How slow is the first step?", [cl.Versus(first, steady)]),
                section="Warm-up: why the first steps")
    md = book._answers_markdown()
    (item,) = [line for line in md.splitlines() if "How slow is the first step?" in line]
    assert item.startswith("- *How slow is the first step?*") and has_amount(item, 2.3, "x")  # question, answer
    assert "(#Warm-up:-why-the-first-steps)" in md


def test_the_banner_states_the_rule_and_whether_the_render_ran_alone(tmp_path, capsys):
    book = report.Chapter("01_profiling", {}, str(tmp_path))
    book.neighbours = ["a benchmark (pid 7) on the GPU"]
    book.show_machine()
    out = capsys.readouterr().out
    assert v.RULE in out and "Not alone" in out and "pid 7" in out
    assert report.Chapter("01_profiling", {}, str(tmp_path), replay=True).neighbours is None  # times nothing


def test_ledger_entries_take_the_provenance_of_their_table_and_stop_a_gpu_render(tmp_path):
    def entry(ms):
        return ledger.entry("lm_step", v.summarize([ms + 0.01 * i for i in range(6)]), "ms", f"small {ms}",
                            size="small", context=512, batch=4, dtype="bf16", attention="sdpa", compile=False,
                            fused_loss=False, mode="fwdbwd")

    for source, ms in (("01_profiling", 59.0), ("02_mixed_precision", 31.0)):
        book = report.Chapter(source, {}, str(tmp_path))
        book.table("lm_step", lambda: pd.DataFrame({"size": ["small"]}))
        meta = tmp_path / "lm_step.json"
        sidecar = json.loads(meta.read_text())
        sidecar["sources"][source]["gpu"] = "NVIDIA H100 80GB HBM3"  # as a GPU render saved it
        meta.write_text(json.dumps(sidecar))
        if source == "01_profiling":
            book.ledger([entry(ms)], table="lm_step")
        else:
            with pytest.raises(ledger.LedgerMismatch, match="01_profiling"):
                book.ledger([entry(ms)], table="lm_step")
    assert set(ledger.load(tmp_path)["gpu"]) == {"NVIDIA H100 80GB HBM3"}


def test_carried_rows_keep_their_own_provenance(tmp_path, capsys):
    from lab.measure import results

    first = report.Chapter("10_fastest_step", {"configs": ["a", "b"]}, str(tmp_path))
    first.table("fastest_step", lambda: pd.DataFrame({"config": ["a", "b"], "ms": [5.0, 1.0]}))
    saved = pd.read_csv(tmp_path / "fastest_step.csv")
    saved["commit"] = "earlier0commit"  # as if an earlier commit had measured them
    saved.to_csv(tmp_path / "fastest_step.csv", index=False)
    book = report.Chapter("10_fastest_step", {"configs": ["a", "b"]}, str(tmp_path))
    df = book.table("fastest_step", lambda: pd.DataFrame({"config": ["b"], "ms": [2.0]}),
                    carry=lambda old: old[old["config"] == "a"])
    assert df[["config", "ms"]].values.tolist() == [["a", 5.0], ["b", 2.0]]
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "`fastest_step`" in line]
    assert numbers(note)[0] == 1 and "torch" in note  # one row carried, with the machine that measured it
    back = results.load_results("fastest_step", tmp_path)
    assert back.set_index("config")["commit"].to_dict() == {"a": "earlier0commit", "b": results.git_commit()}
    meta = json.loads((tmp_path / "fastest_step.json").read_text())["sources"]["10_fastest_step"]
    assert meta["params"]["carried"]["rows"] == 1 and "date" in meta["params"]["carried"]["measured_on"][0]
    replay = report.Chapter("10_fastest_step", {}, str(tmp_path), replay=True)
    assert len(replay.table("fastest_step", lambda: None)) == 2
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "`fastest_step`" in line]
    carried = note.split(";")[1]  # after the table's own provenance: how many rows were carried, and from where
    assert numbers(carried)[0] == 1 and "torch" in carried


def test_rows_carried_twice_keep_the_run_that_measured_them(tmp_path, capsys):
    import json

    first = report.Chapter("10_fastest_step", {}, str(tmp_path))
    first.table("fastest_step", lambda: pd.DataFrame({"config": ["a", "b"], "ms": [5.0, 1.0]}))
    meta_path = tmp_path / "fastest_step.json"
    meta = json.loads(meta_path.read_text())
    meta["sources"]["10_fastest_step"]["commit"] = "aaaa"  # the run that measured "a" (and "b")
    meta_path.write_text(json.dumps(meta))
    saved = pd.read_csv(tmp_path / "fastest_step.csv").assign(commit="aaaa")
    saved.to_csv(tmp_path / "fastest_step.csv", index=False)
    report.Chapter("10_fastest_step", {}, str(tmp_path)).table(  # "b" measured again, "a" carried
        "fastest_step", lambda: pd.DataFrame({"config": ["b"], "ms": [2.0]}), carry=lambda old: old[old.config == "a"])
    meta = json.loads(meta_path.read_text())
    meta["sources"]["10_fastest_step"]["commit"] = "bbbb"
    meta_path.write_text(json.dumps(meta))
    third = report.Chapter("10_fastest_step", {}, str(tmp_path))  # "a" carried again: still from aaaa
    third.table("fastest_step", lambda: pd.DataFrame({"config": ["b"], "ms": [3.0]}),
                carry=lambda old: old[old.config == "a"])
    carried = json.loads(meta_path.read_text())["sources"]["10_fastest_step"]["params"]["carried"]
    assert [m["commit"] for m in carried["measured_on"]] == ["aaaa"]
    assert "commit aaaa" in capsys.readouterr().out.splitlines()[-1]


def test_tables_print_floats_as_prose_does_and_keep_other_formats():
    df = pd.DataFrame(dict(impl=["a", "b"], ms=[5236.694, 0.93694], tokens=[12510.3, float("nan")], n=[2, 33],
                           err=[1.2e-5, 0.02]))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.table_text(df, ".4g").splitlines()]
    assert rows[2] == ["a", "5,237", "12,510", "2", "1.2 × 10⁻⁵"] and rows[3] == ["b", "0.9369", "n/a", "33", "0.02"]
    assert rows[1][1].endswith(":") and rows[1][0].startswith(":")  # numbers right-aligned, text left
    fixed = report.table_text(df, ".2f")
    assert "5236.69" in fixed and "12510.30" in fixed  # a fixed-point format is tabulate's, unchanged


def test_a_text_column_without_a_value_shows_an_empty_cell_not_nan():
    df = pd.DataFrame(dict(impl=["ours", "sdpa"], kernel=["gluon", float("nan")], note=[None, "skipped"],
                           ms=[1.5, float("nan")]))
    text = report.table_text(df, ".3g")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    assert rows[2] == ["ours", "gluon", "", "1.5"] and rows[3] == ["sdpa", "", "skipped", "n/a"]
    assert not cl.machine_phrases(text)


def test_a_shown_table_leaves_out_provenance_that_its_caption_states_once(monkeypatch):
    seen = []
    monkeypatch.setattr(report, "_display_markdown", seen.append)
    df = pd.DataFrame(dict(impl=["a", "b"], ms=[1.0, 2.0], gpu=["NVIDIA H200"] * 2, gpu_count=[1, 1],
                           host_cpu=["x", "x"], commit=["c" * 40, "d" * 40]))
    report.show_table(df)
    header = [c.strip() for c in seen[0].splitlines()[0].strip("|").split("|")]
    assert header == ["impl", "ms", "commit"]  # two commits (a carried row) are said row by row


def test_a_resumed_render_takes_back_the_rows_its_stopped_call_logged(tmp_path, monkeypatch, capsys):
    from lab.measure import results as store

    here = {"commit": "d" * 40, "gpu_name": "NVIDIA H200", "gpu_count": 1, "host_cpu": "x", "torch": "2",
            "gpu": "NVIDIA H200"}
    monkeypatch.setattr(store, "provenance", lambda params=None: {**here, "params": params or {}})

    def sweep(log, stop_after=None):
        rows = []
        for size in ("small", "xl"):
            row = log.get({"size": size})
            if row is None:
                if size == stop_after:
                    raise KeyboardInterrupt("the call's time limit")
                row = {"size": size, "ms": float(len(size))}
                log.put({"size": size}, row)
            rows.append(row)
        return pd.DataFrame(rows)

    first = report.Chapter("01_profiling", {}, str(tmp_path), replay=[])  # what lab.render --resume passes
    with pytest.raises(KeyboardInterrupt):
        first.table("lm_step", lambda: sweep(first.rows("lm_step"), stop_after="xl"))
    log = tmp_path / "partial" / "01_profiling" / "lm_step.jsonl"
    assert log.exists()
    plain = report.Chapter("01_profiling", {}, str(tmp_path))  # a render that is not resumed measures it all
    assert plain.rows("lm_step").get({"size": "small"}) is None
    # and its log starts empty: stop once more after the small row, then resume
    with pytest.raises(KeyboardInterrupt):
        first.table("lm_step", lambda: sweep(first.rows("lm_step"), stop_after="xl"))
    capsys.readouterr()
    resumed = report.Chapter("01_profiling", {}, str(tmp_path), replay=[])
    df = resumed.table("lm_step", lambda: sweep(resumed.rows("lm_step")))
    assert df["size"].tolist() == ["small", "xl"] and not log.exists()  # saved: the log is gone
    (note,) = [line for line in capsys.readouterr().out.splitlines() if "earlier call" in line]
    assert numbers(note) == [1]


def test_a_replay_names_the_machine_commit_and_neighbours_that_measured_its_tables(tmp_path, monkeypatch):
    """A full replay on this machine of tables a GPU measured: the banner (and the index read from it) names the
    GPU, its commit and date and the parameters it measured with, and whether that run was alone."""
    from lab.book import index

    gpu = dict(gpu="NVIDIA H200", gpu_name="NVIDIA H200", gpu_count=1, driver="580", cuda="13.0", torch="2.11.0",
               triton="3.6.0", host_cpu="x86_64", commit="f" * 40, date="2026-11-28T10:00:00+00:00",
               params={"quick": False, "sizes": ["2.7B"], "neighbours": []})
    measured = report.Chapter("04_attention", {"quick": False}, str(tmp_path))
    measured.table("lm_step", lambda: pd.DataFrame({"ms": [1.0]}))
    sidecar = tmp_path / "lm_step.json"
    meta = json.loads(sidecar.read_text())
    meta["sources"]["04_attention"] = gpu  # as the GPU's render saved it
    sidecar.write_text(json.dumps(meta))
    shown = []
    monkeypatch.setattr(report, "_display_markdown", lambda text, **kw: shown.append(text))
    report.Chapter("04_attention", {"quick": True, "sizes": ["tiny"]}, str(tmp_path), replay=True).show_machine()
    banner = shown[0]
    assert banner.startswith("> Measured on **1 x NVIDIA H200**") and "f" * 40 in banner
    assert "2.7B" in banner and "tiny" not in banner  # the parameters it was measured with
    assert any(t.startswith("> **Alone:**") for t in shown)  # the measuring run's neighbours: none
    md = lambda text: {"output_type": "display_data", "data": {"text/markdown": text}, "metadata": {}}
    nb = {"metadata": {}, "nbformat": 4, "nbformat_minor": 5,
          "cells": [{"cell_type": "code", "source": "", "metadata": {}, "outputs": [md(t) for t in shown]}]}
    (tmp_path / "04_attention.ipynb").write_text(json.dumps(nb))
    s = index.summary(tmp_path / "04_attention.ipynb")
    assert s["machine"] == "1 x NVIDIA H200" and s["commit"] == "f" * 40 and s["date"] == "2026-11-28"
    assert s["alone"] is True and s["replayed"]
