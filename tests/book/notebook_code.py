"""The code of a notebook as tests read it, to check that a notebook holds parameters and calls only."""

import pytest

from lab.paths import REPO_ROOT


def notebook_code(name: str) -> list[str]:
    """The non-blank, non-comment lines of the code cells of notebooks/<name>.py."""
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(REPO_ROOT / "notebooks" / f"{name}.py")
    return [ln.strip() for c in nb.cells if c.cell_type == "code" for ln in c.source.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]


def assert_thin(name: str, budget: int) -> None:
    """At most ``budget`` lines of code, no definitions or loops, lambdas only to defer a call."""
    lines = notebook_code(name)
    assert len(lines) <= budget, f"{name} has {len(lines)} lines of code (budget {budget})"
    assert not [ln for ln in lines if ln.startswith(("def ", "class ", "for ", "while "))]
    assert all("lambda:" in ln for ln in lines if "lambda" in ln)  # only deferred calls, no arguments
