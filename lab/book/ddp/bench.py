"""How fast the data-parallel wrappers of :mod:`lab.parallel.ddp` train, and how much of their communication
hides behind the backward pass.

* :func:`benchmark_ddp` times an AdamW train step of a :class:`~lab.model.transformer.TransformerLM` for each
  wrapper (naive, flat, individual, bucketed at several bucket sizes, ``torch.nn.parallel.DistributedDataParallel``)
  and the single-device step at the same per-rank batch, all **interleaved** in one launch
  (:mod:`lab.bench.interleaved`: they take turns, round after round, so host drift cannot rank them), and
  reports each one's median and spread over rounds. Then one profiled step per wrapper on rank 0 gives the
  communication time (NCCL kernels on GPUs, gloo's worker-thread spans on the CPU), how much of it
  overlapped compute, and a Chrome trace (read by :mod:`lab.measure.traces`).
* :func:`bucket_overhead_ms`, :func:`optimal_bucket` and :func:`fit_bucket_overhead` are the bucketed
  overhead model: with ``n`` buckets of a total ``s`` bytes, per-call overhead ``o`` and bandwidth ``w``,
  the time added after backward is ``n*o + s/(n*w)``.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from lab import cli, paths
from lab.accounting import parameter_count
from lab.bench.interleaved import (
    Interleaving,
    choose_schedule,
    closer,
    combine_entry,
    summarize_rounds,
    time_interleaved,
)
from lab.bench.memory_estimate import HEADROOM, cpu_peak_bytes
from lab.measure.device import available_memory_bytes, synchronize
from lab.measure.profiling import profile_step
from lab.measure.results import save_results
from lab.measure.step import TrainStep, make_optimizer, random_batch
from lab.measure.traces import read_trace, step_overlap
from lab.model import ModelConfig, TransformerLM, config_for
from lab.parallel import launcher as distributed
from lab.parallel import runner
from lab.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP

IMPLS = ("naive", "flat", "individual", "bucketed", "torch_ddp", "single_gpu")
TORCH_DDP_BUCKET_MB = 25.0  # torch's default bucket_cap_mb
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
        return nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                   bucket_cap_mb=bucket_mb)
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


def model_config(size: str | ModelConfig, context: int) -> tuple[str, ModelConfig]:
    """``(name, config)`` of a size name or an explicit :class:`ModelConfig`, at ``context`` tokens."""
    if isinstance(size, ModelConfig):
        return "custom", replace(size, context_length=context)
    return size, config_for(size, context_length=context)


def resolve_schedule(interleaving: Interleaving, bytes_per_copy: float, copies: int, device: str,
                     world_size: int) -> Interleaving:
    """``interleaving`` with an ``"auto"`` schedule made concrete: resident when ``copies`` copies fit in half
    the memory of one rank's device (a GPU, or the CPU's available memory shared by the ranks)."""
    if interleaving.schedule != "auto":
        return interleaving
    _, device_type = distributed.resolve_backend(world_size, device=device)
    available = available_memory_bytes(device_type)
    if device_type == "cpu":
        available /= world_size
    return replace(interleaving, schedule=choose_schedule(bytes_per_copy, copies, available))


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
    summary = step_overlap(read_trace(path))
    return {"comm_ms": summary["communication_ms"] / n_steps, "overlap_frac": summary["overlap_share"],
            "trace": str(path)}


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
    slowest rank, ms; comm_ms: communication time in rank 0's profiled step, ms; status ok/oom) plus the
    spread (step_q1_ms, step_q3_ms, step_iqr_ms, rounds, step_samples_ms: the per-round samples as a JSON
    list, see :func:`lab.bench.interleaved.samples`), schedule, overlap_frac, n_buckets, grad_mb, trace (its
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
                         n_buckets=first.get("n_buckets", math.nan), grad_mb=first.get("grad_mb", math.nan),
                         trace=paths.repo_relative(profile.get("trace")), status=timing["status"],
                         error=timing["error"]))
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class DDPRun:
    """What notebook 07 measures: each of ``configs`` (dicts of size, dtype, batch per rank, context) on
    ``world_size`` ranks of ``device`` ("cuda": NCCL; "cpu": gloo), bucketed at ``bucket_sizes_mb``, timed
    with ``interleaving``. ``note`` says where it runs and why (:func:`where_to_run`)."""

    device: str
    world_size: int
    configs: tuple[dict, ...]
    bucket_sizes_mb: tuple[float, ...]
    interleaving: Interleaving = field(default_factory=Interleaving)
    profile_steps: int = 1
    note: str = ""

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def params(self) -> dict:
        """The resolved settings, for a report's provenance."""
        return dict(run_device=self.device, world_size=self.world_size, configs=list(self.configs),
                    bucket_sizes_mb=list(self.bucket_sizes_mb), **self.interleaving.params(),
                    profile_steps=self.profile_steps)

    def measure(self, artifacts_dir: str = "artifacts") -> pd.DataFrame:
        """:func:`benchmark_ddp` for every config, one table with a ``config`` column ("xl fp32")."""
        tables = []
        for c in self.configs:
            df = benchmark_ddp(c["size"], context=c["context"], batch=c["batch"], dtype=c["dtype"],
                               world_size=self.world_size, device=self.device, bucket_sizes_mb=self.bucket_sizes_mb,
                               interleaving=self.interleaving, profile_steps=self.profile_steps,
                               artifacts_dir=artifacts_dir)
            tables.append(df.assign(config=f"{c['size']} {c['dtype']}"))
        return pd.concat(tables, ignore_index=True)


def where_to_run(quick: bool, device: str, world_size: int, gpus: int | None = None) -> tuple[bool, str]:
    """``(on_gpu, sentence)``: whether a notebook's run uses ``world_size`` GPUs (the full profile, when the
    machine has them and ``device`` allows) or CPU processes with gloo, and a sentence saying which and why."""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if quick:
        return False, f"Quick profile: a tiny model on {world_size} CPU processes with gloo."
    if device != "cpu" and gpus >= world_size:
        return True, f"Full profile: {world_size} GPUs with NCCL."
    why = "device='cpu' was asked for" if device == "cpu" else f"this machine has {gpus} GPU(s)"
    return False, (f"The full profile needs {world_size} GPUs and {why}; this render runs the CPU-sized version "
                   "with gloo instead.")


def plan_run(quick: bool, device: str = "auto", world_size: int = 2, configs: Sequence[dict] | None = None,
             bucket_sizes_mb: Sequence[float] | None = None, rounds: int | None = None,
             steps_per_round: int | None = None, warmup: int | None = None, schedule: str = "auto") -> DDPRun:
    """The notebook's settings made concrete. Full profile on ``world_size`` GPUs: xl in fp32 and 2.7B in
    bf16 (batch 2 per rank, context 512), buckets of 1, 10, 100 and 1000 MiB, 6 rounds of 3 steps. Quick, or
    without enough GPUs: a tiny model with gloo on the CPU, buckets of 0.1, 1 and 10 MiB, 20 rounds of 1 step.
    ``None`` picks these defaults."""
    on_gpu, note = where_to_run(quick, device, world_size)
    if on_gpu:
        configs = configs or [dict(size="xl", dtype="fp32", batch=2, context=512),
                              dict(size="2.7B", dtype="bf16", batch=2, context=512)]
        defaults = (bucket_sizes_mb or (1, 10, 100, 1000), 6, 3, 2)
    else:
        configs = configs or [dict(size="tiny", dtype="fp32", batch=2, context=32)]
        defaults = (bucket_sizes_mb or (0.1, 1, 10), 20, 1, 1)
    buckets, r, s, w = defaults
    interleaving = Interleaving(rounds=rounds or r, steps_per_round=steps_per_round or s,
                                warmup=w if warmup is None else warmup, schedule=schedule)
    return DDPRun("cuda" if on_gpu else "cpu", world_size, tuple(dict(c) for c in configs),
                  tuple(float(b) for b in buckets), interleaving, note=note)


# --------------------------------------------------------------------------------------------------------
# the bucketed overhead model


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


def parser() -> cli.Parser:
    """The command line of ``python -m lab.book.ddp.bench``."""
    p = cli.Parser(prog="python -m lab.book.ddp.bench",
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


def check_fits(cfg: ModelConfig, context: int, batch: int, dtype: str, world_size: int) -> None:
    """Refuse (:class:`lab.cli.UsageError`) a CPU run whose ranks cannot all hold their train step: each rank
    needs :func:`lab.bench.memory_estimate.cpu_peak_bytes` of one AdamW step at its per-rank batch."""
    per_rank = cpu_peak_bytes(cfg, batch, context, dtype, "train_step")
    available = available_memory_bytes("cpu")
    if world_size * per_rank > HEADROOM * available:
        raise cli.UsageError(f"{world_size} CPU ranks of this model at context {context}, batch {batch} need about "
                             f"{world_size * per_rank / 2**30:.1f} GiB ({per_rank / 2**30:.1f} GiB each), but "
                             f"{available / 2**30:.1f} GiB is available; use a smaller --size, --context or --batch")


def ddp_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.book.ddp.bench --size 2.7B --dtype bf16 --batch 2 --context 512`` (2 GPUs by default): the
    arguments, output paths, ranks and (on the CPU) memory are checked before any rank starts."""
    args = parser().parse_args(argv)
    try:
        cfg = config_for(args.size, context_length=args.context)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = ("cuda" if gpus else "cpu") if args.device == "auto" else args.device
    cli.check_ranks([args.world_size], device, gpus)
    for flag in ("results_dir", "artifacts_dir"):
        if getattr(args, flag):
            cli.writable_dir(getattr(args, flag), "--" + flag.replace("_", "-"))
    if device == "cpu":
        check_fits(cfg, args.context, args.batch, args.dtype, args.world_size)
    interleaving = Interleaving(args.rounds, args.steps_per_round, args.warmup, args.schedule)
    df = benchmark_ddp(args.size, args.context, args.batch, args.dtype, args.world_size, args.device, args.impls,
                       args.bucket_sizes_mb, interleaving, artifacts_dir=args.artifacts_dir)
    cols = ["impl", "bucket_mb", "world_size", "step_ms", "step_iqr_ms", "rounds", "comm_ms", "overlap_frac",
            "n_buckets", "status"]
    print(df[cols].to_markdown(index=False, floatfmt=".4g"))
    if args.results_dir:
        print(save_results(df, "ddp_benchmark", args.results_dir, vars(args), source="lab.book.ddp.bench"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`ddp_main`, every mistake answered in one line (see :mod:`lab.cli`)."""
    return cli.run(ddp_main, argv, prog="python -m lab.book.ddp.bench")


if __name__ == "__main__":
    sys.exit(main())
