"""The one collective cost model: ring all-gather, reduce-scatter, all-reduce (and the alternate
all-reduce) in time and bytes, symbolic or numeric; and the time bucketed all-reduces add to a data-parallel
step (:func:`bucket_overhead_ms`, its optimum and its fit to measured steps).

Used by the accounting notebook (closed forms, checked step by step by :mod:`lab.accounting.ring_sim`), by
the collective benchmark (nccl-tests' bus bandwidth is the ring factor of these formulas) and by the
sharding code's traffic log (bytes each rank sends).

Conventions (nccl-tests, doc/PERFORMANCE.md): ``S`` is the *full* tensor: the all-reduced buffer, the
gathered output of an all-gather (each rank contributes ``S / N``), the input of a reduce-scatter (each rank
keeps ``S / N``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import sympy as sp

from lab.accounting.symbols import N, S, W, alpha


def ring_all_gather_time(S=S, N=N, W=W, alpha=0):
    """Ring all-gather of a full array of S bytes (each device starts with S/N): N-1 steps of S/N bytes.

    Time ``(N-1) (alpha + S / (N W))`` seconds."""
    return (N - 1) * (alpha + S / (N * W))


def ring_reduce_scatter_time(S=S, N=N, W=W, alpha=0):
    """Ring reduce-scatter of S bytes per device into S/N-byte reduced shards: N-1 steps of S/N bytes.

    Time ``(N-1) (alpha + S / (N W))`` seconds."""
    return (N - 1) * (alpha + S / (N * W))


def ring_all_reduce_time(S=S, N=N, W=W, alpha=0):
    """Bandwidth-optimal ring all-reduce = reduce-scatter + all-gather: 2(N-1) steps of S/N bytes.

    Time ``2 (N-1) (alpha + S / (N W))`` seconds; tends to ``2 S / W`` for large N."""
    return 2 * (N - 1) * (alpha + S / (N * W))


def alternate_ring_all_reduce_time(S=S, N=N, W=W, alpha=0):
    """The alternate (naive) ring all-reduce: the *whole* S-byte array of every device travels the ring.

    Each of N-1 steps, every device forwards a full array (its own first, then the one it just received)
    and adds what it receives, so after N-1 steps each holds the sum of all N. Time
    ``(N-1) (alpha + S / W)`` seconds: N/2 times the bandwidth-optimal all-reduce (equal at N = 2), but
    only N-1 latencies instead of 2(N-1)."""
    return (N - 1) * (alpha + S / W)


def ring_all_gather_bytes(S=S, N=N):
    """Bytes each device sends in a ring all-gather: ``(N-1) S / N``."""
    return (N - 1) * S / N


def ring_reduce_scatter_bytes(S=S, N=N):
    """Bytes each device sends in a ring reduce-scatter: ``(N-1) S / N``."""
    return (N - 1) * S / N


def ring_all_reduce_bytes(S=S, N=N):
    """Bytes each device sends in a reduce-scatter + all-gather ring all-reduce: ``2 (N-1) S / N``."""
    return 2 * (N - 1) * S / N


def alternate_ring_all_reduce_bytes(S=S, N=N):
    """Bytes each device sends in the alternate (whole-array) ring all-reduce: ``(N-1) S``."""
    return (N - 1) * S


COLLECTIVES = {
    "all_gather": (ring_all_gather_time, ring_all_gather_bytes),
    "reduce_scatter": (ring_reduce_scatter_time, ring_reduce_scatter_bytes),
    "all_reduce": (ring_all_reduce_time, ring_all_reduce_bytes),
    "alternate_all_reduce": (alternate_ring_all_reduce_time, alternate_ring_all_reduce_bytes),
}


def collective_time(name: str, S=S, N=N, W=W, alpha=0):
    """Time (s) of the ring collective ``name`` (a key of ``COLLECTIVES``)."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name][0](S, N, W, alpha)


def collective_bytes(name: str, S=S, N=N):
    """Bytes each device sends in the ring collective ``name``."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name][1](S, N)



def ring_fraction(n):
    """``(n-1)/n``: the share of a full tensor each rank sends in one ring all-gather or reduce-scatter
    (the pass every ring collective is made of). Works on numbers and sympy symbols."""
    return (n - 1) / n


def ring_factor(op: str, world_size: int) -> float:
    """Bytes each rank sends per byte of the full tensor on a ring of ``world_size`` ranks: ``2(n-1)/n`` for
    an all-reduce, ``(n-1)/n`` for an all-gather, a reduce-scatter or a pipelined broadcast (which forwards
    the tensor along ``n-1`` links, ``(n-1)/n`` of it per rank on average). Numeric twin of
    :func:`collective_bytes` divided by ``S``; it is also nccl-tests' bus-bandwidth factor."""
    if op not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        raise ValueError(f"op must be all_reduce, all_gather, reduce_scatter or broadcast, got {op!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return (2 if op == "all_reduce" else 1) * ring_fraction(world_size)


def ring_bytes_per_rank(op: str, full_bytes: float, world_size: int) -> float:
    """Bytes each rank sends for one collective of a ``full_bytes`` tensor on a ring (see :func:`ring_factor`)."""
    return ring_factor(op, world_size) * full_bytes


def collective_table(size_bytes: float, devices, bandwidth: float, latency: float = 0.0):
    """Time (s) and bytes sent per device of every ring collective for each device count; a DataFrame."""
    import pandas as pd

    rows = []
    for name in COLLECTIVES:
        # one compiled numeric function per formula, evaluated for every N
        time_fn = sp.lambdify((S, N, W, alpha), collective_time(name, alpha=alpha))
        bytes_fn = sp.lambdify((S, N), collective_bytes(name))
        for n in devices:
            rows.append(dict(collective=name, devices=n, size_bytes=size_bytes, bandwidth=bandwidth,
                             time_s=float(time_fn(size_bytes, n, bandwidth, latency)),
                             bytes_sent=float(bytes_fn(size_bytes, n))))
    return pd.DataFrame(rows).sort_values(["devices", "collective"], kind="stable", ignore_index=True)


# ----------------------------------------------------------------------------------------------------------
# bucketed all-reduce during backward (data parallelism)


def bucket_overhead_ms(n_buckets: float, total_bytes: float, o_ms: float, w_gbps: float) -> float:
    """Time added after backward by bucketed all-reduce, in ms: ``n*o + s/(n*w)``.

    The model: gradients arrive at the rate the bandwidth can carry them, so each bucket's transfer
    ``(s/n)/w`` hides behind the backward of the next bucket, except that every call also costs a fixed
    ``o`` that nothing hides (the delays pile up: ``n*o``), and the last bucket's transfer starts only when
    backward has ended (``s/(n*w)``). ``w`` is the algorithm bandwidth in GB/s (10**9 B/s).
    """
    return n_buckets * o_ms + total_bytes / n_buckets / (w_gbps * 1e9) * 1e3


def optimal_bucket(total_bytes: float, o_ms: float, w_gbps: float) -> dict:
    """Minimum of :func:`bucket_overhead_ms` over n: ``n* = sqrt(s/(w*o))``, bucket ``b* = s/n* = sqrt(s*w*o)``,
    overhead ``2*sqrt(s*o/w)``. Returns n_buckets, bucket_mb (MiB) and overhead_ms."""
    if o_ms <= 0 or w_gbps <= 0:
        raise ValueError(f"o and w must be positive, got o={o_ms} ms, w={w_gbps} GB/s")
    w = w_gbps * 1e9 / 1e3  # bytes per ms
    n = math.sqrt(total_bytes / (w * o_ms))
    return {"n_buckets": n, "bucket_mb": total_bytes / n / 2**20, "overhead_ms": 2 * math.sqrt(total_bytes * o_ms / w)}


def fit_bucket_overhead(n_buckets: Sequence[float], overhead_ms: Sequence[float], total_bytes: float) -> dict:
    """Least-squares ``o`` (ms) and ``w`` (GB/s) of :func:`bucket_overhead_ms` from measured overheads.

    ``overhead_ms`` is each bucketed step minus the single-device step. The model is linear in ``o`` and
    ``1/w``; a coefficient that comes out non-positive (noise, or overlap better than the model assumes)
    is dropped and the other refitted alone, and reported as NaN. Returns o_ms, w_gbps and the fit's
    predictions.
    """
    n = np.asarray(n_buckets, dtype=float)
    y = np.asarray(overhead_ms, dtype=float)
    if len(n) < 2:
        raise ValueError("need at least two bucket sizes to fit two parameters")
    cols = np.stack([n, total_bytes / n], axis=1)  # y = o * n + (1/w) * s/n, with 1/w in ms per byte
    coef, *_ = np.linalg.lstsq(cols, y, rcond=None)
    if coef[0] <= 0 or coef[1] <= 0:
        # fall back to the better of the two one-parameter models (latency only, or bandwidth only)
        fits = []
        for j in (0, 1):
            c = max(float(cols[:, j] @ y / (cols[:, j] @ cols[:, j])), 0.0)
            fits.append((float(np.sum((y - c * cols[:, j]) ** 2)), j, c))
        _, j, c = min(fits)
        coef = np.zeros(2)
        coef[j] = c
    o_ms = float(coef[0]) if coef[0] > 0 else math.nan
    w_gbps = 1.0 / float(coef[1]) / 1e9 * 1e3 if coef[1] > 0 else math.nan
    return {"o_ms": o_ms, "w_gbps": w_gbps, "predicted_ms": (cols @ coef).tolist()}


def bucket_overhead_points(rows: pd.DataFrame) -> pd.DataFrame:
    """The data of :func:`bucket_overhead_model`: per ``config`` of data-parallel step rows (``impl``,
    ``bucket_mb``, ``n_buckets`` all-reduce calls, ``grad_mb``, median ``step_ms``, ``status``), every flat,
    individual and bucketed row that ran with ``overhead_ms``, its step minus the single-device step."""
    cols = [c for c in ("config", "label", "impl", "bucket_mb", "n_buckets", "grad_mb") if c in rows]
    parts = []
    for _, ok in rows[rows["status"] == "ok"].groupby("config", sort=False):
        single, points = ok[ok["impl"] == "single_gpu"], ok[ok["impl"].isin(["flat", "individual", "bucketed"])]
        if len(single):
            parts.append(points[cols].assign(overhead_ms=points["step_ms"] - single["step_ms"].iloc[0]))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*cols, "overhead_ms"])


def bucket_overhead_model(rows: pd.DataFrame, alpha_beta: dict | None = None) -> pd.DataFrame:
    """Per config: the per-call overhead ``o`` and bandwidth ``w`` of ``n*o + s/(n*w)`` fitted to
    :func:`bucket_overhead_points` (:func:`fit_bucket_overhead`) and the bucket size they make optimal; the same
    optimum from a lone all-reduce's ``alpha_beta`` (``o_ms``, ``w_gbps``; NaN without it); the bucket size of
    the fastest bucketed row measured."""
    out = []
    for config, part in bucket_overhead_points(rows).groupby("config", sort=False):
        total = part["grad_mb"].iloc[0] * 2**20
        fit = fit_bucket_overhead(part["n_buckets"], part["overhead_ms"], total) if len(part) >= 2 else {}
        row = dict(config=config, grad_mb=part["grad_mb"].iloc[0], fit_o_ms=fit.get("o_ms", math.nan),
                   fit_w_gbps=fit.get("w_gbps", math.nan), nb06_o_ms=(alpha_beta or {}).get("o_ms", math.nan),
                   nb06_w_gbps=(alpha_beta or {}).get("w_gbps", math.nan))
        for name in ("fit", "nb06"):
            o, w = row[f"{name}_o_ms"], row[f"{name}_w_gbps"]
            opt = optimal_bucket(total, o, w) if o > 0 and w > 0 else {}
            row.update({f"{name}_best_bucket_mb": opt.get("bucket_mb", math.nan),
                        f"{name}_best_overhead_ms": opt.get("overhead_ms", math.nan)})
        bucketed = rows[(rows["config"] == config) & (rows["status"] == "ok") & (rows["impl"] == "bucketed")]
        best = bucketed.sort_values("step_ms")["bucket_mb"]
        out.append({**row, "measured_best_bucket_mb": best.iloc[0] if len(best) else math.nan})
    return pd.DataFrame(out)
