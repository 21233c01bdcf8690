"""The render command: one-line errors for a misspelt parameter, an unreadable value or an unknown notebook."""

import json

import pytest

from lab import render
from lab.cli import UsageError


def test_parameters_are_read_from_the_parameters_cell():
    params = render.notebook_parameters(render.numbered_notebooks(["01"])[0])
    assert {"quick", "device", "results_dir", "artifacts_dir"} <= set(params)
    assert params["quick"] is True


def test_unknown_parameter_is_refused_before_anything_runs():
    with pytest.raises(UsageError, match="unknown parameter 'sise' for 01_profiling; it accepts: quick"):
        render.check_parameters(render.numbered_notebooks(["01"]), {"sise": "tiny"})
    render.check_parameters(render.numbered_notebooks(["01"]), {"quick": True})


@pytest.mark.parametrize("text,value", [("cuda", "cuda"), ("[128, 256]", [128, 256]), ("False", False),
                                        ("['small']", ["small"])])
def test_values(text, value):
    assert render.parse_value("x", text) == value


def test_unreadable_literal_is_one_line():
    with pytest.raises(UsageError, match="cannot read"):
        render.parse_value("sizes", "[small, medium")


@pytest.mark.parametrize("argv,phrase", [(["--only", "42"], "no notebook matches '42'"),
                                         (["--only", "01", "-p", "sise", "tiny"], "unknown parameter 'sise'"),
                                         (["-p", "sizes", "[small"], "cannot read"),
                                         (["--profile", "huge"], "invalid choice: 'huge'")])
def test_cli_errors_are_one_line(argv, phrase, capsys):
    assert render.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and phrase in err, err


def test_progress_bars_are_stripped_from_stored_outputs(tmp_path):
    import json

    bars = ["lm sweep:  50%|#####     | 2/4 [00:01<00:01,  1.9it/s]\r",
            "lm sweep: 100%|##########| 4/4 [00:02<00:00,  1.9it/s]\n",
            "[progress] fastest step: tiny project: ok, 12.0 ms a step (host); first step 0.1 s\n"]
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stderr", "text": bars},
        {"output_type": "stream", "name": "stderr", "text": ["a real warning\n"]},
        {"output_type": "stream", "name": "stdout", "text": ["50%|kept on stdout|\n"]}]}]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    assert render.strip_progress_bars(path) == 3
    outs = json.loads(path.read_text())["cells"][0]["outputs"]
    assert [o["text"] for o in outs] == ["a real warning\n", ["50%|kept on stdout|\n"]]


def test_html_export_opens_offline(tmp_path):
    """The HTML copy of a report loads nothing from the network: no require.js, no MathJax from a CDN; its
    formulas (markdown and text/latex outputs) are MathML, which the browser draws itself."""
    import json
    import re

    pytest.importorskip("nbconvert")
    pytest.importorskip("latex2mathml")
    nb = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {},
                     "source": ["A call costs $T(s) = \\alpha + s/\\beta$, and\n\n$$\\frac{2(n-1)}{n}$$\n"]},
                    {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": 1, "source": ["eq"],
                     "outputs": [{"output_type": "display_data", "metadata": {},
                                  "data": {"text/latex": "$$M = \\frac{1}{2N}$$", "text/plain": "eq"}}]}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "01_demo.ipynb"
    path.write_text(json.dumps(nb))
    page = render.export_html(path).read_text()
    assert not re.findall(r'(?:src|href)="https?://', page)
    assert "require.min.js" not in page
    assert "mathjax" not in page.lower()
    maths = re.findall(r"<math\b.*?</math>", page, flags=re.S)
    assert len(maths) == 3  # inline, display, and the text/latex output
    assert "<mi>α</mi>" in maths[0] and "<mfrac>" in maths[1] and "<mfrac>" in maths[2]
    assert "$" not in re.sub(r"<style.*?</style>|<script.*?</script>", "", page, flags=re.S)


def test_resume_keeps_a_report_of_this_commit_and_reads_back_what_it_measured(tmp_path, monkeypatch):
    """--resume: 01's report by this commit, machine and parameters is kept (not run again); 02's by another
    commit and 04's with other parameters are rendered again; 03, stopped after one table, runs with that table
    read back (its replay parameter) and the others measured."""
    import json

    import pandas as pd

    from lab.measure import results as store

    commit = "c" * 40
    monkeypatch.setenv("LAB_COMMIT", commit)
    prof = render.Profile("quick", True, str(tmp_path / "reports"), str(tmp_path / "results"), str(tmp_path / "a"))
    monkeypatch.setattr(render, "PROFILES", {"quick": prof})
    (tmp_path / "reports").mkdir()
    params = json.loads(json.dumps(prof.parameters()))

    def report(name, at, parameters):
        banner = f"> Rendered on **CPU only** (x); commit `{at}`; 2026-11-28T10:00:00+00:00."
        (tmp_path / "reports" / f"{name}.ipynb").write_text(json.dumps(
            {"cells": [{"cell_type": "code", "outputs": [{"data": {"text/markdown": banner}}]}],
             "metadata": {"papermill": {"parameters": parameters}}}))

    report("01_profiling", commit, {**params, "replay": ["lm_step"]})
    report("02_mixed_precision", "d" * 40, params)
    report("04_attention", commit, {**params, "quick": False})
    store.save_results(pd.DataFrame({"x": [1]}), "memory_peaks", tmp_path / "results", source="03_memory")
    ran = {}
    monkeypatch.setattr(render, "run_notebook", lambda nb, out, p, **kw: ran.setdefault(nb.stem, p) and out)
    done = render.render("quick", ["01", "02", "03", "04"], html=False, resume=True)
    assert [p.stem for p in done] == ["01_profiling", "02_mixed_precision", "03_memory", "04_attention"]
    assert list(ran) == ["02_mixed_precision", "03_memory", "04_attention"]
    assert ran["03_memory"]["replay"] == ["memory_peaks"] and ran["02_mixed_precision"]["replay"] == []
    monkeypatch.setenv("LAB_COMMIT", commit + "+dirty")  # a dirty tree keeps nothing and reads nothing back
    ran.clear()
    render.render("quick", ["01", "03"], html=False, resume=True)
    assert list(ran) == ["01_profiling", "03_memory"] and ran["03_memory"]["replay"] == []


def test_machine_made_phrases_of_a_report_are_found(tmp_path):
    md = lambda text: {"output_type": "display_data", "data": {"text/markdown": text}, "metadata": {}}
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [md("took 1.283e+04 ms"), md("$4 B D$ FLOPs")]},
                    {"cell_type": "markdown", "source": "nan in the notebook's own text is not an output"}]}
    (tmp_path / "r.ipynb").write_text(json.dumps(nb))
    assert render.machine_made(tmp_path / "r.ipynb") == ["3e+0"]
