"""Memory and time of data parallelism with and without sharding, on a TransformerLM (the 08 notebook).

Six implementations, all training with AdamW under the same autocast, one process per GPU:

========================  ===============================================================================
``ddp``                   ``torch.nn.parallel.DistributedDataParallel`` + AdamW (nothing sharded)
``sharded_optimizer``     DDP + :class:`lab.ShardedOptimizer` (optimizer state sharded; all-reduce + broadcast)
``zero1``                 :class:`lab.parallel.zero1.ZeRO1Optimizer`, no DDP (reduce-scatter + all-gather)
``fsdp``                  :class:`lab.FSDP` with ``compute_dtype`` = the autocast dtype
``torch_zero``            DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer``
``torch_fsdp2``           ``torch.distributed.fsdp.fully_shard`` per block and on the root, bf16 param dtype
========================  ===============================================================================

Two measurements per model size:

* **memory** (:func:`memory_row`): each implementation in fresh processes (:func:`lab.parallel.launcher.launch`),
  so its peaks are not polluted by another one; an out-of-memory on any rank becomes a row with
  ``status="oom"``. Memory is the CUDA caching allocator's ``max_memory_allocated`` with a reset before each
  phase: model and optimizer construction (``peak_init``), forward + backward of a steady-state step
  (``peak_before_step``) and the optimizer step (``peak_after_step``). The breakdown counts the bytes of this
  rank's parameter, gradient and optimizer-state tensors and compares them with the closed form
  (:func:`expected_state_bytes`). One more step of ``profile_impl`` can be profiled there (its trace).
* **step time** (:func:`step_times`): all implementations in the same processes, taking turns
  (:mod:`lab.bench.interleaved`), so host drift cannot rank them; each reports its median and spread over
  rounds, the torch baselines included.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from lab import paths
from lab.accounting import parameter_count
from lab.bench.interleaved import Interleaving, closer, combine_entry, summarize_rounds, time_interleaved
from lab.bench.progress import progress_bar
from lab.book.ddp.bench import model_config, resolve_schedule, where_to_run
from lab.dtypes import autocast_dtype
from lab.measure.device import error_summary, is_oom
from lab.measure.profiling import profile_step
from lab.measure.step import TrainStep, random_batch
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel import runner
from lab.parallel.fsdp import FSDP
from lab.parallel.sharded_optimizer import ShardedOptimizer
from lab.parallel.zero1 import ZeRO1Optimizer
from lab.units import GiB

IMPLS = ("ddp", "sharded_optimizer", "zero1", "fsdp", "torch_zero", "torch_fsdp2")
#: The implementation each one is judged against (the performance goals of notebook 08).
REFERENCE = {"sharded_optimizer": "torch_zero", "zero1": "torch_zero", "fsdp": "torch_fsdp2"}
LR = 1e-4
WEIGHT_DECAY = 0.01


# ----------------------------------------------------------------------------------------------------------
# closed forms


def sharded_parts(impl: str) -> dict[str, bool]:
    """Which of parameters / gradients / optimizer state ``impl`` divides over the ranks."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    full = impl in ("fsdp", "torch_fsdp2")
    return {"params": full, "grads": full, "optimizer_state": impl != "ddp"}


def expected_state_bytes(impl: str, num_params: int, world_size: int) -> dict[str, float]:
    """Bytes per rank of fp32 parameters (4/param), gradients (4) and AdamW state (8), each divided by the
    world size where ``impl`` shards it. Returns keys params, grads, optimizer_state, total."""
    parts = sharded_parts(impl)
    per_param = {"params": 4, "grads": 4, "optimizer_state": 8}
    out = {k: num_params * b / (world_size if parts[k] else 1) for k, b in per_param.items()}
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------------------------------------
# building one implementation


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2) -> this rank's shard


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _ddp(model: torch.nn.Module, device: torch.device):
    from torch.nn.parallel import DistributedDataParallel

    # Gradients as views of DDP's communication buckets: otherwise DDP keeps a second copy of them.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True)


def build_impl(impl: str, model: TransformerLM, device: torch.device, dtype: str, fsdp_reduce_dtype: str | None = None):
    """Wrap ``model`` for ``impl``; returns ``(runnable model, optimizer, optimizer-state holder)``.

    ``fsdp_reduce_dtype`` ("fp32", "bf16", or None for the compute dtype) is the dtype :class:`lab.FSDP`
    reduce-scatters gradients in. None matches FSDP2's default policy (a bf16 ``param_dtype`` reduces in
    bf16), so the ``fsdp`` and ``torch_fsdp2`` rows move the same bytes; the shards' gradients are fp32.
    """

    adamw = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    if impl == "ddp":
        wrapped = _ddp(model, device)
        opt = torch.optim.AdamW(wrapped.parameters(), **adamw)
        return wrapped, opt, opt
    if impl == "sharded_optimizer":
        wrapped = _ddp(model, device)
        opt = ShardedOptimizer(wrapped.parameters(), torch.optim.AdamW, **adamw)
        return wrapped, opt, opt.inner
    if impl == "zero1":
        opt = ZeRO1Optimizer(model.parameters(), torch.optim.AdamW, **adamw)
        return model, opt, opt.inner
    if impl == "fsdp":
        reduce = autocast_dtype(fsdp_reduce_dtype or dtype) or torch.float32
        wrapped = FSDP(model, compute_dtype=autocast_dtype(dtype), reduce_dtype=reduce)
        opt = torch.optim.AdamW(wrapped.parameters(), **adamw)
        return wrapped, opt, opt
    if impl == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = _ddp(model, device)
        opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
        return wrapped, opt, opt.optim
    if impl == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (distributed.world_size(),))
        cast = autocast_dtype(dtype)
        policy = MixedPrecisionPolicy(param_dtype=cast) if cast else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        return model, opt, opt
    raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")


# ----------------------------------------------------------------------------------------------------------
# memory, inside each launched process


class _Peaks:
    """``max_memory_allocated`` per phase on CUDA; NaN on the CPU (no allocator statistics there)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float:
        if not self.cuda:
            return math.nan
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) / GiB

    def allocated_gib(self) -> float:
        return torch.cuda.memory_allocated(self.device) / GiB if self.cuda else math.nan


def memory_worker(impl: str, cfg: ModelConfig, batch: int, dtype: str, warmup: int,
                  trace_path: str | None = None, fsdp_reduce_dtype: str | None = None) -> dict:
    """Inside a launched process: build ``impl``, run ``warmup`` steps (at least one: the optimizer state
    exists from then on), then one steady-state step in phases, reading the peak of each.

    Returns this rank's peaks (GiB) and the bytes of its parameter / gradient / optimizer-state tensors; with
    ``trace_path``, one more step is profiled (rank 0 writes the Chrome trace there).
    """
    device = distributed.device()
    peaks = _Peaks(device)
    peaks.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    num_params = model.num_parameters()
    runnable, opt, state_holder = build_impl(impl, model, device, dtype, fsdp_reduce_dtype)
    out = {"rank": distributed.rank(), "num_params": num_params, "peak_init_gib": peaks.peak_gib()}
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())
    train_step = TrainStep(runnable, opt, tokens, targets, dtype=dtype)
    for _ in range(max(warmup, 1)):
        train_step()
    out["allocated_start_gib"] = peaks.allocated_gib()
    peaks.reset()
    train_step.forward_backward()
    out["peak_before_step_gib"] = peaks.peak_gib()
    params = list(runnable.parameters())
    out["param_bytes"] = _bytes(params)
    out["grad_bytes"] = _bytes(p.grad for p in params)
    peaks.reset()
    opt.step()
    out["peak_after_step_gib"] = peaks.peak_gib()
    out["optimizer_state_bytes"] = _bytes(t for s in state_holder.state.values() for t in s.values()
                                          if torch.is_tensor(t) and t.ndim > 0)
    opt.zero_grad(set_to_none=True)
    if trace_path is not None:  # every rank steps (collectives must match); rank 0 writes the trace
        profile_step(train_step, "train_step", warmup=0, steps=1,
                     trace_path=trace_path if distributed.rank() == 0 else None)
    return out


def _reduce_dtype(impl: str, dtype: str, fsdp_reduce_dtype: str | None) -> str:
    """The dtype ``impl`` reduces gradients in: FSDP's setting, FSDP2's param dtype, fp32 for the others."""
    if impl == "fsdp":
        return fsdp_reduce_dtype or dtype
    return dtype if impl == "torch_fsdp2" else "fp32"


def memory_row(impl: str, size: str | ModelConfig, world_size: int = 2, context: int = 512, batch: int = 2,
               dtype: str = "bf16", warmup: int = 1, device: str = "auto", trace_path: str | None = None,
               timeout_s: float = 180, fsdp_reduce_dtype: str | None = None,
               deadline_s: float | None = None) -> dict:
    """Peak memory by phase of ``impl`` on ``size`` with ``world_size`` ranks, in fresh processes.

    ``batch`` is per rank. Returns impl, world_size, size, context, batch, dtype, reduce_dtype,
    peak_init_gib, peak_before_step_gib, peak_after_step_gib, peak_gib (the largest; the rank that needs the
    most decides whether it fits), the breakdown (param_gib, grad_gib, optimizer_state_gib, activations_gib =
    peak before the step minus the three), the closed-form expectations (expected_*_gib), num_params, trace,
    status and error. Out-of-memory on any rank gives ``status="oom"``; any other failure (a collective that
    hangs fails after ``timeout_s``; the whole run after ``deadline_s`` where given) ``status="failed"`` with
    the failing rank's cause (:func:`lab.parallel.runner.run`), so a sweep always completes.
    """
    autocast_dtype(dtype)  # a clear error for an unknown name
    sharded_parts(impl)  # validates the name
    name, cfg = model_config(size, context)
    row = dict(impl=impl, world_size=world_size, size=name, context=context, batch=batch, dtype=dtype,
               reduce_dtype=_reduce_dtype(impl, dtype, fsdp_reduce_dtype), peak_init_gib=math.nan,
               peak_before_step_gib=math.nan, peak_after_step_gib=math.nan, peak_gib=math.nan, trace=trace_path,
               status="ok", error="")
    try:
        per_rank = runner.run(runner.each_item, [impl], world_size,
                              lambda todo, progress: (memory_worker, todo, progress, cfg, batch, dtype, warmup,
                                                      trace_path, fsdp_reduce_dtype),
                              blank=lambda item, status, error: dict(status=status, error=error),
                              skip_failed=True, deadline_s=deadline_s, device=device, timeout_s=timeout_s)[0]
    except Exception as exc:  # noqa: BLE001 - a failed configuration is a row, not a crashed sweep
        row.update(status="oom" if is_oom(exc) else "failed", error=error_summary(exc, limit=300), trace=None)
        return row
    failed = [r for r in per_rank if r.get("status", "ok") != "ok"]
    if failed:
        row.update(status=failed[0]["status"], error=str(failed[0]["error"])[:300], trace=None)
        return row
    for key in ("peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"):
        row[key] = max(r[key] for r in per_rank)
    row["peak_gib"] = max(row["peak_init_gib"], row["peak_before_step_gib"], row["peak_after_step_gib"])
    num_params = per_rank[0]["num_params"]
    row["num_params"] = num_params
    for part in ("param", "grad", "optimizer_state"):
        row[f"{part}_gib"] = max(r[f"{part}_bytes"] for r in per_rank) / GiB
    row["activations_gib"] = row["peak_before_step_gib"] - row["param_gib"] - row["grad_gib"] - \
        row["optimizer_state_gib"]
    expected = expected_state_bytes(impl, num_params, world_size)
    row.update(expected_param_gib=expected["params"] / GiB, expected_grad_gib=expected["grads"] / GiB,
               expected_optimizer_state_gib=expected["optimizer_state"] / GiB)
    return row


# ----------------------------------------------------------------------------------------------------------
# step time, interleaved


def step_time_worker(impls: Sequence[str], cfg: ModelConfig, batch: int, dtype: str, interleaving: Interleaving,
                     fsdp_reduce_dtype: str | None = None, progress: runner.Progress | None = None) -> list[dict]:
    """Inside a launched process: the implementations' train steps taking turns
    (:func:`lab.bench.interleaved.time_interleaved`). Each turn's implementation trains its own model (built
    from the same seed, or copied from one built once when resident) with its own optimizer; returns this
    rank's timings, one row per impl (``impl``, ``status``, ``error``, ``steps_ms``), recorded in ``progress``
    (an error is charged to the implementation it happened in: :func:`lab.parallel.runner.run`)."""
    progress = progress or runner.Progress("")
    device = distributed.device()
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())
    base = None
    if interleaving.schedule == "resident":
        torch.manual_seed(0)
        with torch.device(device):
            base = TransformerLM(cfg)

    def builder(index: int, impl: str):
        def build():
            progress.start(index)
            if base is not None:
                model = copy.deepcopy(base)
            else:
                torch.manual_seed(0)
                with torch.device(device):
                    model = TransformerLM(cfg)
            runnable, opt, state = build_impl(impl, model, device, dtype, fsdp_reduce_dtype)
            step = TrainStep(runnable, opt, tokens, targets, dtype=dtype)
            return runner.entering(progress, index, step), closer(runnable, model, state)
        return build

    with progress.charging():
        timings = time_interleaved({impl: builder(i, impl) for i, impl in enumerate(impls)}, interleaving, device)
    return [progress.finish({"impl": impl, **timings[impl]}, i) for i, impl in enumerate(impls)]


def step_times(impls: Sequence[str], size: str | ModelConfig, world_size: int = 2, context: int = 512,
               batch: int = 2, dtype: str = "bf16", interleaving: Interleaving = Interleaving(),
               device: str = "auto", timeout_s: float = 600, fsdp_reduce_dtype: str | None = None,
               deadline_s: float | None = None) -> pd.DataFrame:
    """Step time of every implementation in ``impls``, interleaved in one launch: one row per impl with size,
    step_ms (median over rounds, each step at its slowest rank), step_q1_ms, step_q3_ms, step_iqr_ms, rounds,
    step_samples_ms (JSON list), schedule, status and error (out-of-memory is a row). An implementation that
    fails on a rank (or hangs in a collective past ``timeout_s``) is a ``failed`` row with the rank's cause,
    and the others are timed again, interleaved, in new processes (:func:`lab.parallel.runner.run`);
    ``deadline_s`` makes what is left past it ``failed`` rows."""
    for impl in impls:
        sharded_parts(impl)
    name, cfg = model_config(size, context)
    n = parameter_count(cfg)
    state = sum(expected_state_bytes(impl, n, world_size)["total"] for impl in impls)  # every model resident
    interleaving = resolve_schedule(interleaving, state, 1, device, world_size)
    per_impl = runner.run(step_time_worker, impls, world_size,
                          lambda todo, progress: (todo, cfg, batch, dtype, interleaving, fsdp_reduce_dtype, progress),
                          blank=lambda impl, status, error: dict(impl=impl, status=status, error=error, steps_ms=[]),
                          skip_failed=True, deadline_s=deadline_s, device=device, timeout_s=timeout_s)
    rows = []
    for impl, ranks in zip(impls, per_impl):
        rounds = combine_entry(ranks)
        rows.append(dict(impl=impl, size=name, **summarize_rounds(rounds["round_ms"]), schedule=interleaving.schedule,
                         status=rounds["status"], error=rounds["error"]))
    return pd.DataFrame(rows)



# ----------------------------------------------------------------------------------------------------------
# the benchmark


def run_sharding_benchmark(impls: Sequence[str] = IMPLS, sizes: Sequence[str | ModelConfig] = ("xl", "2.7B"),
                           world_size: int = 2, context: int = 512, batch: int = 2, dtype: str = "bf16",
                           interleaving: Interleaving = Interleaving(), warmup: int = 1, device: str = "auto",
                           artifacts_dir: str | None = None, profile_impl: str | None = "fsdp",
                           timeout_s: float = 600, progress: bool = True,
                           fsdp_reduce_dtype: str | None = None) -> pd.DataFrame:
    """For each size: every implementation's memory in fresh processes (:func:`memory_row`), then their step
    times interleaved in one launch (:func:`step_times`); one row per (size, impl) with the spec's
    ``sharding_benchmark`` columns (step_ms is the median over rounds) and the rest of both. A row's status
    is ``oom`` (or ``error``) when either measurement failed. ``profile_impl``'s memory run also profiles one
    step: its Chrome trace is ``<artifacts_dir>/sharding_<impl>_<size>.json`` (the ``trace`` column).
    """
    tables = []
    for size in progress_bar(sizes, "sharding benchmark", progress):
        name = size if isinstance(size, str) else "custom"
        rows = []
        for impl in impls:
            trace = None
            if artifacts_dir is not None and impl == profile_impl:
                trace = str(paths.artifacts_dir(artifacts_dir) / f"sharding_{impl}_{name}.json")
            rows.append(memory_row(impl, size, world_size, context, batch, dtype, warmup, device, trace, timeout_s,
                                   fsdp_reduce_dtype))
        memory = pd.DataFrame(rows)
        times = step_times(impls, size, world_size, context, batch, dtype, interleaving, device, timeout_s,
                           fsdp_reduce_dtype)
        merged = memory.merge(times.drop(columns=["size"]), on="impl", suffixes=("", "_timing"))
        failed = (merged["status"] == "ok") & (merged["status_timing"] != "ok")
        merged.loc[failed, "status"] = merged.loc[failed, "status_timing"]
        merged.loc[failed, "error"] = merged.loc[failed, "error_timing"]
        tables.append(merged.drop(columns=["status_timing", "error_timing"]))
    df = pd.concat(tables, ignore_index=True)
    if "trace" in df:
        df["trace"] = df["trace"].map(paths.repo_relative)
    return df


def memory_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Long table of measured vs closed-form GiB per rank for parameters, gradients and optimizer state,
    plus the measured activations (and transient buffers) at the peak before the step."""
    ok = df[df["status"] == "ok"]
    rows = []
    for _, r in ok.iterrows():
        for part, label in (("param", "parameters"), ("grad", "gradients"), ("optimizer_state", "optimizer state")):
            rows.append(dict(impl=r["impl"], size=r["size"], part=label, measured_gib=r[f"{part}_gib"],
                             expected_gib=r[f"expected_{part}_gib"]))
        rows.append(dict(impl=r["impl"], size=r["size"], part="activations + transients",
                         measured_gib=r["activations_gib"], expected_gib=math.nan))
    out = pd.DataFrame(rows, columns=["impl", "size", "part", "measured_gib", "expected_gib"])
    out["ratio"] = out["measured_gib"] / out["expected_gib"]
    return out


@dataclass(frozen=True)
class ShardingRun:
    """What notebook 08 measures: ``impls`` on each of ``sizes`` with ``world_size`` ranks of ``device``
    ("cuda": NCCL; "cpu": gloo), ``batch`` sequences of ``context`` tokens per rank under ``dtype`` autocast;
    step times with ``interleaving``; ``profile_impl``'s step profiled. ``note`` says where it runs and why
    (:func:`lab.book.ddp.bench.where_to_run`)."""

    device: str
    world_size: int
    sizes: tuple[str, ...]
    impls: tuple[str, ...] = IMPLS
    context: int = 512
    batch: int = 2
    dtype: str = "bf16"
    fsdp_reduce_dtype: str | None = None
    warmup: int = 1
    interleaving: Interleaving = field(default_factory=Interleaving)
    profile_impl: str | None = "fsdp"
    note: str = ""

    def params(self) -> dict:
        """The resolved settings, for a report's provenance."""
        return dict(run_device=self.device, world_size=self.world_size, sizes=list(self.sizes),
                    impls=list(self.impls), context=self.context, batch=self.batch, dtype=self.dtype,
                    fsdp_reduce_dtype=self.fsdp_reduce_dtype, memory_warmup=self.warmup,
                    **self.interleaving.params(), profile_impl=self.profile_impl)

    def measure(self, artifacts_dir: str | None = None) -> pd.DataFrame:
        """:func:`run_sharding_benchmark` with these settings."""
        return run_sharding_benchmark(self.impls, self.sizes, self.world_size, self.context, self.batch,
                                      self.dtype, self.interleaving, self.warmup, self.device, artifacts_dir,
                                      self.profile_impl, fsdp_reduce_dtype=self.fsdp_reduce_dtype)

    def expected_state(self) -> pd.DataFrame:
        """:func:`expected_state_table` for these sizes and implementations."""
        return expected_state_table(self.sizes, self.impls, self.world_size)


def plan_run(quick: bool, device: str = "auto", world_size: int = 2, sizes: Sequence[str] | None = None,
             impls: Sequence[str] = IMPLS, context: int | None = None, batch: int = 2, dtype: str = "bf16",
             fsdp_reduce_dtype: str | None = None, rounds: int | None = None, steps_per_round: int | None = None,
             warmup: int | None = None, schedule: str = "auto", profile_impl: str | None = "fsdp") -> ShardingRun:
    """The notebook's settings made concrete. Full profile on ``world_size`` GPUs: xl and 2.7B at context
    512, 6 rounds of 3 steps (rebuilt each turn unless all copies fit). Quick, or without enough GPUs: the
    tiny model at context 64 with gloo on the CPU, 20 rounds of 1 step. ``None`` picks these defaults."""
    on_gpu, note = where_to_run(quick, device, world_size)
    r, s, w = (6, 3, 2) if on_gpu else (20, 1, 1)
    interleaving = Interleaving(rounds=rounds or r, steps_per_round=steps_per_round or s,
                                warmup=w if warmup is None else warmup, schedule=schedule)
    return ShardingRun("cuda" if on_gpu else "cpu", world_size,
                       tuple(sizes or (("xl", "2.7B") if on_gpu else ("tiny",))), tuple(impls),
                       context or (512 if on_gpu else 64), batch, dtype, fsdp_reduce_dtype, interleaving.warmup,
                       interleaving, profile_impl, note)


def expected_state_table(sizes: Sequence[str], impls: Sequence[str] = IMPLS, world_size: int = 2) -> pd.DataFrame:
    """The closed form per (size, impl): params_M (millions, counted on the meta device) and params_gib,
    grads_gib, optimizer_state_gib, total_gib per rank (:func:`expected_state_bytes`)."""
    rows = []
    for size in sizes:
        n = parameter_count(model_config(size, 64)[1])
        for impl in impls:
            gib = {f"{k}_gib": v / GiB for k, v in expected_state_bytes(impl, n, world_size).items()}
            rows.append(dict(size=size, impl=impl, params_M=n / 1e6, **gib))
    return pd.DataFrame(rows)
