"""How fast collectives run: all-reduce, all-gather and reduce-scatter of float32 tensors over gloo (CPU
processes) or NCCL (one GPU per rank), values checked against closed forms, bandwidths as nccl-tests
reports them, and the alpha-beta (latency + size / bandwidth) fit. ``python -m lab.bench.collectives``.

Bandwidth conventions are those of nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): ``size``
is the *full* tensor; **algorithm bandwidth** ``algbw = size / time`` is what the caller sees; **bus
bandwidth** ``busbw = algbw * factor`` is the traffic each link carries on an optimal ring (the factor is
:func:`lab.accounting.collectives.ring_factor`: ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for the others), so
it compares with the hardware's link bandwidth independently of the number of ranks.

Units: sizes in MiB (2**20 bytes; "1 GB" is 1024 MiB), times in milliseconds, bandwidths in GB/s (10**9 B/s).
A call's time is that of its slowest rank, and a row's time the median over iterations with its spread
(:func:`lab.measure.verdicts.summarize`); every iteration's time is kept (``samples_ms``) for the verdicts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

import pandas as pd
import torch
import torch.distributed as dist

from lab import cli
from lab.accounting.collectives import ring_factor
from lab.bench.progress import progress_bar
from lab.measure.device import available_memory_bytes, error_summary, is_oom, synchronize
from lab.measure.results import save_results
from lab.measure.verdicts import summarize
from lab.parallel import launcher as distributed
from lab.parallel import runner
from lab.parallel.collectives import all_gather_tensor, reduce_scatter_tensor
from lab.units import MiB

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw (:func:`lab.accounting.collectives.ring_factor` for the benchmarked ops)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return ring_factor(op, world_size)


def algorithm_bandwidth_gbps(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10**9 B/s): the full tensor size divided by the collective's time."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return size_bytes / seconds / 1e9


def bus_bandwidth_gbps(op: str, size_bytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: algorithm bandwidth times :func:`bus_bandwidth_factor`."""
    return algorithm_bandwidth_gbps(size_bytes, seconds) * bus_bandwidth_factor(op, world_size)


# --------------------------------------------------------------------------------------------------------
# one collective with known inputs (used for timing and for checking values)


def _buffers(op: str, numel: int, n: int, r: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and output of ``op`` for a full tensor of ``numel`` floats, filled with exact small integers."""
    chunk = numel // n
    if op == "all_reduce":
        x = torch.full((numel,), float(r + 1), device=device)
        return x, x
    if op == "all_gather":
        return torch.full((chunk,), float(r + 1), device=device), torch.empty(numel, device=device)
    # reduce_scatter: chunk i of rank r holds (r+1)(i+1), so rank r receives (i=r) (r+1) * n(n+1)/2
    scale = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(chunk)
    return scale * float(r + 1), torch.empty(chunk, device=device)


def _run(op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        all_gather_tensor(out, inp)
    else:
        reduce_scatter_tensor(out, inp)


def _expected(op: str, out: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """What ``out`` must hold after one collective on the buffers of :func:`_buffers` (exact in fp32)."""
    if op == "all_reduce":
        return torch.full_like(out, n * (n + 1) / 2)
    if op == "all_gather":
        chunk = out.numel() // n
        return torch.arange(1, n + 1, device=out.device, dtype=out.dtype).repeat_interleave(chunk)
    return torch.full_like(out, (r + 1) * n * (n + 1) / 2)


def collective_row(item: tuple[str, int], warmup: int, iters: int) -> dict:
    """Inside a launched process: time one collective ``item = (op, size_bytes)``; check its values once.

    Each timed iteration starts after a barrier (so ranks start together) and ends with a device
    synchronize; returns this rank's per-iteration seconds (``samples_s``), ``correct`` and ``status``
    (``oom`` when its buffers do not fit: the runner then ends the launch, see :func:`lab.parallel.runner.each`).
    """
    op, size = item
    n, r, dev = distributed.world_size(), distributed.rank(), distributed.device()
    numel = (size // 4) // n * n  # divisible by n, so every rank's share is the same
    row = {"op": op, "size_mb": size / MiB, "size_bytes": numel * 4, "rank": r, "samples_s": [], "correct": None,
           "status": "ok", "error": ""}
    try:
        inp, out = _buffers(op, numel, n, r, dev)
        _run(op, inp, out)  # one call on known inputs checks the values
        row["correct"] = bool(torch.equal(out, _expected(op, out, n, r)))
        for i in range(warmup + iters):
            dist.barrier()
            synchronize(dev)
            start = time.perf_counter()
            _run(op, inp, out)
            synchronize(dev)
            if i >= warmup:
                row["samples_s"].append(time.perf_counter() - start)
        del inp, out
    except Exception as exc:  # noqa: BLE001 - out of memory is a result
        if not is_oom(exc):
            raise
        row.update(status="oom", error=error_summary(exc))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def collective_worker(ops: Sequence[str], sizes_bytes: Sequence[int], warmup: int, iters: int) -> list[dict]:
    """Inside a launched process: :func:`collective_row` of each op at each size, in that order."""
    return [collective_row((op, size), warmup, iters) for op in ops for size in sizes_bytes]


# --------------------------------------------------------------------------------------------------------
# the benchmark


def plan_world_sizes(world_sizes: Sequence[int], device: str, gpus: int | None = None) -> tuple[list[int], str]:
    """The world sizes that can run on ``device`` ("cpu": gloo, any number of processes; "cuda": NCCL, one
    GPU per rank), and a sentence about those that cannot (empty when all can). ``gpus`` defaults to this
    machine's GPU count."""
    if device == "cpu":
        return list(world_sizes), ""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    run = [w for w in world_sizes if w <= gpus]
    skipped = [w for w in world_sizes if w > gpus]
    if not skipped:
        return run, ""
    sizes = ", ".join(str(w) for w in skipped)
    msg = (f"NCCL cannot run {sizes} ranks here: this machine has {gpus} GPU(s) and "
           f"NCCL runs one rank per GPU, so its grid stops at {max(run)} ranks." if run else
           f"NCCL cannot run here: this machine has {gpus} GPU(s) and NCCL runs one rank per GPU; only gloo "
           "(CPU processes) is measured.")
    return run, msg


def benchmark_collectives(ops: Sequence[str] = OPS, sizes_mb: Sequence[float] = (1, 10, 100, 1024),
                          world_sizes: Sequence[int] = (2, 4, 6), device: str = "cpu", warmup: int = 5,
                          iters: int = 20, timeout_s: float = 600, progress: bool = True,
                          deadline_s: float | None = None) -> pd.DataFrame:
    """Time all-reduce / all-gather / reduce-scatter of float32 tensors; one row per (op, world size, size).

    ``device`` "cpu" uses gloo, "cuda" NCCL with one GPU per rank (world sizes larger than the GPU count are
    skipped, see :func:`plan_world_sizes`). Columns: backend, op, world_size, size_mb (MiB of the full
    tensor asked for), size_bytes (as measured: a multiple of the world size), time_ms (median over
    iterations of the slowest rank's time: a collective is done when its last rank is), time_spread_ms,
    time_n, samples_ms (every iteration's slowest-rank time as a JSON list: what verdicts are drawn from),
    algbw_gbps, busbw_gbps (from the median), correct (values checked against the closed form), status (ok,
    oom, failed) and error. Each world size's (op, size) pairs run through :func:`lab.parallel.runner.run`:
    one that runs out of memory or fails on a rank (a hung collective fails after ``timeout_s``) is a row of
    its own and the
    rest are measured in new processes; ``deadline_s`` (per world size) makes what is left ``failed`` rows.
    """
    for op in ops:
        bus_bandwidth_factor(op, 2)  # validates the name
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {device!r}")
    sizes_bytes = [int(mb * MiB) for mb in sizes_mb]
    run, _ = plan_world_sizes(world_sizes, device)
    items = [(op, size) for op in ops for size in sizes_bytes]
    backend = "nccl" if device == "cuda" else "gloo"
    rows = []
    for n in progress_bar(run, f"collectives on {device}", progress):
        def blank(item, status, error, n=n):
            numel = (item[1] // 4) // n * n
            return {"op": item[0], "size_mb": item[1] / MiB, "size_bytes": numel * 4, "samples_s": [],
                    "correct": None, "status": status, "error": error}

        per_item = runner.run(runner.each_item, items, n,
                              lambda todo, progress_: (collective_row, todo, progress_, warmup, iters),
                              blank=blank, skip_failed=True, deadline_s=deadline_s, device=device,
                              timeout_s=timeout_s)
        rows.extend(aggregate_item(results, n, backend) for results in per_item)
    return pd.DataFrame(rows)


def aggregate_over_ranks(per_rank: list[list[dict]], world_size: int, backend: str) -> list[dict]:
    """Combine the ranks' samples of :func:`collective_worker` into one row per (op, size) with bandwidths."""
    return [aggregate_item(results, world_size, backend) for results in zip(*per_rank)]


def aggregate_item(results: Sequence[dict], world_size: int, backend: str) -> dict:
    """One (op, size)'s row from its ranks' :func:`collective_row` (or the one row of an item that failed):
    the slowest rank per iteration, their median, spread and count, bandwidths; ``status`` ``oom`` or
    ``failed`` (with ``error``) where any rank's was."""
    first = results[0]
    bad = [r for r in results if r["status"] != "ok"]
    row = {"backend": backend, "op": first["op"], "world_size": world_size,
           "size_mb": first.get("size_mb", first["size_bytes"] / MiB), "size_bytes": first["size_bytes"],
           "correct": all(r["correct"] for r in results if r["correct"] is not None),
           "status": bad[0]["status"] if bad else "ok", "error": bad[0].get("error", "") if bad else ""}
    if row["status"] == "ok":
        slowest = [max(times) * 1e3 for times in zip(*(r["samples_s"] for r in results))]  # per iteration
        s = summarize(slowest)
        row.update(time_ms=s.median, time_spread_ms=s.spread, time_n=s.n,
                   samples_ms=json.dumps([round(x, 6) for x in slowest]),
                   algbw_gbps=algorithm_bandwidth_gbps(row["size_bytes"], s.median / 1e3),
                   busbw_gbps=bus_bandwidth_gbps(row["op"], row["size_bytes"], s.median / 1e3, world_size))
    return row


def latency_bandwidth_fit(df: pd.DataFrame) -> pd.DataFrame:
    """Fit ``time = latency + size / bandwidth`` (the alpha-beta model) per (backend, op, world_size).

    Weighted least squares (weights 1/time, so the small messages that fix the latency are not drowned by
    the large ones) over the sizes of :func:`benchmark_collectives`' rows with status ok. Returns columns
    backend, op, world_size, sizes (how many sizes the fit saw), latency_ms (the fixed cost of one call:
    what small messages pay; 0 where the fitted intercept is not positive), bandwidth_gbps (the algorithm
    bandwidth approached by large messages, GB/s; NaN where times do not grow with size),
    half_latency_mb (the size at which a call spends as long moving bytes as on its fixed cost,
    latency x bandwidth, MiB: below it a call is latency-bound) and max_residual (the largest relative
    deviation of a measured time from the fit: large values mean the model does not describe the data).
    """
    import numpy as np

    rows = []
    ok = df[df["status"] == "ok"]
    for (backend, op, n), part in ok.groupby(["backend", "op", "world_size"]):
        if len(part) < 2:
            continue
        x = part["size_bytes"].to_numpy(float)
        y = part["time_ms"].to_numpy(float)
        w = 1.0 / y
        a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
        (latency, per_byte), *_ = np.linalg.lstsq(a, y * w, rcond=None)
        latency = max(float(latency), 0.0)
        bandwidth = 1.0 / per_byte / 1e6 if per_byte > 0 else float("nan")  # per_byte in ms per byte
        predicted = latency + x * max(float(per_byte), 0.0)
        rows.append({"backend": backend, "op": op, "world_size": n, "sizes": len(part), "latency_ms": latency,
                     "bandwidth_gbps": bandwidth, "half_latency_mb": latency * 1e-3 * bandwidth * 1e9 / MiB,
                     "max_residual": float(np.max(np.abs(predicted - y) / y))})
    return pd.DataFrame(rows, columns=["backend", "op", "world_size", "sizes", "latency_ms", "bandwidth_gbps",
                                       "half_latency_mb", "max_residual"])


def parser() -> cli.Parser:
    """The command line of ``python -m lab.bench.collectives``."""
    p = cli.Parser(prog="python -m lab.bench.collectives", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: gloo between processes; cuda: NCCL, one GPU per rank")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--sizes-mb", nargs="+", type=cli.positive_float, default=[1, 10, 100, 1024],
                   help="full tensor sizes in MiB")
    p.add_argument("--world-sizes", nargs="+", type=cli.positive_int, default=None,
                   help="ranks per run (default: 2, 4, 6 where this machine has the GPUs or cores)")
    p.add_argument("--warmup", type=cli.non_negative_int, default=5)
    p.add_argument("--iters", type=cli.positive_int, default=20)
    p.add_argument("--results-dir", default=None, help="also save the table as <dir>/collectives.csv")
    return p


def buffer_bytes(op: str, size_bytes: float, world_size: int) -> float:
    """Bytes one rank holds for one call of ``op`` on a ``size_bytes`` tensor (see :func:`_buffers`): the
    full tensor, in place for all-reduce; with one shard beside it for all-gather; for reduce-scatter the
    full input, the scale it is made from and the output shard."""
    shard = 1 / world_size
    return size_bytes * {"all_reduce": 1, "all_gather": 1 + shard, "reduce_scatter": 2 + shard}[op]


def check_fits(ops: Sequence[str], sizes_mb: Sequence[float], world_sizes: Sequence[int], device: str) -> None:
    """Refuse (:class:`lab.cli.UsageError`) a grid whose buffers cannot fit: on the CPU every rank's buffers
    together against the available memory, on CUDA one rank's against one GPU's."""
    per_rank = max(buffer_bytes(op, mb * MiB, w) for op in ops for mb in sizes_mb for w in world_sizes)
    ranks = max(world_sizes) if device == "cpu" else 1
    need = per_rank * ranks
    available = available_memory_bytes("cpu" if device == "cpu" else "cuda:0")
    if need > 0.9 * available:
        largest = max(sizes_mb) * 0.9 * available / need
        raise cli.UsageError(f"--sizes-mb {max(sizes_mb):g} needs about {need / 2**30:.1f} GiB of buffers "
                             f"({ranks} rank(s)), but {available / 2**30:.1f} GiB is available; "
                             f"use --sizes-mb {largest:.0f} or smaller")


def collectives_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.bench.collectives --device cuda --world-sizes 2 4 --sizes-mb 1 10 100 1024``: every
    argument, output path and the grid's memory are checked before any process starts."""
    args = parser().parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.world_sizes is None:
        limit = gpus if args.device == "cuda" else (os.cpu_count() or 1)
        args.world_sizes = [w for w in (2, 4, 6) if w <= limit] or [2]
    cli.check_ranks(args.world_sizes, args.device, gpus, flag="--world-sizes")
    if args.results_dir:
        cli.writable_dir(args.results_dir)
    check_fits(args.ops, args.sizes_mb, args.world_sizes, args.device)
    df = benchmark_collectives(args.ops, args.sizes_mb, args.world_sizes, args.device, args.warmup, args.iters)
    cols = ["backend", "op", "world_size", "size_mb", "time_ms", "algbw_gbps", "busbw_gbps", "correct", "status"]
    print(df[[c for c in cols if c in df.columns]].to_markdown(index=False, floatfmt=".4g"))
    if args.results_dir:
        print(save_results(df, "collectives", args.results_dir, vars(args), source=__spec__.name))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`collectives_main`, every mistake answered in one line (see :mod:`lab.cli`)."""
    return cli.run(collectives_main, argv, prog="python -m lab.bench.collectives")


if __name__ == "__main__":
    sys.exit(main())
