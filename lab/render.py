"""Render the lab book: run every numbered notebook through papermill into ``reports/``.

``python -m lab.render --profile quick`` runs the CPU-sized book into ``reports/quick`` (results into
``results/quick``); ``--profile full`` runs the GPU-sized book into ``reports/`` (results into ``results/``).
The notebooks in ``notebooks/`` are only read, never written.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lab
from lab import cli, paths
from lab.bench.progress import PREFIX as PROGRESS_PREFIX
from lab.book.claims import machine_phrases
from lab.book.index import summary
from lab.cli import UsageError
from lab.measure import machine
from lab.measure import results as store

NOTEBOOKS_DIR = paths.REPO_ROOT / "notebooks"


@dataclass(frozen=True)
class Profile:
    """Where a profile's reports and results go, and the parameters every notebook receives."""

    name: str
    quick: bool
    reports_dir: str
    results_dir: str
    artifacts_dir: str

    def parameters(self) -> dict:
        return dict(quick=self.quick, results_dir=self.results_dir, artifacts_dir=self.artifacts_dir)


PROFILES = {
    "quick": Profile("quick", True, "reports/quick", "results/quick", "artifacts/quick"),
    "full": Profile("full", False, "reports", "results", "artifacts"),
}


class NotebookFailed(RuntimeError):
    """A cell raised; the message names the notebook, the cell and the error."""


def numbered_notebooks(only: Sequence[str] | None = None) -> list[Path]:
    """``notebooks/NN_*.ipynb`` in order; ``only`` filters by number prefix (``"01"``) or stem."""
    books = sorted(p for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        wanted = set(only)
        books = [p for p in books if p.stem[:2] in wanted or p.stem in wanted]
        missing = wanted - {p.stem[:2] for p in books} - {p.stem for p in books}
        if missing:
            raise UsageError(f"no notebook matches {sorted(missing)[0]!r}; have: "
                             f"{', '.join(p.stem for p in sorted(NOTEBOOKS_DIR.glob('[0-9][0-9]_*.ipynb')))}")
    return books


def notebook_parameters(notebook: Path) -> dict[str, object]:
    """The names (and default values, where they are literals) assigned in a notebook's cell tagged
    ``parameters``: what ``-p NAME VALUE`` may set."""
    import ast
    import json

    cells = json.loads(Path(notebook).read_text())["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not tagged:
        return {}
    out: dict[str, object] = {}
    for node in ast.parse("".join(tagged[0]["source"])).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        out[target.id] = None
    return out


def check_parameters(notebooks: Sequence[Path], parameters: dict) -> None:
    """Refuse, in one line, a parameter that a notebook to render does not have (a misspelt name would
    otherwise be ignored and the whole notebook run with its defaults)."""
    for nb in notebooks:
        known = notebook_parameters(nb)
        unknown = sorted(set(parameters) - set(known))
        if unknown:
            raise UsageError(f"unknown parameter {unknown[0]!r} for {nb.stem}; it accepts: {', '.join(known)}")


def parse_value(name: str, text: str) -> object:
    """A ``-p`` value as a Python literal (``[small, medium]`` is refused: quote the strings); a plain word
    stays a string (``-p device cuda``)."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if text[:1] in "[({'\"" or text[-1:] in "])}'\"":
            raise UsageError(f"parameter {name}: cannot read {text!r} as a Python literal (write lists as "
                             f"\"['small', 'medium']\")") from None
        return text


def inputs_digest(notebook: Path, parameters: dict) -> str:
    """A digest of what a render's outputs depend on: the notebook, every source file of ``lab``, the
    parameters, and the versions of Python and torch. Two renders with the same digest ran the same code."""
    import hashlib
    import json
    import platform

    import torch

    h = hashlib.sha256()
    h.update(Path(notebook).read_bytes())
    for source in sorted((paths.REPO_ROOT / "lab").rglob("*.py")):
        h.update(str(source.relative_to(paths.REPO_ROOT)).encode() + source.read_bytes())
    h.update(json.dumps(parameters, sort_keys=True, default=str).encode())
    h.update(f"{platform.python_version()} {torch.__version__}".encode())
    return h.hexdigest()


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()} \
        if folder.is_dir() else {}


def reusable_render(notebook: Path, output: Path, parameters: dict) -> dict | None:
    """The stamp of ``output`` (see :func:`run_notebook`) if it is a complete render of ``notebook`` with
    ``parameters`` by the code as it is now, its results still on disk; else None (render it again)."""
    import json

    try:
        executed = json.loads(Path(output).read_text())
    except (OSError, ValueError):
        return None
    stamp = executed.get("metadata", {}).get("lab_render", {})
    if stamp.get("inputs") != inputs_digest(notebook, parameters):
        return None
    results = paths.resolve(parameters.get("results_dir", "results"))
    if not all((results / name).is_file() for name in stamp.get("results", [])):
        return None
    return stamp


class _LongCellNotice:
    """While papermill runs a notebook, say on the terminal which cell has been running for a while: papermill
    saves the notebook it executes as it goes, with each running cell's start time."""

    def __init__(self, running: Path, label: str, every_s: float = 60.0):
        import threading

        self.running, self.label, self.every_s = running, label, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=5)

    def _watch(self) -> None:
        import json
        from datetime import datetime, timezone

        while not self.stop.wait(self.every_s):
            try:
                cells = json.loads(self.running.read_text())["cells"]
            except (OSError, ValueError, KeyError):
                continue
            for index, cell in enumerate(cells):
                meta = cell.get("metadata", {}).get("papermill", {})
                if meta.get("status") == "running" and meta.get("start_time"):
                    started = datetime.fromisoformat(meta["start_time"].replace("Z", "+00:00"))
                    seconds = (datetime.now(timezone.utc) - started).total_seconds()
                    first = "".join(cell.get("source", "")).strip().splitlines()[:1]
                    print(f"{self.label} cell {index + 1}/{len(cells)} running for {seconds:.0f} s: "
                          f"{first[0][:70] if first else ''}", flush=True)


def run_notebook(notebook: Path, output: Path, parameters: dict, log_output: bool = False,
                 timeout_s: int | None = None, label: str | None = None) -> Path:
    """Execute ``notebook`` with papermill into ``output`` (written only if every cell succeeds).

    On failure the partially executed notebook is kept as ``<output>.failed.ipynb`` and
    :class:`NotebookFailed` names the failing cell. The output's metadata ``lab_render`` holds
    :func:`inputs_digest` and the files the render wrote under ``results_dir`` (see :func:`reusable_render`).
    ``label``: say on stdout, every minute, which cell has been running that long (a render's terminal).
    """
    import json

    import papermill as pm

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".running.ipynb")
    results = paths.resolve(parameters.get("results_dir", "results"))
    before, digest = _files(results), inputs_digest(notebook, parameters)
    # progress bars are for terminals: keep them out of the stored outputs of a rendered report
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        with _LongCellNotice(tmp, label) if label else contextlib.nullcontext():
            pm.execute_notebook(str(notebook), str(tmp), parameters=parameters, cwd=str(paths.REPO_ROOT),
                                log_output=log_output, progress_bar=False, execution_timeout=timeout_s,
                                kernel_name="python3",
                                # the kernel's own start-up notices (e.g. "running over TCP without encryption"
                                # on a local, loopback-only connection) are not the notebook's output
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except pm.PapermillExecutionError as exc:
        failed = output.with_suffix(".failed.ipynb")
        if tmp.exists():
            tmp.replace(failed)
        evalue = (exc.evalue or "").strip().splitlines()
        raise NotebookFailed(f"{notebook.name}: cell {exc.exec_count} raised {exc.ename}: "
                             f"{evalue[0] if evalue else ''} (partial output kept in {failed})") from None
    strip_progress_bars(tmp)
    after = _files(results)
    executed = json.loads(tmp.read_text())
    executed.setdefault("metadata", {})["lab_render"] = {
        "inputs": digest, "results": sorted(name for name, mtime in after.items() if before.get(name) != mtime)}
    tmp.write_text(json.dumps(executed, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(output)
    return output


# tqdm bars, and the lines of lab.bench.progress.progress_line
_BAR = re.compile("^" + re.escape(PROGRESS_PREFIX) + r"|\d+%\|.*\||\d+(?:\.\d+)?(?:it/s|s/it)\]")


def strip_progress_bars(executed: Path) -> int:
    """Remove progress-bar lines (tqdm writes them to stderr) and progress lines
    (:func:`lab.bench.progress.progress_line`) from an executed notebook's stored outputs: a report keeps
    results, not the terminal's animation. Returns the number of lines removed."""
    import json

    nb = json.loads(Path(executed).read_text())
    removed = 0
    for cell in nb.get("cells", []):
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = "".join(out.get("text", ""))
                lines = [ln for ln in re.split(r"(?<=[\r\n])", text) if ln]
                clean = [ln for ln in lines if not _BAR.search(ln)]
                removed += len(lines) - len(clean)
                if not "".join(clean).strip():
                    continue
                out["text"] = "".join(clean)
            kept.append(out)
        if "outputs" in cell:
            cell["outputs"] = kept
    Path(executed).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return removed


#: The HTML export's template: JupyterLab's, without the scripts it loads from a CDN (require.js, for widgets the
#: reports do not have, and MathJax: the formulas are MathML instead, which browsers draw themselves).
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
"""


def latex_to_mathml(latex: str, display: bool = False) -> str:
    """A TeX formula as MathML (``latex2mathml``); the TeX itself, escaped, where it cannot be converted."""
    import html

    from latex2mathml.converter import convert

    try:
        return convert(latex.strip(), display="block" if display else "inline")
    except Exception:  # noqa: BLE001 - a formula latex2mathml does not know stays readable as TeX
        return f"<code>{html.escape(latex)}</code>"


def _markdown_with_mathml(source: str) -> str:
    from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

    class MathMLRenderer(IPythonRenderer):
        def inline_math(self, body: str) -> str:
            return latex_to_mathml(body)

        def block_math(self, body: str) -> str:
            return latex_to_mathml(body, display=True)

        def latex_environment(self, name: str, body: str) -> str:
            return latex_to_mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)

    return MarkdownWithMath(renderer=MathMLRenderer(escape=False)).render(source)


def export_html(executed: Path) -> Path | None:
    """An HTML copy of an executed notebook beside it (None if nbconvert is not installed) that opens offline:
    no script from a CDN, the formulas of markdown and of ``text/latex`` outputs as MathML."""
    try:
        import jinja2
        import nbformat
        from nbconvert import HTMLExporter
    except ImportError:
        print(f"nbconvert is not installed: no HTML for {executed.name} (run `python -m lab.render --html-only`"
              " where it is)", file=sys.stderr)
        return None
    nb = nbformat.read(str(executed), as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/latex" in data and "text/html" not in data:
                latex = data["text/latex"].strip()
                display = latex.startswith("$$") or not latex.startswith("$")
                data["text/html"] = latex_to_mathml(latex.strip("$"), display=display)
    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2")
    exporter.register_filter("markdown2html", _markdown_with_mathml)
    body, _ = exporter.from_notebook_node(nb)
    html = executed.with_suffix(".html")
    html.write_text(body, encoding="utf-8")
    return html


def machine_made(report: Path) -> list[str]:
    """The phrases a person would not write (:func:`lab.book.claims.machine_phrases`) in an executed report's
    Markdown outputs: the prose and tables the book generated, which its claims should have put into words."""
    import json

    cells = json.loads(report.read_text()).get("cells", []) if report.exists() else []
    return [phrase for c in cells for o in c.get("outputs", [])
            for phrase in machine_phrases("".join((o.get("data") or {}).get("text/markdown", "")))]


def rendered_here(report: Path, params: dict) -> bool:
    """Whether ``report`` is this commit's render on this kind of machine (GPU model and count) with these
    parameters (``replay`` aside): what ``--resume`` keeps rather than renders again."""
    import json

    commit = store.git_commit()
    if not report.exists() or not store.clean_commit(commit):
        return False
    here = f"{machine.gpu_count()} x {machine.gpu_model()}" if machine.gpu_count() else "CPU only"
    ran = (json.loads(report.read_text()).get("metadata", {}).get("papermill") or {}).get("parameters") or {}
    mine = {k: v for k, v in json.loads(json.dumps(params)).items() if k != "replay"}
    found = summary(report)
    return (found["commit"] == commit and found["machine"] == here
            and {k: v for k, v in ran.items() if k != "replay"} == mine)


def render(profile: str = "quick", only: Sequence[str] | None = None, html: bool = True,
           log_output: bool = False, extra_parameters: dict | None = None, resume: bool = False) -> list[Path]:
    """Run the numbered notebooks for ``profile``; stops at the first failing notebook. Returns the reports.

    ``resume``: a notebook whose report this commit already rendered is kept; any other reads back the tables
    that this commit already measured for it on this machine's kind (:func:`lab.measure.results.measured_by`;
    its ``replay`` parameter), and measures the rest, a sweep from the row its stopped call reached
    (:meth:`lab.book.report.Chapter.rows`): a render stopped by a time limit continues where it stopped, every
    table still from one commit and one kind of machine, and the report names the tables and rows read back."""
    prof = PROFILES[profile]
    reports = paths.resolve(prof.reports_dir)
    params = {**prof.parameters(), **(extra_parameters or {})}
    books = numbered_notebooks(only)
    check_parameters(books, extra_parameters or {})
    # the kernels inherit this process's environment: without a GPU they run Triton interpreted, said once here
    if lab.use_triton_interpreter(announce=False):
        print(f"[render:{profile}] {lab.INTERPRETER_NOTICE.removeprefix('lab: ')}", flush=True)
    done = []
    for nb in books:
        start = time.perf_counter()
        own = dict(params)
        if resume and rendered_here(reports / nb.name, own):
            print(f"[render:{profile}] {nb.stem} was rendered by this commit on this kind of machine: kept", flush=True)
            done.append(reports / nb.name)
            continue
        print(f"[render:{profile}] {nb.name} ...", flush=True)
        if resume and "replay" in notebook_parameters(nb):
            done_before = store.measured_by(nb.stem, store.git_commit(), prof.results_dir)
            own["replay"] = done_before  # a list, even empty: the notebook also takes back its sweeps' logged rows
            if done_before:
                print(f"[render:{profile}] {nb.stem} reads back what this commit measured here: "
                      f"{', '.join(done_before)}", flush=True)
        out = run_notebook(nb, reports / nb.name, own, log_output=log_output, label=f"[render:{profile}] {nb.stem}")
        if html:
            export_html(out)
        print(f"[render:{profile}] {nb.name} done in {time.perf_counter() - start:.0f} s -> "
              f"{paths.repo_relative(out)}", flush=True)
        if phrases := machine_made(out):
            print(f"[render:{profile}] {nb.stem} reads {len(phrases)} machine-made phrases, such as "
                  f"{', '.join(repr(p) for p in dict.fromkeys(phrases))}"[:400], flush=True)
        done.append(out)
    return done


def render_main(argv: Sequence[str] | None = None) -> int:
    p = cli.Parser(prog="python -m lab.render", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", choices=list(PROFILES), default="quick",
                   help="quick: tiny sizes on the CPU into reports/quick; full: GPU sizes into reports/")
    p.add_argument("--only", nargs="+", help="notebook numbers or stems to run, e.g. 01 03")
    p.add_argument("--no-html", action="store_true", help="skip the HTML export")
    p.add_argument("--html-only", action="store_true",
                   help="only export HTML for the already executed notebooks of the profile")
    p.add_argument("--log-output", action="store_true", help="stream cell output to the terminal")
    p.add_argument("--resume", action="store_true",
                   help="read back the tables this commit already measured on this kind of machine (a render "
                        "stopped by a time limit continues) and measure the rest")
    p.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                   help="notebook parameter, e.g. -p sizes \"['small', 'medium']\" (a Python literal, or a word)")
    args = p.parse_args(argv)
    if args.html_only and args.no_html:
        raise UsageError("--html-only and --no-html contradict each other; give one")
    if args.html_only:
        reports = paths.resolve(PROFILES[args.profile].reports_dir)
        wanted = {p.stem for p in numbered_notebooks(args.only)}
        for nb in sorted(reports.glob("[0-9][0-9]_*.ipynb")):
            if ".failed" in nb.name or ".running" in nb.name or nb.stem not in wanted:
                continue
            print(f"html: {export_html(nb)}")
        return 0
    extra = {name: parse_value(name, value) for name, value in args.parameter}
    if args.resume and "replay" in extra:
        raise UsageError("--resume chooses the tables read back; drop -p replay, or drop --resume")
    check_parameters(numbered_notebooks(args.only), extra)
    cli.writable_dir(paths.resolve(PROFILES[args.profile].reports_dir), f"the {args.profile} reports directory")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        render(args.profile, args.only, html=not args.no_html, log_output=args.log_output, extra_parameters=extra,
               resume=args.resume)
    except NotebookFailed as exc:
        print(f"python -m lab.render: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(render_main, argv, prog="python -m lab.render")


if __name__ == "__main__":
    sys.exit(main())
