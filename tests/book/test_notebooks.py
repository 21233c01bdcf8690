"""Every notebook is committed stripped, has a parameters cell, and runs end to end in the quick profile."""

import hashlib
import json
from pathlib import Path

import pytest

from lab import render
from lab.paths import REPO_ROOT

NOTEBOOKS = render.numbered_notebooks()


def test_there_are_notebooks():
    assert NOTEBOOKS and NOTEBOOKS[0].name.startswith("01_")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_parameterised(nb):
    cells = json.loads(nb.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), \
        f"{nb.name} has outputs: commit notebooks stripped (outputs belong in reports/)"
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{nb.name} needs exactly one cell tagged 'parameters'"
    src = "".join(params[0]["source"])
    for name in ("quick", "device", "results_dir", "artifacts_dir"):
        assert f"{name} =" in src, f"{nb.name}: parameters cell lacks {name}"


def _imported_and_defined(source: str) -> set:
    """Names a cell binds at its top level by an import or a definition."""
    import ast

    tree = ast.parse(source)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_import_shadows_a_parameter(nb):
    """A parameter rebound by a later import (`warmup = None`, then `from lab.book import warmup`) silently
    turns the reader's setting into a module."""
    import ast

    code = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    params = next(c for c in code if "parameters" in c.get("metadata", {}).get("tags", []))
    assigned = {t.id for node in ast.parse("".join(params["source"])).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    bound = set()
    for c in code:
        if c is not params:
            bound |= _imported_and_defined("".join(c["source"]))
    assert not assigned & bound, f"{nb.name}: imports or definitions shadow parameters {sorted(assigned & bound)}"


def _cells(nb) -> list[tuple]:
    return [(c["cell_type"], "".join(c["source"]).strip(), tuple(c.get("metadata", {}).get("tags", [])))
            for c in nb["cells"]]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_in_sync_with_its_percent_script(nb):
    """One source per notebook: notebooks/NN.py (jupytext percent script) and NN.ipynb hold the same cells."""
    jupytext = pytest.importorskip("jupytext")
    script = nb.with_suffix(".py")
    assert script.exists(), f"{nb.name} has no paired percent script {script.name} (jupytext --set-formats)"
    paired = jupytext.read(script)
    assert _cells(paired) == _cells(json.loads(nb.read_text())), \
        f"{nb.name} and {script.name} differ: run `jupytext --sync {script}`"


def test_sync_check_notices_a_changed_script(tmp_path):
    """The pairing test above can fail: a script edited without syncing differs from its notebook."""
    jupytext = pytest.importorskip("jupytext")
    script = NOTEBOOKS[0].with_suffix(".py")
    edited = tmp_path / script.name
    edited.write_text(script.read_text() + "\n# %%\nprint('an edit that was never synced')\n")
    assert _cells(jupytext.read(edited)) != _cells(json.loads(NOTEBOOKS[0].read_text()))


def test_jupyterlab_lists_each_notebook_once():
    """JupyterLab asks jupytext's contents manager what a file is: the .ipynb of a pair is the notebook, its
    percent script a plain file (opened in the editor), so that the folder shows each notebook once."""
    pytest.importorskip("jupyter_server")
    from jupyter_server.services.contents.largefilemanager import LargeFileManager
    from jupytext.sync_contentsmanager import build_sync_jupytext_contents_manager_class

    manager = build_sync_jupytext_contents_manager_class(LargeFileManager)(root_dir=str(REPO_ROOT))
    listing = manager.get("notebooks", content=True)["content"]
    as_notebooks = sorted(item["name"] for item in listing if item["type"] == "notebook")
    assert as_notebooks == [nb.name for nb in NOTEBOOKS]
    scripts = {item["name"]: item["type"] for item in listing if item["name"].endswith(".py")}
    assert scripts == {nb.with_suffix(".py").name: "file" for nb in NOTEBOOKS}


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.ipynb")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _errors(executed: dict) -> list:
    return [o for c in executed["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang, not a busy machine: renders took 11 minutes under a load of 13
@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_quick(nb, tmp_path):
    """Each notebook runs end to end in the quick profile and saves results. A quick render that `make book`
    made of the code as it is now (same notebook, lab sources, parameters and versions) is checked instead of
    rendered a second time."""
    quick = render.PROFILES["quick"]
    made = quick.parameters()
    report = render.paths.resolve(quick.reports_dir) / nb.name
    stamp = render.reusable_render(nb, report, made)
    if stamp is None:
        before = _digest(render.NOTEBOOKS_DIR)
        made = dict(quick=True, results_dir=str(tmp_path / "results"), artifacts_dir=str(tmp_path / "artifacts"))
        report = render.run_notebook(nb, tmp_path / nb.name, made)
        assert _digest(render.NOTEBOOKS_DIR) == before, "rendering must never modify notebooks/"
        stamp = render.reusable_render(nb, report, made)
        assert stamp is not None, "a render just made is reusable until the code changes"
    assert not _errors(json.loads(report.read_text()))
    assert any(name.endswith(".csv") for name in stamp["results"]), "a notebook must save results"


def test_a_render_is_reused_only_for_the_same_inputs(tmp_path):
    nb = NOTEBOOKS[0]
    params = dict(quick=True, results_dir=str(tmp_path / "results"))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "rows.csv").write_text("a\n1\n")
    report = tmp_path / nb.name
    executed = json.loads(nb.read_text())
    executed["metadata"]["lab_render"] = {"inputs": render.inputs_digest(nb, params), "results": ["rows.csv"]}
    report.write_text(json.dumps(executed))
    assert render.reusable_render(nb, report, params)["results"] == ["rows.csv"]
    assert render.reusable_render(nb, report, {**params, "quick": False}) is None  # other parameters
    edited = tmp_path / "edited" / nb.name
    edited.parent.mkdir()
    edited.write_text(nb.read_text().replace("quick", "quick ", 1))
    assert render.reusable_render(edited, report, params) is None  # another notebook
    (tmp_path / "results" / "rows.csv").unlink()
    assert render.reusable_render(nb, report, params) is None  # its results are gone
    assert render.reusable_render(nb, tmp_path / "never_rendered.ipynb", params) is None


def test_failing_cell_is_reported_clearly(tmp_path):
    nb = tmp_path / "99_broken.ipynb"
    nb.write_text(json.dumps({
        "cells": [{"id": "a", "cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": ["quick = True"],
                   "outputs": [], "execution_count": None},
                  {"id": "b", "cell_type": "code", "metadata": {}, "source": ["raise ValueError('broken on purpose')"],
                   "outputs": [], "execution_count": None}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5}))
    with pytest.raises(render.NotebookFailed, match="broken on purpose") as info:
        render.run_notebook(nb, tmp_path / "out" / nb.name, {"quick": True})
    assert "99_broken" in str(info.value)
    assert not (tmp_path / "out" / nb.name).exists() and (tmp_path / "out" / "99_broken.failed.ipynb").exists()
