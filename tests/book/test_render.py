"""The render command: one-line errors for a misspelt parameter, an unreadable value or an unknown notebook."""

import pytest

from lab.book import render
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
