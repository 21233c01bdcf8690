"""One plotting style for the whole book."""

from __future__ import annotations

import matplotlib.pyplot as plt
import seaborn as sns

from lab import paths


def set_style() -> None:
    """Seaborn's whitegrid theme with figure sizes that read well in a rendered notebook."""
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    plt.rcParams.update({"figure.figsize": (8, 4.5), "figure.dpi": 100, "savefig.bbox": "tight",
                         "axes.titleweight": "bold"})


def save_figure(fig, name: str, results_dir: str = "results") -> str:
    """Save ``fig`` as ``<results_dir>/figures/<name>.png`` (small, committed with the results)."""
    out = paths.results_dir(results_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    return str(path)
