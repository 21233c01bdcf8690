"""What a notebook shows besides plots: the provenance banner, the answers at the top, tables that are
measured (or replayed from ``results/``) with their provenance, and prose generated from data.

A notebook makes one :class:`Chapter` after its parameters cell::

    book = report.Chapter("01_profiling", params, results_dir, replay=replay)
    book.show_machine()                       # the banner, the rule, whether the render ran alone
    book.show_answers()                       # filled in as the notebook runs
    lm = book.table("lm_step", lambda: bench.sweep_lm(...))
    book.answer(profiling.step_claim(lm), section="End-to-end timing")   # a lab.book.claims.Claim
    book.ledger(ledger.lm_step_entries(lm), table="lm_step")            # rows other reports measure too

``table`` measures and saves (rows tagged with the notebook as their source), or, with ``replay=True``,
reads this notebook's rows back from ``results/`` and says which machine and commit measured them, so a
report can be re-rendered anywhere without re-measuring.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from lab import paths
from lab.book import claims as cl
from lab.book import ledger as book_ledger
from lab.measure import machine
from lab.measure import results as store
from lab.measure.verdicts import RULE


def _display_markdown(text: str, display_id: str | None = None, update: bool = False) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display, update_display

        if get_ipython() is None:  # plain Python (a script, a test): print the text itself
            raise ImportError
        if update:
            update_display(Markdown(text), display_id=display_id)
        else:
            display(Markdown(text), display_id=display_id)
    except ImportError:
        if not update:
            print(text)


def _machine(p: dict) -> str:
    return (f"**{p['gpu_count']} x {p['gpu_name']}** (driver {p['driver']}, CUDA {p['cuda']}), host CPU {p['host_cpu']}"
            if p.get("gpu_count") else f"**CPU only** ({p.get('host_cpu')})")


def machine_banner(params: dict[str, Any] | None = None, measured: list[dict] | None = None) -> str:
    """A Markdown paragraph naming the machine (GPUs and the host's CPU, which paces an eager step's launches),
    versions, commit and date; shown at the top of each report. ``measured``: for a render that reads every
    table back, the provenance of each run that measured them, which the banner names first (with the parameters
    they were measured with), so that a replay on a laptop is not taken for a measurement on it."""
    p = store.provenance(params)
    knobs = lambda ps: ", ".join(f"`{k}={v!r}`" for k, v in ps.items() if k != "neighbours")  # said beside it
    here = (f"Rendered on {_machine(p)}; torch {p['torch']}, triton {p['triton']}, Python {p['python']}; "
            f"commit `{p['commit']}`; {p['date']}")
    if not measured:
        return f"> {here}.\n>\n> Parameters: {knobs(params or {}) or 'defaults'}"
    runs = "; and on ".join(f"{_machine(m)}, torch {m.get('torch')}, commit `{m.get('commit')}`; {m.get('date')}"
                            for m in measured)
    return (f"> Measured on {runs}; its tables read back here. {here}.\n>\n> Parameters, as measured: "
            f"{knobs(measured[0].get('params') or {}) or 'defaults'}")


def say(text: str) -> None:
    """Display Markdown the book writes itself (a heading, a provenance line); a finding goes through claims."""
    _display_markdown(text)


def warn(text: str) -> None:
    """Display a visible warning box in the report."""
    _display_markdown(f"> ⚠️ **Warning.** {text}")


def table_text(df: pd.DataFrame, floatfmt: str = ".3g") -> str:
    """``df`` as a Markdown table. With a ``".Ng"`` format its float cells read as :func:`lab.book.claims.number`
    writes them in prose (``12,510``, not ``1.251e+04``; ``n/a`` for NaN), right-aligned like numbers; a missing
    label (a column of text where a row has none, such as a baseline's kernel) is an empty cell, not ``nan``."""
    digits = re.fullmatch(r"\.(\d+)g", floatfmt)
    if digits is None:
        return df.to_markdown(index=False, floatfmt=floatfmt)
    floats = [c for c in df.columns if pd.api.types.is_float_dtype(df[c])]
    cells = df.astype(object)
    for c in df.columns:
        cells[c] = ([cl.number(v, digits=int(digits.group(1))) for v in df[c]] if c in floats
                    else ["" if _missing(v) else v for v in df[c]])
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    return cells.to_markdown(index=False, disable_numparse=True, colalign=["right" if n else "left" for n in numeric])


def _missing(v) -> bool:
    """A missing cell of a text column: None, NaN, pandas' NA or NaT."""
    return v is None or (not isinstance(v, (str, list, tuple, dict)) and bool(pd.isna(v)))


# the columns every saved row carries: who measured it, where, at which commit (lab.measure.results)
PROVENANCE = ("gpu", "gpu_count", "host_cpu", "torch", "commit", "source")


def show_table(df: pd.DataFrame, floatfmt: str = ".3g", max_rows: int = 60) -> None:
    """Show a DataFrame as a Markdown table (readable in the HTML report and in plain text; :func:`table_text`).
    A provenance column with one value for every row is left out: the table's caption and the report's banner
    say it once; one that varies (rows carried from another machine) stays."""
    if df.empty:
        _display_markdown("*(no rows)*")
        return
    df = df.drop(columns=[c for c in PROVENANCE if c in df.columns and df[c].nunique(dropna=False) <= 1])
    if len(df) > max_rows:
        df = df.head(max_rows)
    _display_markdown(table_text(df, floatfmt))


def shown(df: pd.DataFrame, head: int | None = None) -> pd.DataFrame:
    """A result table for display: without the provenance columns every saved row carries (:data:`PROVENANCE`;
    ``status`` and ``error`` when every row is ``ok``), first ``head`` rows."""
    drop = [c for c in PROVENANCE if c in df.columns]
    if "status" in df.columns and (df["status"] == "ok").all():
        drop += [c for c in ("status", "error") if c in df.columns]
    out = df.drop(columns=drop)
    return out.head(head) if head else out


def anchor(section: str) -> str:
    """The HTML anchor nbconvert gives a Markdown heading (``"## Warm-up: why"`` -> ``#Warm-up:-why``)."""
    return "#" + re.sub(r"\s+", "-", section.strip().lstrip("#").strip())


def _lines(metas: dict | list[dict]) -> str:
    """Provenance lines of one run or several, joined."""
    return " and ".join(store.provenance_line(m) for m in (metas if isinstance(metas, list) else [metas]))


def _carried_provenance(rows: pd.DataFrame, earlier: dict) -> list[dict]:
    """The provenance of the runs that measured ``rows``, one per commit among them: the last render's own, or
    that of a run whose rows it had carried in turn (``params["carried"]``); the last render's where no
    record matches."""
    before = ((earlier.get("params") or {}).get("carried") or {}).get("measured_on") or []
    known = [earlier, *(before if isinstance(before, list) else [before])]
    commits = list(dict.fromkeys(rows["commit"].dropna().astype(str))) if "commit" in rows else []
    found = [next((m for m in known if str(m.get("commit")) == c), earlier) for c in commits] or [earlier]
    return list({id(m): m for m in found}.values())


class Chapter:
    """One notebook's view of the book: its name (the ``source`` of the rows it saves), parameters, results
    folder, replay switch, and the answers shown at its top."""

    def __init__(self, notebook: str, params: dict[str, Any], results_dir: str = "results",
                 replay: bool | Sequence[str] = False):
        """``replay``: True reads every table back from ``results_dir``; a list of table names reads only those
        back (the others are measured), e.g. to re-measure one table without repeating an expensive other."""
        if isinstance(replay, str) or not isinstance(replay, (bool, Sequence)):
            raise ValueError(f"replay must be True, False or a list of table names, got {replay!r}")
        self.notebook, self.params, self.results_dir = notebook, dict(params), results_dir
        self.replay = replay if isinstance(replay, bool) else list(replay)
        # a list, even empty, is what a resumed render passes (lab.render --resume): rows that its earlier call
        # logged before a time limit stopped it are taken back (:meth:`rows`)
        self.resuming = isinstance(replay, (list, tuple))
        self._logs: dict[str, store.RowLog] = {}
        self.answers: list[tuple[str, str, str | None]] = []
        self._answers_id = f"answers-{notebook}"
        # what else ran when the render started; a render that only reads tables back times nothing
        self.neighbours = None if self.replay is True else machine.neighbours()
        self.params["neighbours"] = self.neighbours

    # ---- the top of the report -------------------------------------------------------------------------

    def show_machine(self) -> None:
        """The banner, the rule every verdict of the report follows, and whether the render had its GPUs and
        host to itself; when replaying, it also says that the tables were measured elsewhere (see each table)."""
        runs = {(m.get("commit"), m.get("gpu_name"), m.get("gpu_count")): m
                for m in store.tables_of(self.notebook, self.results_dir).values()} if self.replay is True else {}
        say(machine_banner({**self.params, "replay": self.replay}, list(runs.values())))
        say(f"> **The rule.** {RULE}")
        # a replay times nothing: whether its tables' runs had their machines to themselves is what counts
        said = [(m.get("params") or {}).get("neighbours") for m in runs.values()]
        neighbours = self.neighbours if not runs else None if None in said else [n for ns in said for n in ns]
        when = "its tables were measured" if runs else "this render started"
        if neighbours is not None:
            say(f"> **Alone:** nothing else ran on the GPUs or host when {when}." if not neighbours
                else f"> **Not alone:** when {when}, " + "; ".join(neighbours) + " ran beside it, "
                "so its timings may have been moved by them.")
        if self.replay is True:
            say("> **Replayed:** the tables below were read from `results/`, not measured in this render; each "
                "one names the machine and commit that measured it.")
        elif self.replay:
            say(f"> **Partly replayed:** {', '.join(f'`{n}`' for n in self.replay)} read from `results/`, not "
                "measured in this render (each names the machine and commit that measured it); the other tables "
                "were measured here.")

    def replays(self, name: str) -> bool:
        """Whether table ``name`` is read back rather than measured."""
        return self.replay is True or (self.replay is not False and name in self.replay)

    def show_answers(self) -> None:
        """Display the answers box (empty now, completed by :meth:`answer` as the notebook runs)."""
        _display_markdown(self._answers_markdown(), display_id=self._answers_id)

    def answer(self, claim: cl.Claim, section: str | None = None) -> None:
        """Add one answer to the box at the top, linked to ``section``'s heading: a claim's question and its
        sentence (:func:`lab.book.claims.sentence`)."""
        self.answers.append((claim.question, cl.sentence(claim, with_question=False), section))
        _display_markdown(self._answers_markdown(), display_id=self._answers_id, update=True)

    def state(self, *items: cl.Claim | cl.Finding) -> None:
        """Show claims (question and findings) or bare findings where the notebook stands, one paragraph."""
        parts = [cl.sentence(x) if isinstance(x, cl.Claim) else cl.say(x) + "." for x in items]
        say(" ".join(p[0].upper() + p[1:] if p and not p.startswith("*") else p for p in parts))

    def ledger(self, entries: list[dict], *, table: str) -> None:
        """Enter rows that other reports measure too (:func:`lab.book.ledger.entry`) and check them against the
        other reports' entries: a disagreement on a GPU stops the render naming both rows
        (:class:`lab.book.ledger.LedgerMismatch`); on a CPU it is shown as a warning. ``table``: the saved table
        the rows come from, whose provenance the entries take (the machine and commit that measured them, also
        when this render read them back: a replay on a laptop does not enter a GPU's rows as the laptop's)."""
        if not entries:
            return
        book_ledger.record(entries, self.results_dir, self.notebook, self.provenance(table))
        for line in book_ledger.check(self.results_dir, self.notebook):
            warn(f"Measured on a CPU, two reports disagree: {line}.")

    def _answers_markdown(self) -> str:
        if not self.answers:
            return "**Answers** (filled in from this render's tables as the notebook runs.)"
        lines = ["**Answers**", ""]
        for q, a, section in self.answers:
            link = f" ([→]({anchor(section)}))" if section else ""
            lines.append(f"- *{q}* {a}{link}")
        return "\n".join(lines)

    # ---- tables ----------------------------------------------------------------------------------------

    def table(self, name: str, measure: Callable[[], pd.DataFrame], save: Callable[[pd.DataFrame], pd.DataFrame]
              | None = None, carry: Callable[[pd.DataFrame], pd.DataFrame] | None = None) -> pd.DataFrame:
        """Measure a table and save it (rows tagged with this notebook as their source; ``save`` may pick
        the columns written), or, when replaying, read this notebook's rows of ``name`` back and show who
        measured them. Returns the table (with every column, when measured).

        ``carry``: picks rows of this notebook's saved table to keep beside the new measurement, read back
        and not measured again (for a machine too small to measure every part in one run): they keep their
        own ``gpu``, ``torch`` and ``commit``, the render says so, and the saved provenance records theirs
        under ``params["carried"]``."""
        if self.replays(name):
            df = store.load_results(name, self.results_dir, source=self.notebook)
            meta = self.provenance(name)
            carried = (meta.get("params") or {}).get("carried")
            if carried:
                say(f"*`{name}`: measured on {store.provenance_line(meta)}; {carried['rows']} of its rows carried from "
                    f"{_lines(carried['measured_on'])}.*")
            else:
                say(f"*`{name}`: measured on {store.provenance_line(meta)}.*")
            return df
        carried, params = None, self.params
        if carry is not None:
            carried = carry(store.load_results(name, self.results_dir, source=self.notebook))
            earlier = _carried_provenance(carried, self.provenance(name))
            params = {**self.params, "carried": {"rows": int(len(carried)), "measured_on": earlier}}
        df = measure()
        log = self._logs.pop(name, None)
        if log is not None and log.reused:
            say(f"*`{name}`: {log.reused} of its rows were measured by this render's earlier call (this commit, this "
                "kind of machine), which a time limit stopped; the rest in this call.*")
        saved = save(df) if save else df
        if carried is not None and len(carried):
            say(f"*`{name}`: {len(carried)} of its rows are read back, not measured in this render: measured on "
                f"{_lines(earlier)}.*")
            saved, df = pd.concat([carried, saved], ignore_index=True), pd.concat([carried, df], ignore_index=True)
        store.save_results(saved, name, self.results_dir, params, source=self.notebook)
        if log is not None:
            log.close()
        return df

    def rows(self, name: str) -> store.RowLog:
        """The row log of table ``name``'s sweep (:class:`lab.measure.results.RowLog`, under
        ``<results_dir>/partial/``): rows are logged as they are measured, and a resumed render takes back those
        its earlier call measured (said beside the table). Removed once the table is saved."""
        path = paths.resolve(self.results_dir) / "partial" / self.notebook / f"{name}.jsonl"
        self._logs[name] = store.RowLog(path, reuse=self.resuming)
        return self._logs[name]

    def provenance(self, name: str, source: str | None = None) -> dict:
        """Provenance of ``name``'s rows from ``source`` (default: this notebook)."""
        return store.load_provenance(name, self.results_dir, source or self.notebook)

    def other(self, name: str, source: str | None = None) -> pd.DataFrame:
        """Another notebook's current results (``source`` its name; None for a table with one producer), with a
        line saying which machine and commit measured them."""
        df = store.load_results(name, self.results_dir, source=source)
        meta = store.load_provenance(name, self.results_dir, source)
        say(f"*`{name}`{f' (from {source})' if source else ''}: measured on {store.provenance_line(meta)}.*")
        return df


def with_profile_defaults(knobs: dict, defaults: dict) -> dict:
    """``knobs`` with every None replaced by ``defaults``' value (a parameters cell leaves a knob None to
    mean "this profile's default"); lists become tuples so that the result can live in a frozen dataclass."""
    out = {}
    for name, value in knobs.items():
        value = defaults.get(name) if value is None else value
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def settings_params(settings) -> dict:
    """A settings dataclass as the notebook's parameters (for the banner and the results' sidecars): its
    fields, tuples as lists."""
    from dataclasses import asdict

    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}
