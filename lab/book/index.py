"""The reader's index of the rendered book (``reports/README.md``): for each report, the questions it answers,
the machine that measured it, its commit and date, whether it ran alone, and how long it took to render.

Everything is read from the rendered notebooks themselves (the banner and answers box a
:class:`lab.book.report.Chapter` writes, papermill's timing), so the index cannot drift from the reports.
``python -m lab.book.index [reports_dir]`` writes it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from lab.book.claims import number

INTRO = """# The rendered lab book

Each report is a notebook executed top to bottom (`python -m lab.render --profile full`). Its banner names the
machine, the versions, the commit and the date, states the rule every verdict in it follows, and says whether
the render had its GPUs and host to itself; its tables are in `results/` (CSV with a JSON provenance sidecar, one
row per measurement). A report whose tables were read back from an earlier render says so in its banner and
beside each table. Open `NN_*.html` to read a report without Jupyter.
"""


def _markdown_outputs(nb: dict) -> list[str]:
    out = []
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []):
            text = o.get("data", {}).get("text/markdown")
            if text:
                out.append("".join(text) if isinstance(text, list) else text)
    return out


def _title(nb: dict, fallback: str) -> str:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            m = re.search(r"^#\s+(.+)$", "".join(cell.get("source", "")), re.M)
            if m:
                return m.group(1).strip()
    return fallback


def summary(path: str | Path) -> dict:
    """What the index says of one rendered report: ``name``, ``title``, ``questions``, ``machine``, ``commit``,
    ``date``, ``alone`` (True, False, or None where the banner does not say), ``replayed``, ``seconds``."""
    path = Path(path)
    nb = json.loads(path.read_text())
    texts = _markdown_outputs(nb)
    banner = next((t for t in texts if t.startswith(("> Rendered on", "> Measured on"))), "")
    answers = next((t for t in reversed(texts) if t.startswith("**Answers**")), "")
    machine = re.search(r"(?:Measured|Rendered) on \*\*(.+?)\*\*", banner)  # a replay: who measured its tables
    commit = re.search(r"commit `([0-9a-f+dirty]+)`", banner)
    date = re.search(r"; (\d{4}-\d{2}-\d{2})T", banner)
    alone = True if any("**Alone:**" in t for t in texts) else False if any("**Not alone:**" in t for t in texts) \
        else None
    return dict(name=path.stem, title=_title(nb, path.stem),
                questions=re.findall(r"^- \*(.+?)\*", answers, re.M),
                machine=machine.group(1) if machine else "unknown", commit=commit.group(1) if commit else "unknown",
                date=date.group(1) if date else "unknown", alone=alone,
                replayed=any(t.startswith(("> **Replayed:**", "> **Partly replayed:**")) for t in texts),
                seconds=(nb.get("metadata", {}).get("papermill") or {}).get("duration"))


def index_markdown(reports_dir: str | Path = "reports") -> str:
    """The index as Markdown: one row per ``NN_*.ipynb`` in ``reports_dir`` (not the partial notebooks a failed
    or running render leaves, ``NN_*.failed.ipynb`` and ``NN_*.running.ipynb``)."""
    rows = [summary(p) for p in sorted(Path(reports_dir).glob("[0-9][0-9]_*.ipynb"))
            if not p.name.endswith((".failed.ipynb", ".running.ipynb"))]
    lines = [INTRO, "| report | the questions it answers | measured on | commit | date | alone | render time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        questions = "<br>".join(r["questions"]) or "(no answers box)"
        machine = r["machine"] + (" (tables read back)" if r["replayed"] else "")
        alone = {True: "yes", False: "no", None: "not recorded"}[r["alone"]]
        seconds = number(r["seconds"], "s") if r["seconds"] else "n/a"
        lines.append(f"| [{r['title']}]({r['name']}.html) | {questions} | {machine} | `{r['commit'][:12]}` | "
                     f"{r['date']} | {alone} | {seconds} |")
    return "\n".join(lines) + "\n"


def write_index(reports_dir: str | Path = "reports") -> Path:
    """Write ``reports_dir/README.md`` (:func:`index_markdown`); returns its path."""
    out = Path(reports_dir) / "README.md"
    out.write_text(index_markdown(reports_dir))
    return out


if __name__ == "__main__":
    print(write_index(sys.argv[1] if len(sys.argv) > 1 else "reports"))
