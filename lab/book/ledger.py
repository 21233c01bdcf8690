"""One ledger across the book: a measurement that two reports make must agree, or the render stops.

A chapter enters the rows that another chapter measures too (:meth:`lab.book.report.Chapter.ledger`), keyed
by *what* was measured: a kind of :data:`KINDS` and the fields that kind names, never a display label. Each
entry keeps the GPU model, the host's CPU model, whether the row was host-bound (its GPU idle for part of the
step, waiting for the host's launches), its median, spread and samples, its unit, and the report and commit
that measured it. Entries live in ``<results_dir>/ledger.csv``.

:func:`check` compares a report's entries with every other report's entries of the same key on the same GPU
model. Two entries disagree where

* their GPU times (how long the GPU ran kernels in the step, one profiled run each, where both rows have it;
  a data-parallel step's without the collectives' kernels, which wait for the peers' hosts) differ by more
  than :data:`RUN_TO_RUN` (clocks, memory placement, the library's choice of algorithm), or
* the rule finds their wall times apart (not within noise) by more than :data:`RUN_TO_RUN` plus the longer of
  the two rows' idle GPU time (wall less GPU time): the time the GPU waited for its host, which moves with the
  host's pace and load from one run to the next, on one machine too, while the GPU time does not.

A host-bound pair (either side) where either lacks a GPU time is therefore not compared. Entries measured on a
CPU are reported, not failed: the quick book runs on shared CPUs whose times say nothing about GPUs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from lab import paths
from lab.accounting.attention import PASSES
from lab.bench.attention_grid import SHAPE_2_7B, Shape
from lab.bench.distributed import TORCH_DDP_BUCKET_MB
from lab.book.claims import Measured, as_float, number
from lab.measure import verdicts as v

#: What each kind of shared measurement is keyed by.
KINDS: dict[str, tuple[str, ...]] = {
    # one mode of a language-model step on one process: forward, forward+backward or the full train step
    "lm_step": ("size", "context", "batch", "dtype", "attention", "compile", "fused_loss", "mode"),
    # a data-parallel training step, per rank
    "ddp_step": ("impl", "size", "context", "batch", "dtype", "world_size", "bucket_mb", "optimizer"),
    # one attention call, keyed by the forward and the backward kernel that ran (``kernel``, ``bwd_kernel``)
    "attention": ("impl", "kernel", "bwd_kernel", "dtype", "batch", "heads", "seq_len", "d", "causal", "pass",
                  "timing"),
    # the peak of GPU memory allocated in one mode of a step
    "peak_memory": ("size", "context", "batch", "dtype", "mode", "checkpoint"),
}
RUN_TO_RUN = 0.05
COLUMNS = ["kind", "key", "source", "commit", "gpu", "host_cpu", "host_bound", "unit", "median", "spread", "n",
           "samples", "gpu_ms", "label"]


class LedgerMismatch(ValueError):
    """Two reports measured the same thing on the same GPU model and disagree: the render stops."""


def key(kind: str, **what) -> str:
    """The canonical key of a measurement: its kind's fields, every one given, values as plain JSON
    (``512.0`` and ``512`` are one context; ``True`` and ``"True"`` one flag)."""
    if kind not in KINDS:
        raise ValueError(f"unknown ledger kind {kind!r}; choose from {', '.join(KINDS)}")
    fields = KINDS[kind]
    missing, extra = [f for f in fields if f not in what], sorted(set(what) - set(fields))
    if missing or extra:
        raise ValueError(f"ledger kind {kind!r} is keyed by {', '.join(fields)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; not a key field: {', '.join(extra)}" if extra else ""))
    return json.dumps({f: _plain(what[f]) for f in fields}, sort_keys=False)


def _plain(x):
    if isinstance(x, str) and x in ("True", "False"):
        return x == "True"
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and math.isfinite(x) and x.is_integer():
        return int(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def gpu_model(label) -> str:
    """A row's GPU model: its ``gpu`` without the count some older tables appended (``"... HBM3 x2"``)."""
    text = str(label)
    parts = text.rsplit(" x", 1)
    return parts[0] if len(parts) == 2 and parts[1].isdigit() else text


def entry(kind: str, summary: v.Summary, unit: str, label: str, host_bound: bool = False,
          gpu_ms: float = math.nan, **what) -> dict:
    """One ledger row (without its source, commit, GPU and host, which :func:`record` adds); ``gpu_ms``, the
    GPU time inside the measured wall time where it was profiled (NaN otherwise)."""
    return dict(kind=kind, key=key(kind, **what), host_bound=bool(host_bound), unit=unit, median=summary.median,
                spread=summary.spread, n=summary.n, samples=json.dumps([round(x, 5) for x in summary.samples]),
                gpu_ms=float(gpu_ms), label=label)


def _path(results_dir) -> Path:
    return paths.resolve(results_dir) / "ledger.csv"


def load(results_dir) -> pd.DataFrame:
    p = _path(results_dir)
    return pd.read_csv(p) if p.exists() else pd.DataFrame(columns=COLUMNS)


def record(entries: list[dict], results_dir, source: str, provenance: dict) -> pd.DataFrame:
    """Put ``source``'s entries into the ledger, replacing its earlier entries of the same kinds; returns the
    whole ledger."""
    new = pd.DataFrame([{**e, "source": source, "commit": provenance.get("commit"), "gpu": provenance.get("gpu"),
                         "host_cpu": provenance.get("host_cpu")} for e in entries], columns=COLUMNS)
    old = load(results_dir)
    kinds = set(new["kind"])
    kept = old[~((old["source"] == source) & old["kind"].isin(kinds))] if len(old) else old
    ledger = pd.concat([kept, new], ignore_index=True) if len(kept) else new
    paths.resolve(results_dir).mkdir(parents=True, exist_ok=True)
    ledger.to_csv(_path(results_dir), index=False)
    return ledger


def _summary(row) -> v.Summary:
    samples = tuple(json.loads(row["samples"])) if isinstance(row["samples"], str) and row["samples"] else ()
    return v.Summary(float(row["median"]), float(row["spread"]), int(row["n"]), samples)


def apart(a, b) -> str:
    """Why ledger rows ``a`` and ``b`` (same key, same GPU model) disagree: ``"GPU time"``, ``"wall time"``, or
    ``""`` where they agree (see the module docstring)."""
    sa, sb = _summary(a), _summary(b)
    if not (sa.median > 0 and sb.median > 0):
        return ""
    ga, gb = as_float(a.get("gpu_ms")), as_float(b.get("gpu_ms"))
    both_gpu = ga > 0 and gb > 0
    if both_gpu and abs(ga / gb - 1) > RUN_TO_RUN:
        return "GPU time"
    if not both_gpu and (_plain(a["host_bound"]) is True or _plain(b["host_bound"]) is True):
        return ""  # the host's pace set the time, on one machine too, and no GPU time says what the GPU did
    idle = max(sa.median - ga, sb.median - gb, 0.0) if both_gpu else 0.0
    if abs(sa.median - sb.median) <= RUN_TO_RUN * max(sa.median, sb.median) + idle:
        return ""
    return "" if v.compare(sa, sb).verdict == v.WITHIN_NOISE else "wall time"


def disagreements(ledger: pd.DataFrame, source: str) -> pd.DataFrame:
    """``source``'s entries that another report measured on the same GPU model and that disagree with it
    (:func:`apart`): one row per pair, with both sides' labels, sources, commits, medians and GPU times, their
    ratio and which time disagrees."""
    if ledger.empty:
        return pd.DataFrame()
    ledger = ledger.assign(model=ledger["gpu"].map(gpu_model))
    if "gpu_ms" not in ledger:
        ledger = ledger.assign(gpu_ms=math.nan)
    own, others = ledger[ledger["source"] == source], ledger[ledger["source"] != source]
    rows = []
    for _, a in own.iterrows():
        same = others[(others["key"] == a["key"]) & (others["model"] == a["model"])]
        for _, b in same.iterrows():
            what = apart(a, b)
            if not what:
                continue
            gpu = what == "GPU time"
            ma, mb = (as_float(a["gpu_ms"]), as_float(b["gpu_ms"])) if gpu else (float(a["median"]), float(b["median"]))
            rows.append(dict(kind=a["kind"], key=a["key"], gpu=a["model"], what=what, label_a=a["label"],
                             source_a=a["source"], commit_a=a["commit"], median_a=ma, label_b=b["label"],
                             source_b=b["source"], commit_b=b["commit"], median_b=mb, unit=a["unit"],
                             ratio=ma / mb if mb else math.nan))
    return pd.DataFrame(rows)


def check(results_dir, source: str) -> list[str]:
    """Stop the render (:class:`LedgerMismatch`, naming both rows of each pair) where ``source`` disagrees with
    another report on a GPU; return the disagreements measured on a CPU, one line each."""
    d = disagreements(load(results_dir), source)
    if d.empty:
        return []
    lines = [f"{r['label_a']} in {r['source_a']} ({r['what']} {number(r['median_a'], r['unit'])}) against "
             f"{r['label_b']} in {r['source_b']} ({number(r['median_b'], r['unit'])}, commit "
             f"{str(r['commit_b'])[:12]}): ratio {number(r['ratio'])} on {r['gpu']}" for _, r in d.iterrows()]
    on_gpu = [line for line, (_, r) in zip(lines, d.iterrows()) if r["gpu"] != "cpu"]
    if on_gpu:
        raise LedgerMismatch("the same measurement disagrees between reports: " + "; ".join(on_gpu))
    return lines


def ddp_step_entries(rows, impl: str, label, optimizer: str) -> list[dict]:
    """The torch DDP rows (``impl``, built by :func:`lab.parallel.ddp.torch_ddp`) of a table that 07 and 08 both
    measure as ``ddp_step`` entries, host-bound and GPU time by the profiled step's kernels without collectives;
    ``label(row)`` names a row, ``optimizer`` the optimizer every row stepped (part of what was measured)."""
    return [entry("ddp_step", (m := Measured.from_row(label(r), r, "step_ms")).summary, "ms", m.label, m.host_bound,
                  m.gpu_ms, impl="torch_ddp", size=r["size"], context=r["context"],
                  batch=r["batch"], dtype=r["dtype"], world_size=r["world_size"], bucket_mb=TORCH_DDP_BUCKET_MB,
                  optimizer=optimizer)
            for _, r in rows.iterrows() if r["status"] == "ok" and r["impl"] == impl]


LM_MODES = {"fwd": "forward", "fwdbwd": "forward+backward", "step": "train step"}


def lm_step_entries(table: pd.DataFrame) -> list[dict]:
    """The ledger entries of ``lm_step`` rows (:func:`lab.bench.lm.benchmark_lm`): one per row and timed mode,
    from its samples where the row keeps them, else from its median, spread and count."""
    out = []
    for _, r in table.iterrows():
        if r.get("status", "ok") != "ok":
            continue
        for col, mode in LM_MODES.items():
            if not math.isfinite(as_float(r.get(f"{col}_ms"))):
                continue
            label = (f"{r['size']} at context {int(r['context'])}, {r['dtype']}, {r['attention']}"
                     f"{', compiled' if _plain(r['compile']) else ''}, {mode}")
            m = Measured.from_row(label, r, f"{col}_ms")  # host-bound by this mode's own GPU share where profiled
            out.append(entry("lm_step", m.summary, "ms", label, m.host_bound, gpu_ms=m.gpu_ms, size=r["size"],
                             context=r["context"],
                             batch=r["batch"], dtype=r["dtype"], attention=r["attention"], compile=r["compile"],
                             fused_loss=r.get("fused_loss", False), mode=col))
    return out


def attention_entries(bench: pd.DataFrame, shape: Shape = SHAPE_2_7B) -> list[dict]:
    """Every implementation's passes at ``shape`` (default: the 2.7B model's attention calls, which 05 and 10
    both time) of an attention table (:func:`lab.bench.attention_grid.time_attention_grid`) as ``attention``
    entries; a pass derived from two others (a replay's backward), with no samples, is left out."""
    rows = bench[(bench["status"] == "ok") & (bench["batch"] == shape.batch) & (bench["heads"] == shape.heads)
                 & (bench["seq_len"] == shape.seq) & (bench["d"] == shape.d) & (bench["causal"] == shape.causal)]
    out = []
    for _, r in rows.iterrows():
        for p in [p for p in PASSES if as_float(r.get(f"{p}_n")) > 0]:
            summary = v.Summary(float(r[f"{p}_ms"]), float(r.get(f"{p}_spread_ms", math.nan)), int(r[f"{p}_n"]))
            out.append(entry("attention", summary, "ms", f"{r['impl']} on {shape.label} {r['dtype']}, {p}",
                             host_bound=r.get("timing") == "eager", impl=r["impl"],
                             kernel=r["kernel"] if isinstance(r.get("kernel"), str) else "",
                             bwd_kernel=r["bwd_kernel"] if isinstance(r.get("bwd_kernel"), str) else "",
                             dtype=r["dtype"], batch=r["batch"], heads=r["heads"], seq_len=r["seq_len"], d=r["d"],
                             causal=r["causal"], timing=r.get("timing", "eager"), **{"pass": p}))
    return out
