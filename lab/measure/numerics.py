"""What a floating-point format does to a computation, measured rather than assumed: a sum accumulated in
a dtype (:func:`accumulation_experiment`), the dtype autocast gives each tensor of any module, observed with
hooks (:func:`probe_autocast_dtypes`), and normalisation statistics computed naively in a dtype against fp64
(:func:`norm_statistics_demo`). Each returns a DataFrame.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from lab.dtypes import dtype_name, torch_dtype
from lab.measure.device import resolve_device

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


def half_ulp(x: float, dtype: str) -> float:
    """Half a unit in the last place of ``x`` in ``dtype``: an addend smaller than this leaves a sum of ``x``
    unchanged (round to nearest)."""
    return 2.0 ** math.floor(math.log2(abs(x))) * torch.finfo(torch_dtype(dtype)).eps / 2 if x else 0.0


# ----------------------------------------------------------------------------------------------------------
# 2. What autocast does to each tensor


def probe_autocast_dtypes(model: nn.Module, dtype: str = "bf16", device: str | torch.device = "cpu", batch: int = 4,
                          seed: int = 0) -> pd.DataFrame:
    """Run ``model`` (its first Linear sets the input width) forward and backward under autocast to ``dtype``
    and record the dtype of every tensor of interest as it is actually produced.

    Nothing is asserted: forward hooks on each child module record their output dtypes, a tensor hook on
    the logits records the dtype of the gradient flowing into them, and parameter ``.grad`` dtypes are read
    after backward. ``dtype`` ``"fp32"`` runs without autocast (the reference). Returns a DataFrame with
    columns ``tensor`` (e.g. ``fc1 output``, ``loss``, ``grad fc1.weight``), ``kind`` (parameter,
    activation, loss, gradient), ``dtype``, ``shape`` and ``autocast`` (the requested dtype).
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    model = model.to(device)
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


def autocast_dtype_table(make_model: Callable[[], nn.Module], dtypes: Sequence[str] = ("fp32", "fp16", "bf16"),
                         device: str | torch.device = "cpu") -> pd.DataFrame:
    """:func:`probe_autocast_dtypes` of a fresh ``make_model()`` for each autocast dtype side by side: one row
    per tensor, one column per autocast dtype holding the observed dtype."""
    frames = [probe_autocast_dtypes(make_model(), dtype=d, device=device) for d in dtypes]
    long = pd.concat(frames, ignore_index=True)
    order = list(dict.fromkeys(frames[0]["tensor"]))
    wide = long.pivot(index="tensor", columns="autocast", values="dtype").reindex(order)[list(dtypes)]
    wide.columns = [f"autocast {d}" if d != "fp32" else "no autocast" for d in dtypes]
    kinds = frames[0].set_index("tensor")["kind"]
    return wide.assign(kind=kinds.reindex(order).values).reset_index()


def autocast_dtype_tables(make_model: Callable[[], nn.Module], device: str | torch.device = "auto",
                          dtypes: Sequence[str] = ("fp32", "fp16", "bf16")) -> pd.DataFrame:
    """:func:`autocast_dtype_table` on ``device`` and, when that is a GPU, on the CPU as well (the two
    autocast op lists differ): the wide tables stacked, with a ``device`` column (``cuda`` / ``cpu``)."""
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    devices = [dev] + ([torch.device("cpu")] if dev.type == "cuda" else [])
    return pd.concat([autocast_dtype_table(make_model, dtypes, d).assign(device=d.type) for d in devices],
                     ignore_index=True)


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
