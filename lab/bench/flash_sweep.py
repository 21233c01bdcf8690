"""The Triton FlashAttention kernels' variant sweep from the command line (how the tile tables of
:mod:`lab.kernels.flash_config` are chosen; the measuring is :mod:`lab.bench.flash_variants`)::

    python -m lab.bench.flash_sweep sweep --workers 14 --shapes 4x32x512x80 1x32x32768x128 --out out/flash
    python -m lab.bench.flash_sweep check --shapes 2x3x1100x80        # correctness only
    python -m lab.bench.flash_sweep course                            # the course's timing test

``sweep`` writes every variant and peer (checked against fp32 SDPA first) to ``OUT/sweep.csv`` row by row, the
best per shape to ``OUT/best.csv`` and the host's share of a short shape to ``OUT/host.csv`` (the profiler's
table to ``OUT/host_profile.txt``); ``check`` only the correctness checks (``OUT/check.csv``); ``course`` the
course's test, compiled and eager (``OUT/course.csv``). A mistake costs one line (:mod:`lab.cli`), and so does
work sized for a GPU asked of a CPU, where the Triton interpreter runs every tile pair in Python.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

import pandas as pd

from lab import cli
from lab.accounting.attention import DTYPES, PASSES
from lab.bench import flash_variants as fv
from lab.bench.attention import IMPLS
from lab.bench.attention_grid import Shape
from lab.measure.device import resolve_device
from lab.measure.timing import matmul_tflops

PROG = "python -m lab.bench.flash_sweep"
SHAPE_HELP = "BxHxLxD[:dtype][:full], e.g. 1x32x32768x128:bf16 or 2x16x4096x64:fp16:full (default causal, bf16)"
#: On the CPU the Triton interpreter runs each (query tile, key tile) pair of 64 x 64 in Python, so more pairs than
#: this a pass would keep the sweep running for hours: such work is refused there.
CPU_MAX_TILE_PAIRS = 4096
COURSE_SHAPE = Shape(16, 1, 16384, 64)


def parse_shape(text: str) -> tuple[Shape, str]:
    """``"BxHxLxD[:dtype][:full]"`` -> (Shape, dtype name); causal unless ``full`` is given."""
    dims, *flags = text.split(":")
    try:
        b, h, n, d = (int(x) for x in dims.lower().split("x"))
    except ValueError:
        raise ValueError(f"bad shape {text!r}: expected {SHAPE_HELP}") from None
    unknown = [f for f in flags if f not in DTYPES and f != "full"]
    if unknown or min(b, h, n, d) < 1:
        raise ValueError(f"bad shape {text!r}: expected {SHAPE_HELP}")
    return Shape(b, h, n, d, "full" not in flags), next((f for f in flags if f in DTYPES), "bf16")


def _shape_arg(text: str) -> tuple[Shape, str] | None:
    try:
        return parse_shape(text) if text else None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tile_pairs(shape: Shape, tile: int = 64) -> int:
    """The (query tile, key tile) pairs one pass of ``shape`` visits, causal pairs only where causal."""
    n = math.ceil(shape.seq / tile)
    return shape.batch * shape.heads * (n * (n + 1) // 2 if shape.causal else n * n)


def refuse_cpu_work(shapes: Sequence[Shape], mode: str) -> None:
    """Refuse (:class:`lab.cli.UsageError`) shapes whose tile pairs exceed :data:`CPU_MAX_TILE_PAIRS`, saying how
    many each would run and what to change."""
    big = max(shapes, key=tile_pairs)
    if tile_pairs(big) <= CPU_MAX_TILE_PAIRS:
        return
    change = ("run it on a GPU" if mode == "course" else
              "give smaller --shapes (e.g. 1x2x256x64)" + (" and --host-shape ''" if mode == "sweep" else "")
              + ", or run it on a GPU")
    raise cli.UsageError(f"on the CPU the Triton interpreter would run {tile_pairs(big):,} tile pairs a pass for "
                         f"{big.label} ({CPU_MAX_TILE_PAIRS:,} at most here: hours of Python); {change}")


def parser() -> cli.Parser:
    p = cli.Parser(prog=PROG, description="The Triton FlashAttention kernels' variants, checked and timed.")
    p.add_argument("mode", choices=("sweep", "check", "course"))
    p.add_argument("--shapes", nargs="+", type=_shape_arg, help=SHAPE_HELP,
                   default=[parse_shape("1x32x32768x128"), parse_shape("4x32x512x80")])
    p.add_argument("--peers", nargs="*", default=["sdpa", "flex"], choices=[i for i in IMPLS if i != "triton"])
    p.add_argument("--variants", nargs="*", help="only these variants (names as in sweep.csv; default: all)")
    p.add_argument("--host-shape", type=_shape_arg, default="4x32x512x80", help="the host-cost table's ('' skips it)")
    p.add_argument("--workers", type=cli.non_negative_int, default=0, help="processes compiling the variants first")
    p.add_argument("--rep-ms", type=cli.positive_float, default=50, help="do_bench's budget per pass (ms)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:<index>")
    return p


def sweep_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        variants = fv.select_variants(fv.sweep_configs(), args.variants)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    jobs = [] if args.mode == "course" else args.shapes
    if device.type == "cpu":
        host = [args.host_shape[0]] if args.mode == "sweep" and args.host_shape else []
        refuse_cpu_work([COURSE_SHAPE] if args.mode == "course" else [s for s, _ in jobs] + host, args.mode)
    out = cli.writable_dir(args.out, "--out")
    if args.mode == "course":
        course = fv.course_timing_table(device=device)
        course.to_csv(out / "course.csv", index=False)
        print(course.to_string())
        return 0
    if args.mode == "check":
        variants = {n: (c, ()) for n, (c, _) in variants.items()}
    peers = args.peers if args.mode == "sweep" else []
    if args.workers and device.type == "cuda":
        for name, reason in fv.warm_variants(jobs, [*variants, *peers], str(device), args.workers):
            print(f"warm-up of {name} failed: {reason}", flush=True)
    ceiling = {dt: matmul_tflops(DTYPES[dt], 8192, device) for dt in {dt for _, dt in jobs}} \
        if device.type == "cuda" else {}
    path, written = out / ("sweep.csv" if args.mode == "sweep" else "check.csv"), []
    shown = ["shape", "dtype", "variant", "kernel", "bwd_kernel", "status", "rel_err", *[f"{p}_tflops" for p in PASSES],
             "note"]

    def sink(row):
        written.append(row)
        pd.DataFrame(written).to_csv(path, index=False)
        print(pd.DataFrame([row]).reindex(columns=shown).to_string(header=False, index=False), flush=True)

    if args.mode == "sweep" and args.host_shape:  # first: the short sequence's question is the cheapest to answer
        host, table = fv.host_costs(*args.host_shape, device=device, rep_ms=args.rep_ms)
        host.to_csv(out / "host.csv", index=False)
        (out / "host_profile.txt").write_text(table)
        print(host.to_string(), flush=True)
    for shape, dt in jobs:
        fv.sweep_shape(shape, dt, variants, peers, device, rep_ms=args.rep_ms, ceiling_tflops=ceiling.get(dt, math.nan),
                    sink=sink)
    if args.mode == "sweep":
        best = fv.best_variants(pd.DataFrame(written))
        best.assign(ceiling_tflops=best["dtype"].map(ceiling)).to_csv(out / "best.csv", index=False)
        print(best.to_string())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.bench.flash_sweep``: the sweep with one-line errors (:func:`lab.cli.run`)."""
    return cli.run(sweep_main, argv, prog=PROG)


if __name__ == "__main__":
    raise SystemExit(main())
