"""The reader's index is read from the rendered reports themselves."""

import json

from lab.book import index


def _report(path, banner_extra="", answers=("How long does a step take?", "Why is the first step slow?")):
    md = lambda text: {"output_type": "display_data", "data": {"text/markdown": text}, "metadata": {}}
    box = "**Answers**\n\n" + "\n".join(f"- *{q}* Some answer. ([→](#x))" for q in answers)
    nb = {"metadata": {"papermill": {"duration": 448.2}}, "nbformat": 4, "nbformat_minor": 5, "cells": [
        {"cell_type": "markdown", "source": "# 01 · Profiling: where the time goes\n\nText.", "metadata": {}},
        {"cell_type": "code", "source": "book.show_machine()", "metadata": {}, "execution_count": 1, "outputs": [
            md("> Rendered on **1 x NVIDIA H100 80GB HBM3** (driver 580, CUDA 13.0); torch 2.11; commit "
               "`0123456789abcdef0123456789abcdef01234567`; 2026-11-27T07:09:12+00:00."),
            md("> **The rule.** ..."), md("> **Alone:** nothing else ran." + banner_extra), md(box)]}]}
    path.write_text(json.dumps(nb))
    return path


def test_summary_reads_banner_answers_and_timing(tmp_path):
    s = index.summary(_report(tmp_path / "01_profiling.ipynb"))
    assert s["questions"] == ["How long does a step take?", "Why is the first step slow?"]
    assert s["machine"] == "1 x NVIDIA H100 80GB HBM3" and s["commit"].startswith("0123456789ab")
    assert s["date"] == "2026-11-27" and s["alone"] is True and s["seconds"] == 448.2 and not s["replayed"]
    assert s["title"] == "01 · Profiling: where the time goes"


def test_index_has_one_row_per_report(tmp_path):
    _report(tmp_path / "01_profiling.ipynb")
    _report(tmp_path / "02_mixed_precision.ipynb", answers=("Does bf16 help?",))
    _report(tmp_path / "03_memory.failed.ipynb")  # what a failed render leaves: not a report
    _report(tmp_path / "03_memory.running.ipynb")
    text = index.write_index(tmp_path).read_text()
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert len(rows) == 2 and "Does bf16 help?" in rows[1] and "448 s" in rows[0]
    assert "(02_mixed_precision.html)" in rows[1]
