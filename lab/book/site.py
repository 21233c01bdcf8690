"""The rendered lab book as one offline website: ``python -m lab.book.site`` (``make site``) -> ``build/site/``.

Sphinx with myst-nb reads the executed reports (``reports/NN_*.ipynb``, committed with their outputs) without
running them again, and writes one HTML page per report beside a front page that is the reader's index: for
each report, the questions it answers (read from its answers box), each linking to that report. The site has
a table of contents and Sphinx's search, and needs no network: plots are image files, and math is typeset by
the MathJax that the ``jupyter-server-mathjax`` package ships, copied into the site (no CDN, no require.js).
Open ``build/site/index.html`` in a browser.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from lab import cli, paths

REPORTS = paths.REPO_ROOT / "reports"
OUT = paths.REPO_ROOT / "build" / "site"

#: One answer of a report's answers box: ``- *question* answer ([→](#section))``.
_ANSWER = re.compile(r"^- \*(?P<question>.+?)\* ", re.MULTILINE)

CONF = """\
# Written by lab.book.site for this build: the executed reports, read as they are.
project = "The systems lab book"
extensions = ["myst_nb"]
nb_execution_mode = "off"            # the reports are rendered already; the site only shows them
nb_ipywidgets_js = {}                # no widget outputs: no require.js or widget manager from a CDN
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3             # "#correct-first": the answers box links to its sections (see site.py)
nb_render_markdown_format = "myst"   # markdown outputs (the generated sentences) with their math
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"   # in _static: shipped with the site
# MathJax 2 (the version a Python package ships): typeset the formulas Sphinx marks, inside the notebook pages that
# myst-nb marks to be ignored otherwise (their prose is not TeX)
mathjax2_config = {"tex2jax": {"inlineMath": [["\\\\(", "\\\\)"]], "displayMath": [["\\\\[", "\\\\]"]],
                               "processEscapes": False, "processClass": "math|output_area|tex2jax_process"},
                   # the package ships the STIX web fonts only (as Jupyter configures it)
                   "HTML-CSS": {"availableFonts": [], "preferredFont": None, "webFont": "STIX-Web", "imageFont": None},
                   "SVG": {"font": "STIX-Web"}}
mathjax3_config = None
html_theme = "alabaster"
html_show_sphinx = False
html_static_path = ["_static"]
html_theme_options = {"font_family": "sans-serif", "head_font_family": "sans-serif", "page_width": "1200px"}
html_sidebars = {"**": ["navigation.html", "searchbox.html"]}
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header"]
"""


def report_title(executed: dict) -> str:
    """The first heading of a report's first markdown cell."""
    for cell in executed.get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", "")).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


def report_questions(executed: dict) -> list[str]:
    """The questions of a report's answers box (the last state of the box, as the render left it)."""
    questions: list[str] = []
    for cell in executed.get("cells", []):
        for out in cell.get("outputs", []):
            text = "".join(out.get("data", {}).get("text/markdown", ""))
            if text.startswith("**Answers**"):
                questions = [m.group("question") for m in _ANSWER.finditer(text)]
    return questions


def reader_index(reports: Sequence[Path]) -> str:
    """The front page (MyST markdown): what the book is, then each report with the questions it answers, and
    the table of contents."""
    lines = ["# The systems lab book", "",
             "Where a Transformer's training time and memory go on real GPUs, and how far custom kernels and "
             "parallelism move them. Each report below was rendered from a notebook of the book; every answer in "
             "it is generated from the tables of that render, and its banner names the machine that measured it.",
             "", "## What each report answers", ""]
    for report in reports:
        executed = json.loads(report.read_text())
        lines.append(f"### [{report_title(executed) or report.stem}]({report.stem}.ipynb)")
        lines.append("")
        lines += [f"- {q}" for q in report_questions(executed)] or ["- (this render has no answers box)"]
        lines.append("")
    lines += ["```{toctree}", ":maxdepth: 1", ":caption: Reports", "", *[r.stem for r in reports], "```", ""]
    return "\n".join(lines)


#: A link to a heading of the same notebook, as Jupyter writes it: the title with its spaces turned to dashes.
_JUPYTER_ANCHOR = re.compile(r"\]\(#([^)\s]+)\)")


def site_anchors(text: str) -> str:
    """Jupyter's heading links (``#Correct-first``) as the site's (MyST's GitHub-style ``#correct-first``)."""
    from myst_parser.slugs import github_slugify

    return _JUPYTER_ANCHOR.sub(lambda m: f"](#{github_slugify(m.group(1).replace('-', ' '))})", text)


def site_copy(executed: dict) -> dict:
    """An executed report as the site reads it: the same cells and outputs, with :func:`site_anchors`."""
    for cell in executed.get("cells", []):
        if cell.get("cell_type") == "markdown":
            cell["source"] = site_anchors("".join(cell.get("source", "")))
        for out in cell.get("outputs", []):
            if "text/markdown" in out.get("data", {}):
                out["data"]["text/markdown"] = site_anchors("".join(out["data"]["text/markdown"]))
    return executed


def mathjax_dir() -> Path:
    """The MathJax 2 tree that ``jupyter-server-mathjax`` installs (MathJax.js, its fonts and extensions)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise cli.UsageError("the site needs jupyter-server-mathjax for offline math: pip install -e '.[dev]'") \
            from None
    return Path(jupyter_server_mathjax.__file__).parent / "static"


def build_site(reports_dir: Path = REPORTS, out_dir: Path = OUT, only: Sequence[str] | None = None) -> Path:
    """Build the site of ``reports_dir``'s executed ``NN_*.ipynb`` into ``out_dir``; returns its index.html.
    ``only``: report numbers or stems. The Sphinx sources are written to ``<out_dir>.src`` (rebuilt each time)."""
    from sphinx.cmd.build import build_main

    reports = sorted(p for p in Path(reports_dir).glob("[0-9][0-9]_*.ipynb")
                     if not p.name.endswith((".failed.ipynb", ".running.ipynb")))
    if only:
        reports = [p for p in reports if p.stem[:2] in only or p.stem in only]
    if not reports:
        raise cli.UsageError(f"no rendered report (NN_*.ipynb) in {reports_dir}")
    source = Path(f"{out_dir}.src")
    shutil.rmtree(source, ignore_errors=True)
    (source / "_static").mkdir(parents=True)
    for report in reports:
        (source / report.name).write_text(json.dumps(site_copy(json.loads(report.read_text()))))
    shutil.copytree(mathjax_dir(), source / "_static" / "mathjax")
    (source / "conf.py").write_text(CONF)
    (source / "index.md").write_text(reader_index(reports))
    shutil.rmtree(out_dir, ignore_errors=True)
    code = build_main(["-b", "html", "-q", "-j", "1", str(source), str(out_dir)])
    if code:
        raise RuntimeError(f"sphinx-build failed (exit {code}); its messages are above")
    return Path(out_dir) / "index.html"


def main(argv: Sequence[str] | None = None) -> int:
    def run(args_in):
        p = cli.Parser(prog="python -m lab.book.site", description=__doc__.splitlines()[0])
        p.add_argument("--reports-dir", default=str(REPORTS), help="where the executed NN_*.ipynb are (reports/)")
        p.add_argument("--out", default=str(OUT), help="the site's folder (build/site, git-ignored)")
        p.add_argument("--only", nargs="+", help="report numbers or stems, e.g. 01 05")
        args = p.parse_args(args_in)
        cli.writable_dir(Path(args.out).parent, "--out")
        index = build_site(Path(args.reports_dir), Path(args.out), args.only)
        print(f"site: {index}")
        return 0

    return cli.run(run, argv, prog="python -m lab.book.site")


if __name__ == "__main__":
    sys.exit(main())
