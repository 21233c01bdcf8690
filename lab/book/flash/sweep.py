"""FlashAttention's kernel variants measured (notebook 05's tuning, and how the tile tables of
:mod:`lab.kernels.flash_config` are chosen), with a command line for a GPU machine::

    python -m lab.book.flash.sweep sweep --workers 14 --shapes 4x32x512x80 1x32x32768x128 --out out/flash
    python -m lab.book.flash.sweep check --shapes 2x3x1100x80        # correctness only
    python -m lab.book.flash.sweep course                            # the course's timing test

* :func:`sweep_shape`: every FlashConfig variant of :func:`sweep_configs` (forward tiles; backward launch
  modes, fused / two-pass, on several tiles) next to the peers, SDPA's default backend (cuDNN on
  Hopper) and compiled FlexAttention, in one process; each checked against fp32 SDPA before it is timed;
  short sequences also timed as CUDA-graph replays (the device's time: eagerly, launches dominate);
* :func:`backward_breakdown`: where a backward's time goes, matrix products per tile pair and the rate
  they ran at against a measured matmul ceiling (:func:`matmul_ceiling`);
* :func:`lab.book.flash.host.host_costs` (the ``host`` table): a short sequence's forward+backward in the
  model's layout, eager against CUDA-graph replay and ``torch.compile``, with the profiler's and cProfile's
  tables (where the host's time goes);
* :func:`best_variants`: the fastest correct variant per shape, next to the default and the peers.

The sweep's variants fix their tiles, so pool workers (``--workers``) can compile them all first (Triton's
and Inductor's on-disk caches then serve the timing process, which has the GPU to itself).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch

from lab.book.attention.bench import attention_impl, attention_inputs
from lab.book.attention.costs import DTYPES, PASSES, attention_flops
from lab.book.flash.bench import Shape, course_timing_table, graph_times
from lab.book.flash.host import host_costs
from lab.kernels.flash_config import (
    LAUNCHED_PASSES,
    FlashConfig,
    backward_plan,
    block_d,
    forward_tiles,
    head_chunks,
)
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device
from lab.measure.timing import graph_replay, matmul_tflops, time_kernel
from lab.model.attention import AttentionFn

#: Forward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` a sweep tries besides the table's.
SWEEP_FWD_TILES = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2))
#: Forward variants that change more than the tiles: name -> (tiles, extra FlashConfig fields): a deeper or
#: shallower pipeline.
SWEEP_FWD = {
    "fwd 128x128 w8 s4": ((128, 128, 8, 4), {}),
    "fwd 128x128 w8 s2": ((128, 128, 8, 2), {}),
}
#: Shapes up to this many tokens are also timed as CUDA-graph replays (``{pass}_graph_ms``): their kernels
#: are short enough that the host's launch time, not the device, can set the eager time.
GRAPH_MAX_SEQ = 2048
#: Backward variants a sweep tries besides the table's: name -> (launch mode, tiles ``(BLOCK_M1, BLOCK_N1,
#: BLOCK_M2, BLOCK_N2, num_warps, num_stages)``, extra FlashConfig fields). ``M1 x N1`` are the (query, key)
#: tiles of the dK/dV programs, ``M2 x N2`` those of the dQ programs.
SWEEP_BWD = {
    "fused 32x64 w8 s2": ("fused", (32, 64, 64, 32, 8, 2), {}),
    "fused 32x64 w4 s2": ("fused", (32, 64, 64, 32, 4, 2), {}),
    "fused 64x64 w4 s3": ("fused", (64, 64, 64, 64, 4, 3), {}),
    "two_pass 64x128 w8 s3": ("two_pass", (64, 128, 128, 64, 8, 3), {}),
    "two_pass 64x64 w4 s3": ("two_pass", (64, 64, 64, 64, 4, 3), {}),
    "two_pass 128x128 w8 s2": ("two_pass", (128, 128, 128, 128, 8, 2), {}),
}
#: Matrix products per (query tile, key tile) pair of each backward launch mode: the dK/dV programs compute
#: S, dV, dP and dK, the separate dQ programs recompute S and dP before dQ (7; a kernel that adds dQ from the
#: dK/dV programs needs 5).
PRODUCTS = {"fused": 7, "two_pass": 7}
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}


def sweep_configs(fwd_tiles: Sequence[tuple] = SWEEP_FWD_TILES, bwd: dict | None = None,
                  fwd: dict | None = None) -> dict:
    """The FlashConfig variants of a sweep: ``{name: (config, passes)}`` where ``passes`` are the passes the
    variant changes ("default" runs all three, a forward variant times "fwd", a backward one "bwd").
    ``fwd_tiles``: forward variants that only fix tiles; ``fwd`` (default :data:`SWEEP_FWD`) and ``bwd``
    (default :data:`SWEEP_BWD`): named variants with extra fields."""
    bwd = SWEEP_BWD if bwd is None else bwd
    fwd = SWEEP_FWD if fwd is None else fwd
    out = {"default": (FlashConfig(), PASSES)}
    out.update({"fwd {}x{} w{} s{}".format(*t): (FlashConfig(fwd_tiles=tuple(t)), ("fwd",)) for t in fwd_tiles})
    out.update({name: (FlashConfig(fwd_tiles=tuple(tiles), **extra), ("fwd",)) for name, (tiles, extra) in fwd.items()})
    out.update({name: (FlashConfig(backward_launch=mode, bwd_tiles=tuple(tiles), **extra), ("bwd",))
                for name, (mode, tiles, extra) in bwd.items()})
    return out


def select_variants(variants: dict, names: Sequence[str] | None) -> dict:
    """The variants named in ``names`` (all of them for ``None`` or none given), in the sweep's order; a
    name the sweep does not have is a ValueError that lists the ones it has."""
    if not names:
        return variants
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; the sweep has: {', '.join(variants)}")
    return {n: v for n, v in variants.items() if n in names}


def relative_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the pairs (output and gradients), in float64."""
    return max(((g.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item()
               for g, r in zip(got, ref))


def _outputs(fn: AttentionFn, q, k, v, dout, causal, heads: int):
    """Output and (dQ, dK, dV) of the first ``heads`` rows of the batch, for a correctness check."""
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*xs, causal)
    grads = torch.autograd.grad(out, xs, dout)
    return [t[:heads].detach() for t in (out, *grads)]


def executed_flops(shape: Shape, pass_: str, mode: str = "two_pass", columns: int | None = None) -> float:
    """FLOPs the Triton kernels really issue for ``pass_`` (``"fwd"`` or ``"bwd"``): the useful FLOPs of
    :func:`attention_flops` on tiles ``columns`` wide in the head dimension (default one padded ``BLOCK_D``
    tile), the backward's at ``mode``'s products per tile pair (:data:`PRODUCTS`) over the 5 counted; masked
    diagonal tiles not counted."""
    useful = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, pass_, heads=shape.heads)
    products = PRODUCTS[mode] / 5 if pass_ == "bwd" else 1
    return useful * products * (columns or block_d(shape.d)) / shape.d


def backward_breakdown(shape: Shape, ms: float, mode: str, ceiling_tflops: float, columns: int | None = None) -> dict:
    """Where a backward's time goes: ``products`` per tile pair (:data:`PRODUCTS`), ``useful_tflops`` (the
    5-product FLOPs of :func:`attention_flops` per second), ``executed_tflops`` (the products really issued,
    on tiles ``columns`` wide in the head dimension: useful x products / 5 x columns / d; masked diagonal tiles
    not counted) and ``of_ceiling``, executed against ``ceiling_tflops`` (a measured large matmul of the same
    dtype). ``columns``: the head-dimension columns the kernels compute, the two chunks' widths summed where
    the head dimension is split (:func:`lab.kernels.flash_config.head_chunks`); default one padded
    ``BLOCK_D`` tile."""
    useful = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, "bwd", heads=shape.heads)
    rate = executed_flops(shape, "bwd", mode, columns) / (ms * 1e-3) / 1e12
    return dict(products=PRODUCTS[mode], useful_tflops=useful / (ms * 1e-3) / 1e12, executed_tflops=rate,
                of_ceiling=rate / ceiling_tflops if ceiling_tflops else math.nan)


def matmul_ceiling(dtype: str = "bf16", n: int = 8192, device: torch.device | str = "auto",
                   rep_ms: float = 100) -> float:
    """TFLOP/s of one ``n x n x n`` matmul in ``dtype`` (a name of :data:`DTYPES`), the tensor-core rate a
    kernel's matrix products can hope for on this device (:func:`lab.measure.timing.matmul_tflops`)."""
    return matmul_tflops(DTYPES[dtype], n, device, rep_ms)


def resolved_plan(shape: Shape, dtype: str, config, device: torch.device) -> dict:
    """The tiles and backward launch mode the kernels would use for ``shape`` under ``config`` (from the
    tables, or the config's own): ``fwd_tiles``, ``bwd_mode``, ``bwd_tiles`` as text for a results table."""
    bh, dt = shape.batch * shape.heads, DTYPES[dtype]
    f = forward_tiles(bh, shape.seq, shape.seq, shape.d, dt, device, config, shape.causal)
    mode, plan = backward_plan(bh, shape.seq, shape.seq, shape.d, dt, device, config)
    return dict(fwd_tiles="{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**f), bwd_mode=mode,
                bwd_tiles=" / ".join("{BLOCK_M1}x{BLOCK_N1},{BLOCK_M2}x{BLOCK_N2} w{num_warps} s{num_stages}".format(
                    **plan[p]) for p in LAUNCHED_PASSES[mode]))


def sweep_shape(shape: Shape, dtype: str = "bf16", variants: dict | None = None,
                peers: Sequence[str] = ("sdpa", "flex"), device: torch.device | str = "auto",
                warmup_ms: float = 10, rep_ms: float = 50, check_heads: int = 2,
                ceiling_tflops: float = math.nan, sink: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Every FlashConfig variant of :func:`sweep_configs` and every peer implementation on one shape, in one
    process: first a correctness check of each against fp32 SDPA on the first ``check_heads`` heads
    (``rel_err``, max error over output and gradients relative to the reference's largest value; ``ok``
    within :data:`TOLERANCE`), then the passes the variant changes, timed (``{pass}_ms`` medians,
    ``{pass}_tflops``; up to :data:`GRAPH_MAX_SEQ` tokens also ``{pass}_graph_ms`` / ``_graph_tflops``, CUDA
    graph replays). Backward rows also carry :func:`backward_breakdown` (of the graph replay's time when
    there is one). ``sink(row)`` sees each row as
    it is made (to write it out before a later one fails). A variant that fails is a row with ``status``
    "error" and the reason in ``note``."""
    from lab.kernels.flash_triton import FlashAttentionTriton  # needs Triton (an optional dependency)

    device = resolve_device(device) if isinstance(device, str) else device
    variants = sweep_configs() if variants is None else variants
    bh = shape.batch * shape.heads
    q, k, v, dout = attention_inputs(bh, shape.seq, shape.d, DTYPES[dtype], device)
    ref = _outputs(lambda a, b, c, causal: torch.nn.functional.scaled_dot_product_attention(
        a.float().unsqueeze(0), b.float().unsqueeze(0), c.float().unsqueeze(0), is_causal=causal)[0],
        q[:check_heads], k[:check_heads], v[:check_heads], dout[:check_heads].float(), shape.causal, check_heads)
    fns = {name: (lambda a, b, c, causal, cfg=cfg: FlashAttentionTriton.apply(a, b, c, causal, cfg), passes, cfg)
           for name, (cfg, passes) in variants.items()}
    fns.update({name: (attention_impl(name, device), PASSES, None) for name in peers})
    timer = dict(warmup_ms=warmup_ms, rep_ms=rep_ms)
    rows = []
    for name, (fn, passes, cfg) in fns.items():
        row = dict(shape=f"{shape.batch}x{shape.heads}x{shape.seq}x{shape.d}", causal=shape.causal, dtype=dtype,
                   impl="triton" if cfg is not None else name, variant=name, status="ok", note="")
        if cfg is not None:
            row.update(resolved_plan(shape, dtype, cfg, device))
        try:
            got = _outputs(fn, q, k, v, dout, shape.causal, check_heads)
            row["rel_err"] = relative_errors(got, ref)
            row["ok"] = row["rel_err"] <= TOLERANCE[dtype]
            del got
            graph = device.type == "cuda" and shape.seq <= GRAPH_MAX_SEQ
            row.update(_time_passes(fn, q, k, v, dout, shape.causal, passes, device, timer, graph))
            for p in PASSES:
                flops = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, p, heads=shape.heads)
                if f"{p}_ms" in row:
                    row[f"{p}_tflops"] = flops / (row[f"{p}_ms"] * 1e-3) / 1e12
                if f"{p}_graph_ms" in row:
                    row[f"{p}_graph_tflops"] = flops / (row[f"{p}_graph_ms"] * 1e-3) / 1e12
            if cfg is not None and "bwd" in passes:
                ms = row.get("bwd_graph_ms", row["bwd_ms"])
                row["bwd_columns"] = sum(head_chunks(shape.d, DTYPES[dtype], "bwd", shape.seq, shape.seq, cfg))
                row.update(backward_breakdown(shape, ms, row["bwd_mode"], ceiling_tflops, row["bwd_columns"]))
        except Exception as exc:  # noqa: BLE001 - a variant that cannot compile or run is a row, not the end
            if is_oom(exc):
                empty_cache()
            row.update(status="error", note=error_summary(exc))
        rows.append(row)
        if sink:
            sink(row)
    return pd.DataFrame(rows)


def _time_passes(fn, q, k, v, dout, causal, passes, device, timer, graph: bool = False) -> dict:
    """``{pass}_ms`` of each pass in ``passes`` (do_bench medians); with ``graph`` also ``{pass}_graph_ms`` of
    every pass, the device's time without the host's: the forward and forward+backward replayed from CUDA
    graphs, the backward their difference (:func:`lab.book.flash.bench.graph_times`)."""
    row = {}
    out = fn(q, k, v, causal) if "bwd" in passes else None
    steps = {"fwd": lambda: fn(q, k, v, causal),
             "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
             "e2e": lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)}
    for p in passes:
        row[f"{p}_ms"] = time_kernel(steps[p], device, **timer).median_ms
    if graph:
        try:
            replays = {p: time_kernel(graph_replay(steps[p]), device, **timer) for p in ("fwd", "e2e")}
            times = graph_times(replays["fwd"], replays["e2e"])
            row.update({f"{p}_graph_ms": times[f"{p}_ms"] for p in PASSES})
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its eager times
            row["note"] = f"graph: {error_summary(exc)}"
    return row


def best_variants(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per (shape, dtype): the fastest correct Triton variant for the forward and for the backward, next to
    the default and the peers, in TFLOP/s (one row per shape; columns ``{who}_{pass}_tflops``). Where a
    shape was timed as CUDA-graph replays, those (the device's time) decide and are reported
    (``timing="graph"``), else the eager times (``timing="eager"``)."""
    ok = sweep[(sweep["status"] == "ok") & (sweep.get("ok", True) != False)]  # noqa: E712 - NaN for peers
    rows = []
    for (shape, dtype), grp in ok.groupby(["shape", "dtype"], sort=False):
        graph = "bwd_graph_tflops" in grp and grp["bwd_graph_tflops"].notna().any()
        suffix = "_graph_tflops" if graph else "_tflops"
        row = dict(shape=shape, dtype=dtype, timing="graph" if graph else "eager")
        tri = grp[grp["impl"] == "triton"]
        for p in ("fwd", "bwd"):
            col = f"{p}{suffix}"
            if col in tri and tri[col].notna().any():
                best = tri.loc[tri[col].idxmax()]
                row.update({f"best_{p}": best["variant"], f"best_{p}_tflops": best[col]})
        for who in ["default", *grp.loc[grp["impl"] != "triton", "variant"]]:
            sel = grp[grp["variant"] == who]
            for p in PASSES:
                if len(sel) and f"{p}{suffix}" in sel:
                    row[f"{who}_{p}_tflops"] = sel[f"{p}{suffix}"].iloc[0]
        rows.append(row)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# Command line: python -m lab.book.flash.sweep {sweep,check,course} ...

_SHAPE_HELP = "BxHxLxD[:dtype][:full], e.g. 1x32x32768x128:bf16 or 2x16x4096x64:fp16:full (default causal, bf16)"


def parse_shape(text: str) -> tuple[Shape, str]:
    """``"BxHxLxD[:dtype][:full]"`` -> (Shape, dtype name); causal unless ``full`` is given."""
    dims, *flags = text.split(":")
    try:
        b, h, n, d = (int(x) for x in dims.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad shape {text!r}: expected {_SHAPE_HELP}") from None
    dtype = next((f for f in flags if f in DTYPES), "bf16")
    unknown = [f for f in flags if f not in DTYPES and f != "full"]
    if unknown:
        raise ValueError(f"bad shape {text!r}: unknown flag(s) {unknown}; expected {_SHAPE_HELP}")
    return Shape(b, h, n, d, "full" not in flags), dtype


def _warm_task(task):
    """A pool worker's job: one forward+backward of a variant (Triton's and Inductor's on-disk caches then
    hold its kernels for the timing process). Returns (name, None or the error's first line)."""
    shape, dtype, name, device = task
    try:
        fns = sweep_configs()
        bh = shape.batch * shape.heads
        q, k, v, dout = attention_inputs(bh, shape.seq, shape.d, DTYPES[dtype], torch.device(device))
        if name in fns:
            from lab.kernels.flash_triton import FlashAttentionTriton  # needs Triton (an optional dependency)

            fn = lambda a, b, c, causal: FlashAttentionTriton.apply(a, b, c, causal, fns[name][0])
        else:
            fn = attention_impl(name, device)
        _outputs(fn, q, k, v, dout, shape.causal, 1)
        return name, None
    except Exception as exc:  # noqa: BLE001 - reported by the parent, which times what compiled
        return name, error_summary(exc)


def warm_variants(jobs: Sequence[tuple[Shape, str]], names: Sequence[str], device: str, workers: int) -> list:
    """Compile every variant in ``names`` (:func:`sweep_configs` names or peers) for every (shape, dtype) of
    ``jobs`` in ``workers`` spawned processes, so that the timing process finds them compiled and has the
    GPU to itself. Returns the failures as (name, reason)."""
    tasks = [(s, dt, n, device) for s, dt in jobs for n in names]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [r for r in pool.imap_unordered(_warm_task, tasks) if r[1]]


def main(argv: Sequence[str] | None = None) -> None:
    """``sweep``: every FlashConfig variant and the peers (SDPA's default backend, compiled FlexAttention) on
    the given shapes, each checked against fp32 SDPA first, written to ``OUT/sweep.csv`` row by row, the best
    per shape to ``OUT/best.csv``, the host's share of a short shape to ``OUT/host.csv`` (and the profiler's
    table to ``OUT/host_profile.txt``); ``check``: only the correctness checks; ``course``: the course's
    timing test (compiled and eager) to ``OUT/course.csv``."""
    parser = argparse.ArgumentParser(prog="python -m lab.book.flash.sweep", description=main.__doc__)
    parser.add_argument("mode", choices=("sweep", "check", "course"))
    parser.add_argument("--shapes", nargs="+", default=["1x32x32768x128", "4x32x512x80"], help=_SHAPE_HELP)
    parser.add_argument("--peers", nargs="*", default=["sdpa", "flex"])
    parser.add_argument("--variants", nargs="*", help="only these variants (names as in sweep.csv; default: all)")
    parser.add_argument("--host-shape", default="4x32x512x80", help="shape of the host-cost table ('' skips it)")
    parser.add_argument("--workers", type=int, default=0, help="processes compiling the variants first (0: none)")
    parser.add_argument("--rep-ms", type=float, default=50)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    if args.mode == "course":
        course_timing_table(device=device).to_csv(out / "course.csv", index=False)
        print(pd.read_csv(out / "course.csv").to_string())
        return
    jobs = [parse_shape(s) for s in args.shapes]
    variants = select_variants(sweep_configs(), args.variants)
    if args.mode == "check":
        variants = {n: (c, ()) for n, (c, _) in variants.items()}
    if args.workers and device.type == "cuda":
        for name, reason in warm_variants(jobs, [*variants, *args.peers], str(device), args.workers):
            print(f"warm-up of {name} failed: {reason}", flush=True)
    ceiling = {dt: matmul_ceiling(dt, device=device) for dt in {dt for _, dt in jobs}} if device.type == "cuda" else {}
    path = out / ("sweep.csv" if args.mode == "sweep" else "check.csv")
    written = []

    def sink(row):
        written.append(row)
        pd.DataFrame(written).to_csv(path, index=False)
        cells = [row["variant"], row["status"], f"err {row.get('rel_err', math.nan):.2e}",
                 *(f"{p} {row[f'{p}_tflops']:.0f}" for p in PASSES if f"{p}_tflops" in row), row.get("note", "")]
        print(row["shape"], row["dtype"], *cells, flush=True)

    if args.mode == "sweep" and args.host_shape:  # first: the short sequence's question is the cheapest to answer
        shape, dt = parse_shape(args.host_shape)
        host, table = host_costs(shape, dt, device=device, rep_ms=args.rep_ms)
        host.to_csv(out / "host.csv", index=False)
        (out / "host_profile.txt").write_text(table)
        print(host.to_string(), flush=True)
    for shape, dt in jobs:
        sweep_shape(shape, dt, variants, args.peers if args.mode == "sweep" else (), device, rep_ms=args.rep_ms,
                    ceiling_tflops=ceiling.get(dt, math.nan), sink=sink)
    if args.mode == "sweep":
        best = best_variants(pd.DataFrame(written))
        best.assign(ceiling_tflops=best["dtype"].map(ceiling)).to_csv(out / "best.csv", index=False)
        print(best.to_string())


if __name__ == "__main__":
    main()
