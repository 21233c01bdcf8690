"""Build a notebook (without outputs) from a percent-format script.

Cells are separated by lines starting with ``# %%``; ``# %% [markdown]`` starts a Markdown cell whose
lines are ``# ``-commented; ``# %% tags=["parameters"]`` tags a code cell. Usage::

    python tools/py_to_ipynb.py notebooks_src/01_profiling.py notebooks/01_profiling.ipynb
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def convert(text: str) -> dict:
    cells = []
    kind, tags, lines = None, [], []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", ln) for ln in body.splitlines())
        if not body.strip():
            return
        src = [ln + "\n" for ln in body.splitlines()]
        src[-1] = src[-1].rstrip("\n")
        cell = {"cell_type": kind, "metadata": {"tags": tags} if tags else {}, "source": src}
        if kind == "code":
            cell["execution_count"] = None
            cell["outputs"] = []
        cells.append(cell)

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            rest = line[4:].strip()
            kind = "markdown" if rest.startswith("[markdown]") else "code"
            m = re.search(r"tags=\[(.*?)\]", rest)
            tags = [t.strip().strip("'\"") for t in m.group(1).split(",")] if m else []
            lines = []
        else:
            if kind is None:
                kind = "code"
            lines.append(line)
    flush()
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    nb = convert(src.read_text())
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"{dst.stem[:2]}-{i:03d}"
    dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {dst} ({len(nb['cells'])} cells)")


if __name__ == "__main__":
    main()
