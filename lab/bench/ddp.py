"""How fast the data-parallel wrappers of :mod:`lab.parallel.ddp` train, and how much of their communication hides
behind the backward pass.

* :func:`benchmark_ddp` times an AdamW train step of a :class:`~lab.model.transformer.TransformerLM` for each wrapper
  (naive, flat, individual, bucketed at several bucket sizes, ``torch.nn.parallel.DistributedDataParallel``)
  and the single-device step at the same per-rank batch, in one launch; one profiled step per wrapper on
  rank 0 gives the communication time (NCCL kernels on GPUs, gloo's worker-thread spans on the CPU), how
  much of it overlapped compute, and a Chrome trace.
* the timelines are read and drawn by :mod:`lab.measure.traces` (the one trace reader and timeline plot).
* :func:`bucket_overhead_ms`, :func:`optimal_bucket` and :func:`fit_bucket_overhead` are the bucketed
  overhead model: with ``n`` buckets of a total ``s`` bytes, per-call overhead ``o`` and bandwidth ``w``,
  the time added after backward is ``n*o + s/(n*w)``.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from lab import paths
from lab.measure.device import error_summary, is_oom, synchronize
from lab.measure.profiling import quiet_profile
from lab.measure.step import TrainStep, make_optimizer, random_batch
from lab.measure.timing import time_callable
from lab.measure.traces import read_trace, step_overlap
from lab.model import ModelConfig, TransformerLM, config_for
from lab.parallel import launcher as distributed
from lab.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP

IMPLS = ("naive", "flat", "individual", "bucketed", "torch_ddp", "single_gpu")
TORCH_DDP_BUCKET_MB = 25.0  # torch's default bucket_cap_mb


def benchmark_plan(bucket_sizes_mb: Sequence[float] = (1, 10, 100, 1000),
                   impls: Sequence[str] = IMPLS) -> list[tuple[str, float]]:
    """The (impl, bucket_mb) pairs to measure: bucketed once per bucket size, the others once.

    torch DDP runs last: its reducer's hooks are released when it is garbage collected, and running it
    after our wrappers keeps the model's parameters free of hooks for them.
    """
    for impl in impls:
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose from {', '.join(IMPLS)}")
    plan = []
    for impl in impls:
        if impl == "bucketed":
            plan += [("bucketed", float(b)) for b in bucket_sizes_mb]
        elif impl != "torch_ddp":
            plan.append((impl, 0.0))  # 0: no buckets (a number, not NaN, so result keys compare equal)
    if "torch_ddp" in impls:
        plan.append(("torch_ddp", TORCH_DDP_BUCKET_MB))
    return plan


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


# --------------------------------------------------------------------------------------------------------
# the worker


def ddp_benchmark_worker(plan: list[tuple[str, float]], cfg: ModelConfig, batch: int, dtype: str, warmup: int,
                         steps: int, trace_dir: str | None, profile_steps: int = 1, seed: int = 0) -> list[dict]:
    """Inside a launched process: time a train step for each (impl, bucket_mb) of ``plan`` on one model.

    Each rank draws its own batch of ``batch`` sequences. ``single_gpu`` runs on rank 0 alone (the other
    ranks wait at a barrier). Returns one dict per plan entry with this rank's step samples (ms); rank 0's
    also carry the profiled step's communication time, overlap and the timeline.
    """
    r, dev = distributed.rank(), distributed.device()
    torch.manual_seed(seed)
    with torch.device(dev):
        model = TransformerLM(cfg)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    tokens, targets = random_batch(cfg, batch, dev, cfg.context_length, seed=seed + r)
    out = []
    for impl, bucket_mb in plan:
        row = {"impl": impl, "bucket_mb": bucket_mb, "rank": r, "samples_ms": [], "status": "ok", "error": "",
               "grad_mb": grad_bytes / 2**20, "n_buckets": math.nan, "comm_ms": math.nan,
               "overlap_frac": math.nan, "timeline": None, "trace": None}
        active = impl != "single_gpu" or r == 0
        wrapped = step = None
        try:
            if active:
                wrapped = wrap(impl, model, bucket_mb, dev)
                row["n_buckets"] = _bucket_count(impl, wrapped)
                step = TrainStep(wrapped, make_optimizer(model, dev), tokens, targets, dtype=dtype)
                row["samples_ms"] = time_callable(step, warmup, steps, dev).samples_ms
                if r == 0 and profile_steps > 0:
                    row.update(_profile(step, dev, profile_steps, impl, bucket_mb, cfg, trace_dir))
                elif profile_steps > 0:
                    for _ in range(profile_steps):  # keep the other ranks in step with the profiled one
                        step()
                    synchronize(dev)
        except Exception as exc:  # noqa: BLE001 - out of memory is a result
            if not is_oom(exc):
                raise
            row.update(status="oom", error=error_summary(exc), samples_ms=[])
        finally:
            if hasattr(wrapped, "remove_hooks"):
                wrapped.remove_hooks()
            # drop every reference to the wrapper (its buckets are a full copy of the gradients)
            wrapped = step = None
            model.zero_grad(set_to_none=True)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if impl == "single_gpu":
            dist.barrier()
        out.append(row)
    return out


def _bucket_count(impl: str, wrapped: nn.Module) -> float:
    if impl in ("naive", "individual"):
        return len(wrapped.trainable)
    if impl == "flat":
        return 1
    if impl == "bucketed":
        return len(wrapped.buckets)
    return math.nan


def _profile(step, dev, n_steps, impl, bucket_mb, cfg, trace_dir) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with quiet_profile(torch.profiler.profile(activities=activities)) as prof:
        for _ in range(n_steps):
            step()
        synchronize(dev)
    name = f"ddp_{impl}" + (f"_{bucket_mb:g}mb" if impl in ("bucketed", "torch_ddp") else "") + f"_d{cfg.d_model}.json"
    folder = Path(trace_dir) if trace_dir else Path(paths.artifacts_dir("artifacts/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    prof.export_chrome_trace(str(path))
    timeline = read_trace(path)
    summary = step_overlap(timeline)
    return {"comm_ms": summary["communication_ms"] / n_steps, "overlap_frac": summary["overlap_share"],
            "timeline": timeline, "trace": str(path)}


# --------------------------------------------------------------------------------------------------------
# the benchmark


def benchmark_ddp(size: str | ModelConfig = "xl", context: int = 512, batch: int = 2, dtype: str = "fp32",
                  world_size: int = 2, device: str = "auto", impls: Sequence[str] = IMPLS,
                  bucket_sizes_mb: Sequence[float] = (1, 10, 100, 1000), warmup: int = 3, steps: int = 5,
                  profile_steps: int = 1, artifacts_dir: str = "artifacts", timeout_s: float = 600,
                  ) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Train-step time of each data-parallel wrapper on ``world_size`` ranks (one launch, one model).

    ``batch`` is per rank (the global batch is ``batch * world_size``); ``single_gpu`` is the same step on
    one device with that per-rank batch, i.e. the ideal a data-parallel step can approach. Returns
    ``(table, timelines)``: one row per (impl, bucket_mb) with the spec's ``ddp_benchmark`` columns (bucket_mb:
    MiB per bucket for bucketed and torch_ddp, 0 for the unbucketed wrappers; step_ms:
    mean over steps of the slowest rank, ms; comm_ms: communication time in rank 0's profiled step, ms;
    status ok/oom) plus step_std_ms, overlap_frac, n_buckets, grad_mb, trace; and the profiled timelines
    keyed by ``"impl"`` or ``"bucketed_<mb>"``. Chrome traces go to ``<artifacts_dir>/ddp_traces``.
    """
    if isinstance(size, ModelConfig):
        cfg, name = ModelConfig(**{**size.__dict__, "context_length": context}), "custom"
    else:
        cfg, name = config_for(size, context_length=context), size
    plan = benchmark_plan(bucket_sizes_mb, impls)
    trace_dir = str(paths.artifacts_dir(Path(artifacts_dir) / "ddp_traces"))
    per_rank = distributed.launch(ddp_benchmark_worker, world_size, plan, cfg, batch, dtype, warmup, steps,
                                  trace_dir, profile_steps, device=device, timeout_s=timeout_s)
    rows, timelines = [], {}
    for results in zip(*per_rank):
        first = results[0]
        impl = first["impl"]
        ws = 1 if impl == "single_gpu" else world_size
        samples = [r["samples_ms"] for r in results if r["samples_ms"]]
        status = "oom" if any(r["status"] == "oom" for r in results) else "ok"
        step_ms = step_std = math.nan
        if status == "ok" and samples:
            slowest = np.max(np.array(samples), axis=0)  # a step is done when its slowest rank is
            step_ms, step_std = float(slowest.mean()), float(slowest.std(ddof=1)) if len(slowest) > 1 else 0.0
        rows.append(dict(impl=impl, bucket_mb=first["bucket_mb"], world_size=ws, size=name, context=context,
                         batch=batch, dtype=dtype, step_ms=step_ms, step_std_ms=step_std,
                         comm_ms=0.0 if impl == "single_gpu" and status == "ok" else first["comm_ms"],
                         overlap_frac=first["overlap_frac"], n_buckets=first["n_buckets"],
                         grad_mb=first["grad_mb"], trace=_relative(first["trace"]), status=status,
                         error=next((r["error"] for r in results if r["error"]), "")))
        if first["timeline"] is not None:
            key = impl if impl != "bucketed" else f"bucketed_{first['bucket_mb']:g}"
            timelines[key] = first["timeline"]
    return pd.DataFrame(rows), timelines


def _relative(path: str | None) -> str | None:
    """A trace path relative to the repository root when it lies inside it (tables travel between machines)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(paths.REPO_ROOT))
    except ValueError:
        return path


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


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    """``python -m lab.bench.ddp --size 2.7B --dtype bf16 --batch 2 --context 512`` (2 GPUs by default)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m lab.bench.ddp",
                                description="Train-step time of the data-parallel wrappers (and torch DDP).")
    p.add_argument("--size", default="xl")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--bucket-sizes-mb", nargs="+", type=float, default=[1, 10, 100, 1000])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--artifacts-dir", default="artifacts")
    p.add_argument("--results-dir", default=None, help="also merge the rows into <dir>/ddp_benchmark.csv")
    args = p.parse_args(argv)
    df, _ = benchmark_ddp(args.size, args.context, args.batch, args.dtype, args.world_size, args.device,
                          args.impls, args.bucket_sizes_mb, args.warmup, args.steps,
                          artifacts_dir=args.artifacts_dir)
    if distributed.rank() == 0:
        cols = ["impl", "bucket_mb", "world_size", "step_ms", "step_std_ms", "comm_ms", "overlap_frac",
                "n_buckets", "status"]
        print(df[cols].to_markdown(index=False, floatfmt=".4g"))
        if args.results_dir:
            from lab.measure.results import save_results

            print(save_results(df, "ddp_benchmark", args.results_dir, vars(args)))
    return df


if __name__ == "__main__":
    main()
