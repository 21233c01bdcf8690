"""Data-parallel training steps timed side by side: each wrapper of :mod:`lab.parallel.ddp` (naive, flat,
individual, bucketed at several bucket sizes), ``torch.nn.parallel.DistributedDataParallel`` and the
single-device step at the same per-rank batch, all **interleaved** in one launch (:mod:`lab.bench.interleaved`:
they take turns, round after round, so host drift cannot rank them). Each reports its median and spread
over rounds, every round kept, so that two of them compare round by round. Then one profiled step per
wrapper on rank 0 gives the communication time (NCCL kernels on GPUs, gloo's worker-thread spans on the
CPU), how much of it overlapped compute, and a Chrome trace (read by :mod:`lab.measure.traces`).

``python -m lab.bench.ddp --size 2.7B --dtype bf16 --batch 2 --context 512`` runs it from the command line.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from lab import cli, paths
from lab.accounting import parameter_count
from lab.bench.distributed import TORCH_DDP_BUCKET_MB, check_command, model_config, resolve_schedule
from lab.bench.interleaved import Interleaving, closer, combine_entry, summarize_rounds, time_interleaved
from lab.measure.device import synchronize
from lab.measure.profiling import PHASE_COLUMNS, phase_breakdown, profile_step
from lab.measure.results import save_results
from lab.measure.step import TrainStep, make_optimizer, random_batch
from lab.measure.traces import read_trace, step_overlap
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel import runner
from lab.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP, torch_ddp

IMPLS = ("naive", "flat", "individual", "bucketed", "torch_ddp", "single_gpu")
#: Bytes per parameter of one resident copy: fp32 weights, gradients, AdamW's two moments, a bucket buffer.
BYTES_PER_PARAM = 4 + 4 + 8 + 4


def benchmark_plan(bucket_sizes_mb: Sequence[float] = (1, 10, 100, 1000),
                   impls: Sequence[str] = IMPLS) -> list[tuple[str, float]]:
    """The (impl, bucket_mb) pairs to measure: bucketed once per bucket size, the others once (bucket_mb 0:
    no buckets; torch DDP at its default 25 MiB)."""
    for impl in impls:
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
    plan = []
    for impl in impls:
        if impl == "bucketed":
            plan += [("bucketed", float(b)) for b in bucket_sizes_mb]
        else:
            plan.append((impl, TORCH_DDP_BUCKET_MB if impl == "torch_ddp" else 0.0))
    return plan


def entry_key(impl: str, bucket_mb: float) -> str:
    """``"bucketed_10"`` for a bucketed entry, the impl's name otherwise (keys of timings and traces)."""
    return f"bucketed_{bucket_mb:g}" if impl == "bucketed" else impl


def wrap(impl: str, model: nn.Module, bucket_mb: float, dev: torch.device) -> nn.Module:
    """``model`` wrapped for data parallelism as ``impl`` (``single_gpu``: unwrapped)."""
    if impl == "naive":
        return NaiveDDP(model)
    if impl == "flat":
        return FlatDDP(model)
    if impl == "individual":
        return DDPIndividualParameters(model)
    if impl == "bucketed":
        return DDPBucketed(model, bucket_size_mb=bucket_mb)
    if impl == "torch_ddp":
        return torch_ddp(model, bucket_size_mb=bucket_mb)
    if impl == "single_gpu":
        return model
    raise ValueError(f"unknown impl {impl!r}")


def _bucket_count(impl: str, wrapped: nn.Module) -> float:
    if impl in ("naive", "individual"):
        return len(wrapped.trainable)
    if impl == "flat":
        return 1
    if impl == "bucketed":
        return len(wrapped.buckets)
    return math.nan


# --------------------------------------------------------------------------------------------------------
# the worker


def ddp_benchmark_worker(plan: list[tuple[str, float]], cfg: ModelConfig, batch: int, dtype: str,
                         interleaving: Interleaving, trace_dir: str | None, profile_steps: int = 1,
                         seed: int = 0, progress: runner.Progress | None = None) -> list[dict]:
    """Inside a launched process: time a train step for each (impl, bucket_mb) of ``plan``, interleaved.

    Each rank draws its own batch of ``batch`` sequences. Resident: every entry trains its own copy of the
    model with its own AdamW. Rebuild: one model and one AdamW, re-wrapped for each turn. ``single_gpu``
    runs on rank 0 alone. Then each entry that ran is profiled for ``profile_steps`` steps (rank 0 writes the
    trace). Returns one row per entry: ``status``, ``error``, this rank's ``timing``
    (:func:`lab.bench.interleaved.time_interleaved`), rank 0's ``profile`` summary, ``n_buckets`` and
    ``grad_mb`` (the gradient size in MiB), each recorded in ``progress`` once profiled (an error is charged
    to the entry it happened in: :func:`lab.parallel.runner.run`).
    """
    progress = progress or runner.Progress("")
    r, dev = distributed.rank(), distributed.device()
    torch.manual_seed(seed)
    with torch.device(dev):
        base = TransformerLM(cfg)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    tokens, targets = random_batch(cfg, batch, dev, cfg.context_length, seed=seed + r)
    resident = interleaving.schedule == "resident"
    shared_optimizer = None if resident else make_optimizer(base, dev)
    n_buckets: dict[str, float] = {}

    def builder(index: int, impl: str, bucket_mb: float):
        def build():
            progress.start(index)
            model = copy.deepcopy(base) if resident else base
            wrapped = wrap(impl, model, bucket_mb, dev)
            n_buckets[entry_key(impl, bucket_mb)] = _bucket_count(impl, wrapped)
            optimizer = make_optimizer(model, dev) if resident else shared_optimizer
            step = TrainStep(wrapped, optimizer, tokens, targets, dtype=dtype)
            return step, closer(wrapped, model)  # rebuild: the one AdamW is shared, its state kept
        return build

    def entered(index: int, build):  # for the timed turns only: the profile below needs the TrainStep itself
        def timed_build():
            step, close = build()
            return runner.entering(progress, index, step), close
        return timed_build

    builders = {entry_key(i, b): builder(n, i, b) for n, (i, b) in enumerate(plan)}
    with progress.charging():
        timings = time_interleaved({k: entered(n, b) for n, (k, b) in enumerate(builders.items())}, interleaving,
                                   dev, solo={"single_gpu"})
    rows = []
    for index, (impl, bucket_mb) in enumerate(plan):
        key = entry_key(impl, bucket_mb)
        profile = {}
        if timings[key]["status"] == "ok" and profile_steps >= 1 and (impl != "single_gpu" or r == 0):
            step, close = builders[key]()
            step()  # the first step after a build allocates buffers and optimizer state
            if r == 0:
                profile = _profile(step, dev, profile_steps, f"ddp_{key}_d{cfg.d_model}.json", trace_dir)
            else:
                for _ in range(profile_steps):  # keep in step with the profiled rank
                    step()
            synchronize(dev)
            close()
            del step, close
        if impl == "single_gpu" and timings[key]["status"] == "ok" and profile_steps >= 1:
            dist.barrier()
        rows.append(progress.finish(dict(status=timings[key]["status"], error=timings[key]["error"],
                                         timing=timings[key], profile=profile,
                                         n_buckets=n_buckets.get(key, math.nan), grad_mb=grad_bytes / 2**20),
                                    index))
    return rows


def _profile(step, dev: torch.device, n_steps: int, name: str, trace_dir: str | None) -> dict:
    folder = Path(trace_dir) if trace_dir else Path(paths.artifacts_dir("artifacts/tmp"))
    path = folder / name
    profile_step(step, "train_step", warmup=0, steps=n_steps, trace_path=path)
    trace = json.loads(path.read_text())  # read once, for the overlap and the phases
    summary = step_overlap(read_trace(trace))
    gpu = dev.type == "cuda"  # on the CPU, compute is the host's own operators: no GPU waited for it
    return {"comm_ms": summary["communication_ms"] / n_steps, "overlap_frac": summary["overlap_share"],
            "step_gpu_ms": summary["busy_ms"] / n_steps if gpu else math.nan,
            "step_compute_gpu_ms": summary["compute_ms"] / n_steps if gpu else math.nan, "trace": str(path),
            **{k: v for k, v in phase_breakdown(trace, n_steps, summary).items() if k in PHASE_COLUMNS}}


# --------------------------------------------------------------------------------------------------------
# the benchmark


def benchmark_ddp(size: str | ModelConfig = "xl", context: int = 512, batch: int = 2, dtype: str = "fp32",
                  world_size: int = 2, device: str = "auto", impls: Sequence[str] = IMPLS,
                  bucket_sizes_mb: Sequence[float] = (1, 10, 100, 1000),
                  interleaving: Interleaving = Interleaving(), profile_steps: int = 1,
                  artifacts_dir: str = "artifacts", timeout_s: float = 600) -> pd.DataFrame:
    """Train-step time of each data-parallel wrapper on ``world_size`` ranks, interleaved in one launch.

    ``batch`` is per rank (the global batch is ``batch * world_size``); ``single_gpu`` is the same step on
    one device with that per-rank batch, i.e. the ideal a data-parallel step can approach. One row per
    (impl, bucket_mb) with the spec's ``ddp_benchmark`` columns (bucket_mb: MiB per bucket for bucketed and
    torch_ddp, 0 otherwise; step_ms: the **median over rounds** of the step time, each step counted at its
    slowest rank, ms; comm_ms: communication time in rank 0's profiled step, ms; status ok/oom) plus
    step_gpu_ms and step_compute_gpu_ms (how long some kernel, and some kernel other than a collective's, ran in
    that profiled step: the first says whether the host kept the GPU busy, the second is the GPU's own work),
    that step's time by phase (:data:`lab.measure.profiling.PHASE_COLUMNS`; NaN without a GPU's kernels),
    step_spread_ms, step_n (rounds) and step_samples_ms (the rounds in order as a JSON list, see
    :func:`lab.bench.interleaved.summarize_rounds`), schedule, overlap_frac, n_buckets, grad_mb, trace (its
    Chrome trace under ``<artifacts_dir>/ddp_traces``) and error. An entry that fails on a rank (a collective
    that hangs fails after ``timeout_s``) is a ``failed`` row with the rank's cause, and the others are timed
    again, interleaved, in new processes (:func:`lab.parallel.runner.run`).
    """
    name, cfg = model_config(size, context)
    plan = benchmark_plan(bucket_sizes_mb, impls)
    interleaving = resolve_schedule(interleaving, parameter_count(cfg) * BYTES_PER_PARAM, len(plan), device,
                                    world_size)
    trace_dir = str(paths.artifacts_dir(Path(artifacts_dir) / "ddp_traces"))
    per_entry = runner.run(
        ddp_benchmark_worker, plan, world_size,
        lambda todo, progress: (todo, cfg, batch, dtype, interleaving, trace_dir, profile_steps, 0, progress),
        blank=lambda entry, status, error: dict(status=status, error=error, timing=dict(status=status, error=error)),
        skip_failed=True, device=device, timeout_s=timeout_s)
    rows = []
    for (impl, bucket_mb), ranks in zip(plan, per_entry):
        timing, first = combine_entry([r["timing"] for r in ranks]), ranks[0]
        profile = first.get("profile", {})
        ok = timing["status"] == "ok"
        rows.append(dict(impl=impl, bucket_mb=bucket_mb, world_size=1 if impl == "single_gpu" else world_size,
                         size=name, context=context, batch=batch, dtype=dtype, **summarize_rounds(timing["round_ms"]),
                         schedule=interleaving.schedule,
                         comm_ms=0.0 if impl == "single_gpu" and ok else profile.get("comm_ms", math.nan),
                         overlap_frac=profile.get("overlap_frac", math.nan),
                         step_gpu_ms=profile.get("step_gpu_ms", math.nan),
                         step_compute_gpu_ms=profile.get("step_compute_gpu_ms", math.nan),
                         **{c: profile.get(c, math.nan) for c in PHASE_COLUMNS},
                         n_buckets=first.get("n_buckets", math.nan), grad_mb=first.get("grad_mb", math.nan),
                         trace=paths.repo_relative(profile.get("trace")), status=timing["status"],
                         error=timing["error"]))
    return pd.DataFrame(rows)


def parser() -> cli.Parser:
    """The command line of ``python -m lab.bench.ddp``."""
    p = cli.Parser(prog="python -m lab.bench.ddp",
                   description="Train-step time of the data-parallel wrappers (and torch DDP), interleaved.")
    p.add_argument("--size", default="xl")
    p.add_argument("--context", type=cli.positive_int, default=512)
    p.add_argument("--batch", type=cli.positive_int, default=2, help="sequences per rank")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--world-size", type=cli.positive_int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--bucket-sizes-mb", nargs="+", type=cli.positive_float, default=[1, 10, 100, 1000])
    p.add_argument("--rounds", type=cli.positive_int, default=6)
    p.add_argument("--steps-per-round", type=cli.positive_int, default=3)
    p.add_argument("--warmup", type=cli.non_negative_int, default=2)
    p.add_argument("--schedule", choices=["auto", "resident", "rebuild"], default="auto")
    p.add_argument("--artifacts-dir", default="artifacts")
    p.add_argument("--results-dir", default=None, help="also save the rows as <dir>/ddp_benchmark.csv")
    return p


def ddp_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.bench.ddp --size 2.7B --dtype bf16 --batch 2 --context 512`` (2 GPUs by default): the
    arguments, output paths, ranks and (on the CPU) memory are checked before any rank starts."""
    args = parser().parse_args(argv)
    check_command([args.size], args.context, args.batch, args.dtype, args.world_size, args.device,
                  results_dir=args.results_dir, artifacts_dir=args.artifacts_dir)
    interleaving = Interleaving(args.rounds, args.steps_per_round, args.warmup, args.schedule)
    df = benchmark_ddp(args.size, args.context, args.batch, args.dtype, args.world_size, args.device, args.impls,
                       args.bucket_sizes_mb, interleaving, artifacts_dir=args.artifacts_dir)
    cols = ["impl", "bucket_mb", "world_size", "step_ms", "step_spread_ms", "step_n", "comm_ms", "overlap_frac",
            "n_buckets", "status"]
    print(df[cols].to_markdown(index=False, floatfmt=",.3f"))
    if args.results_dir:
        print(save_results(df, "ddp_benchmark", args.results_dir, vars(args), source="lab.bench.ddp"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`ddp_main`, every mistake answered in one line (see :mod:`lab.cli`)."""
    return cli.run(ddp_main, argv, prog="python -m lab.bench.ddp")


if __name__ == "__main__":
    sys.exit(main())
