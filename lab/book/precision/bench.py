"""Mixed precision, seen from the numbers: accumulation error, what autocast does to each tensor, and why
normalisation statistics are kept in fp32.

Three experiments, each returning a DataFrame for the 02 notebook:

* :func:`accumulation_experiment` sums 0.01 a thousand times with different accumulator and addend dtypes;
* :func:`probe_autocast_dtypes` runs a toy model under autocast and *observes* (with forward hooks and
  tensor hooks) the dtype of every interesting tensor, rather than asserting what it should be;
* :func:`norm_statistics_demo` computes RMSNorm / LayerNorm statistics of large activations with every
  intermediate rounded to fp16 or bf16 and compares them with fp64.

:func:`speedup_table` compares fp32 with bf16 autocast timings of ``lab.bench.lm.sweep_lm`` sample by sample,
with the noise-aware verdicts of :mod:`lab.measure.verdicts`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from lab.dtypes import dtype_name, torch_dtype
from lab.measure.device import resolve_device
from lab.measure.verdicts import compare

# ----------------------------------------------------------------------------------------------------------
# 1. Accumulation


# (accumulator, addend, explicit upcast of the addend before adding)
ACCUMULATION_VARIANTS: tuple[tuple[str, str, bool], ...] = (
    ("fp32", "fp32", False),
    ("fp16", "fp16", False),
    ("fp32", "fp16", False),
    ("fp32", "fp16", True),
    ("bf16", "bf16", False),
    ("fp32", "bf16", False),
    ("fp32", "bf16", True),
)


def accumulate(value: float = 0.01, count: int = 1000, accumulator: str = "fp32", addend: str = "fp32",
               upcast: bool = False) -> float:
    """Sum ``value`` ``count`` times into a scalar accumulator of dtype ``accumulator``.

    The addend is stored in dtype ``addend``; with ``upcast`` it is converted to the accumulator's dtype
    explicitly before each addition (otherwise PyTorch's in-place ``+=`` keeps the accumulator's dtype and
    promotes implicitly). Every partial sum is rounded to the accumulator dtype, as in a real loop.
    Returns the final sum as a Python float.
    """
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    acc = torch.tensor(0.0, dtype=torch_dtype(accumulator))
    x = torch.tensor(value, dtype=torch_dtype(addend))
    if upcast:
        x = x.to(acc.dtype)
    for _ in range(count):
        acc += x
    return float(acc)


def accumulation_experiment(value: float = 0.01, count: int = 1000,
                            variants: Iterable[tuple[str, str, bool]] = ACCUMULATION_VARIANTS) -> pd.DataFrame:
    """The classic mixed-precision accumulation experiment, one row per (accumulator, addend, upcast) variant.

    Columns: ``accumulator``, ``addend``, ``upcast``, ``addend_value`` (0.01 as the addend dtype stores it),
    ``result``, ``exact`` (value * count in float64), ``abs_error``, ``rel_error``, and
    ``representation_error`` (the part of the error explained by the addend's rounding alone:
    count * (addend_value - value)); the rest is rounding of the partial sums.
    """
    exact = value * count
    rows = []
    for accumulator, addend, upcast in variants:
        stored = float(torch.tensor(value, dtype=torch_dtype(addend)))
        result = accumulate(value, count, accumulator, addend, upcast)
        rows.append(dict(accumulator=accumulator, addend=addend, upcast=upcast, addend_value=stored,
                         result=result, exact=exact, abs_error=abs(result - exact),
                         rel_error=abs(result - exact) / abs(exact) if exact else math.nan,
                         representation_error=count * (stored - value)))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# 2. What autocast does to each tensor


class ToyModel(nn.Module):
    """Linear -> ReLU -> LayerNorm -> Linear, the model of the classic autocast exercise."""

    def __init__(self, in_features: int = 10, out_features: int = 5, hidden: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def probe_autocast_dtypes(model: nn.Module | None = None, dtype: str = "bf16", device: str | torch.device = "cpu",
                          batch: int = 4, seed: int = 0) -> pd.DataFrame:
    """Run ``model`` (default :class:`ToyModel`) forward and backward under autocast to ``dtype`` and record
    the dtype of every tensor of interest as it is actually produced.

    Nothing is asserted: forward hooks on each child module record their output dtypes, a tensor hook on
    the logits records the dtype of the gradient flowing into them, and parameter ``.grad`` dtypes are read
    after backward. ``dtype`` ``"fp32"`` runs without autocast (the reference). Returns a DataFrame with
    columns ``tensor`` (e.g. ``fc1 output``, ``loss``, ``grad fc1.weight``), ``kind`` (parameter,
    activation, loss, gradient), ``dtype``, ``shape`` and ``autocast`` (the requested dtype).
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    model = (model or ToyModel()).to(device)
    in_features = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    x = torch.randn(batch, in_features, device=device)
    rows: list[dict] = []

    def record(name: str, kind: str, t: torch.Tensor) -> None:
        rows.append(dict(tensor=name, kind=kind, dtype=dtype_name(t.dtype), shape=tuple(t.shape), autocast=dtype))

    for name, p in model.named_parameters():
        record(f"param {name}", "parameter", p)

    handles = []
    for name, child in model.named_children():
        handles.append(child.register_forward_hook(
            lambda mod, inp, out, name=name: record(f"{name} output", "activation", out)))
    try:
        ctx = (torch.autocast(device_type=device.type, dtype=torch_dtype(dtype)) if dtype != "fp32"
               else torch.autocast(device_type=device.type, enabled=False))
        with ctx:
            logits = model(x)
            target = torch.randint(0, logits.shape[-1], (batch,), device=device,
                                   generator=torch.Generator(device=device).manual_seed(seed))
            loss = F.cross_entropy(logits, target)
        record("logits", "activation", logits)
        record("loss", "loss", loss)
        logits.register_hook(lambda g: record("grad logits", "gradient", g))
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    for name, p in model.named_parameters():
        if p.grad is not None:
            record(f"grad {name}", "gradient", p.grad)
    return pd.DataFrame(rows)


def autocast_dtype_table(dtypes: Sequence[str] = ("fp32", "fp16", "bf16"),
                         device: str | torch.device = "cpu") -> pd.DataFrame:
    """:func:`probe_autocast_dtypes` for each autocast dtype side by side: one row per tensor, one column
    per autocast dtype holding the observed dtype."""
    frames = [probe_autocast_dtypes(dtype=d, device=device) for d in dtypes]
    long = pd.concat(frames, ignore_index=True)
    order = list(dict.fromkeys(frames[0]["tensor"]))
    wide = long.pivot(index="tensor", columns="autocast", values="dtype").reindex(order)[list(dtypes)]
    wide.columns = [f"autocast {d}" if d != "fp32" else "no autocast" for d in dtypes]
    kinds = frames[0].set_index("tensor")["kind"]
    return wide.assign(kind=kinds.reindex(order).values).reset_index()


def autocast_dtype_tables(device: str | torch.device = "auto",
                          dtypes: Sequence[str] = ("fp32", "fp16", "bf16")) -> pd.DataFrame:
    """:func:`autocast_dtype_table` on ``device`` and, when that is a GPU, on the CPU as well (the two
    autocast op lists differ): the wide tables stacked, with a ``device`` column (``cuda`` / ``cpu``)."""
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    devices = [dev] + ([torch.device("cpu")] if dev.type == "cuda" else [])
    return pd.concat([autocast_dtype_table(dtypes, d).assign(device=d.type) for d in devices], ignore_index=True)


# ----------------------------------------------------------------------------------------------------------
# 3. Why normalisation statistics stay in fp32


def norm_statistics(x: torch.Tensor, dtype: str) -> dict[str, float]:
    """RMSNorm and LayerNorm statistics of ``x`` computed *naively* in ``dtype``.

    Every elementwise result (the squares, E[x]^2, the difference) is rounded to ``dtype``; the reductions
    return a ``dtype`` value (PyTorch accumulates half-precision sums in fp32 internally, so the error shown
    comes from the range and resolution of the format itself, not from a poor summation order).
    Returns ``mean_square`` (RMSNorm's statistic), ``variance`` (LayerNorm's, as E[x^2] - E[x]^2) and
    ``rms_output_max_error`` (max |RMSNorm(x) computed this way - RMSNorm(x) in fp64|), all as floats.
    """
    dt = torch_dtype(dtype)
    x64 = x.double()
    xl = x.to(dt)
    mean_square = (xl * xl).mean(-1, keepdim=True)
    mean = xl.mean(-1, keepdim=True)
    variance = mean_square - mean * mean
    rms_out = xl * torch.rsqrt(mean_square + torch.tensor(1e-5, dtype=dt))
    ref = x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5)
    return dict(mean_square=float(mean_square.double().mean()), variance=float(variance.double().mean()),
                rms_output_max_error=float((rms_out.double() - ref).abs().max()))


def norm_statistics_demo(d_model: int = 1024, scales: Sequence[float] = (1.0, 300.0), offset: float = 100.0,
                         dtypes: Sequence[str] = ("fp32", "fp16", "bf16"), seed: int = 0) -> pd.DataFrame:
    """Normalisation statistics of synthetic activations in each dtype, against fp64.

    Two kinds of input, one row per (input, dtype):

    * ``scale=s``: N(0, s^2) activations of width ``d_model``. At s=300 the squares (~9e4) exceed fp16's
      largest finite value (65504), so the fp16 mean of squares is ``inf`` and RMSNorm outputs zeros; bf16
      has fp32's exponent range and survives.
    * ``offset=m``: N(m, 1) activations (a large mean, as in an un-normalised residual stream). LayerNorm's
      variance E[x^2] - E[x]^2 subtracts two numbers near m^2; bf16 has 8 significant bits, so their
      difference (the true variance, ~1) is lost in rounding (catastrophic cancellation).

    Columns: ``input``, ``dtype``, ``statistic``, ``value``, ``reference`` (fp64), ``rel_error``, plus a
    ``finite`` flag. Returns a long DataFrame.
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = {f"N(0, {s:g}^2)": torch.randn(16, d_model, generator=gen, dtype=torch.float64) * s for s in scales}
    inputs[f"N({offset:g}, 1)"] = torch.randn(16, d_model, generator=gen, dtype=torch.float64) + offset
    rows = []
    for label, x in inputs.items():
        ref = norm_statistics(x, "fp64")
        for dt in dtypes:
            stats = norm_statistics(x, dt)
            for stat, value in stats.items():
                reference = 0.0 if stat == "rms_output_max_error" else ref[stat]
                rel = abs(value - reference) / abs(reference) if reference else math.nan
                if stat == "rms_output_max_error":
                    rel = value  # the outputs are O(1), so the absolute error is already relative
                rows.append(dict(input=label, dtype=dt, statistic=stat, value=value, reference=reference,
                                 rel_error=rel, finite=math.isfinite(value)))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# 4. Timings

#: What each phase of a ``lab.bench.lm.samples_long`` table measures.
PHASE_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward", "step": "train step"}


def speedup_table(samples: pd.DataFrame, baseline: str = "fp32", other: str = "bf16",
                  keys: Sequence[str] = ("size",), phases: Sequence[str] = ("fwd", "fwdbwd")) -> pd.DataFrame:
    """Speedup of training dtype ``other`` over ``baseline`` for each configuration ``keys`` and phase, with a
    noise-aware verdict.

    ``samples`` is the long table of :func:`lab.bench.lm.samples_long` (``dtype``, ``phase``, ``ms`` and the
    ``keys`` columns; one row per timed step). The speedup is the ratio of medians ``baseline / other`` (>1:
    ``other`` is faster) and its 95% interval comes from :func:`lab.measure.verdicts.compare`, whose verdict
    (``faster``, ``slower`` or ``within noise``, said of ``other``) is the only word prose may use. A
    configuration that one dtype did not measure (out of memory) gets ``"not measured"`` and NaN.

    Returns columns ``keys``, ``phase``, ``mode``, ``<baseline>_median_ms``, ``<other>_median_ms``,
    ``speedup``, ``speedup_low``, ``speedup_high``, ``verdict``, ``n_<baseline>``, ``n_<other>``.
    """
    keys = list(keys)
    rows = []
    for config, mine in samples.groupby(keys, sort=False):
        for phase in phases:
            cell = mine[mine["phase"] == phase]
            b = cell.loc[cell["dtype"] == baseline, "ms"].dropna().tolist()
            o = cell.loc[cell["dtype"] == other, "ms"].dropna().tolist()
            row = {**dict(zip(keys, config)), "phase": phase, "mode": PHASE_NAMES.get(phase, phase),
                   f"{baseline}_median_ms": float(np.median(b)) if b else math.nan,
                   f"{other}_median_ms": float(np.median(o)) if o else math.nan,
                   "speedup": math.nan, "speedup_low": math.nan, "speedup_high": math.nan,
                   "verdict": "not measured", f"n_{baseline}": len(b), f"n_{other}": len(o)}
            if b and o:
                c = compare(o, b)
                row.update(speedup=c.speedup, verdict=c.verdict,
                           speedup_low=1 / c.high if math.isfinite(c.high) and c.high > 0 else math.nan,
                           speedup_high=1 / c.low if math.isfinite(c.low) and c.low > 0 else math.nan)
            rows.append(row)
    return pd.DataFrame(rows)
