"""What a notebook shows besides plots: the provenance banner and prose generated from data."""

from __future__ import annotations

from typing import Any

import pandas as pd

from lab.measure.results import provenance


def _display_markdown(text: str) -> None:
    try:
        from IPython.display import Markdown, display

        display(Markdown(text))
    except ImportError:  # plain Python: print instead
        print(text)


def machine_banner(params: dict[str, Any] | None = None) -> str:
    """A Markdown paragraph naming the machine, versions, commit and date; shown at the top of each report."""
    p = provenance(params)
    gpu = f"**{p['gpu_count']} x {p['gpu_name']}** (driver {p['driver']}, CUDA {p['cuda']})" if p["gpu_count"] \
        else f"**CPU only** ({p['host_cpu']})"
    knobs = ", ".join(f"`{k}={v!r}`" for k, v in (params or {}).items())
    return (f"> Rendered on {gpu}; torch {p['torch']}, triton {p['triton']}, Python {p['python']}; "
            f"commit `{p['commit']}`; {p['date']}.\n>\n> Parameters: {knobs or 'defaults'}")


def show_machine(params: dict[str, Any] | None = None) -> None:
    """Display :func:`machine_banner` (call it in a notebook's first cell after the parameters)."""
    _display_markdown(machine_banner(params))


def say(text: str) -> None:
    """Display a sentence of conclusions; build ``text`` with f-strings from the result tables."""
    _display_markdown(text)


def show_table(df: pd.DataFrame, floatfmt: str = ".3g", max_rows: int = 60) -> None:
    """Show a DataFrame as a Markdown table (readable in the HTML report and in plain text)."""
    if len(df) > max_rows:
        df = df.head(max_rows)
    _display_markdown(df.to_markdown(index=False, floatfmt=floatfmt))
