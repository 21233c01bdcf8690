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

Each configuration runs in fresh processes (:func:`lab.parallel.launcher.launch`), so peaks are not polluted by
the previous one; an out-of-memory on any rank becomes a row with ``status="oom"``. Memory is the CUDA
caching allocator's ``max_memory_allocated`` with a reset before each phase: model and optimizer
construction (``peak_init``), forward + backward of a steady-state step (``peak_before_step``) and the
optimizer step (``peak_after_step``). The breakdown counts the bytes of this rank's parameter, gradient
and optimizer-state tensors and compares them with the closed form (:func:`expected_state_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm  # plain text bars: they render in papermill reports

from lab.dtypes import autocast_dtype
from lab.measure.device import error_summary, is_oom, synchronize
from lab.measure.profiling import quiet_profile
from lab.measure.step import TrainStep, lm_loss, random_batch
from lab.measure.timing import time_callable
from lab.measure.traces import read_trace
from lab.model import ModelConfig, TransformerLM, config_for
from lab.parallel import launcher as distributed

IMPLS = ("ddp", "sharded_optimizer", "zero1", "fsdp", "torch_zero", "torch_fsdp2")
GiB = 2**30
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


def build(impl: str, model: TransformerLM, device: torch.device, dtype: str, fsdp_reduce_dtype: str | None = None):
    """Wrap ``model`` for ``impl``; returns ``(runnable model, optimizer, optimizer-state holder)``.

    ``fsdp_reduce_dtype`` ("fp32", "bf16", or None for the compute dtype) is the dtype :class:`lab.FSDP`
    reduce-scatters gradients in. None matches FSDP2's default policy (a bf16 ``param_dtype`` reduces in
    bf16), so the ``fsdp`` and ``torch_fsdp2`` rows move the same bytes; the shards' gradients are fp32.
    """
    from lab.parallel.fsdp import FSDP
    from lab.parallel.sharded_optimizer import ShardedOptimizer
    from lab.parallel.zero1 import ZeRO1Optimizer

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
# the measurement, inside each launched process


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


def sharding_worker(impl: str, cfg: ModelConfig, batch: int, dtype: str, warmup: int, steps: int,
                    trace_path: str | None = None, fsdp_reduce_dtype: str | None = None) -> dict:
    """Inside a launched process: build ``impl``, measure memory by phase, time ``steps`` train steps.

    Returns this rank's measurements: peaks (GiB), the bytes of its parameter / gradient / optimizer-state
    tensors, every step time (ms), and, if ``trace_path`` is given, the profiler timeline of one more step
    (rank 0 writes the Chrome trace there and returns its intervals as rows; see :func:`lab.measure.traces.read_trace`).
    """
    device = distributed.device()
    peaks = _Peaks(device)
    peaks.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    num_params = model.num_parameters()
    runnable, opt, state_holder = build(impl, model, device, dtype, fsdp_reduce_dtype)
    out = {"rank": distributed.rank(), "num_params": num_params, "peak_init_gib": peaks.peak_gib()}
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())

    train_step = TrainStep(runnable, opt, tokens, targets, dtype=dtype)
    for _ in range(max(warmup, 1)):  # at least one step: the optimizer state exists from then on
        train_step()
    # one steady-state step in phases
    out["allocated_start_gib"] = peaks.allocated_gib()
    peaks.reset()
    train_step.forward_backward()
    out["peak_before_step_gib"] = peaks.peak_gib()
    params = [p for p in runnable.parameters()]
    out["param_bytes"] = _bytes(params)
    out["grad_bytes"] = _bytes(p.grad for p in params)
    peaks.reset()
    opt.step()
    out["peak_after_step_gib"] = peaks.peak_gib()
    out["optimizer_state_bytes"] = _bytes(t for s in state_holder.state.values() for t in s.values()
                                          if torch.is_tensor(t) and t.ndim > 0)
    opt.zero_grad(set_to_none=True)
    timing = time_callable(train_step, warmup=0, steps=steps, device=device)
    out["step_samples_ms"] = timing.samples_ms
    if trace_path is not None:
        out["timeline"] = _profile_one_step(train_step, device, trace_path)
    return out


def _profile_one_step(train_step, device: torch.device, trace_path: str) -> list[dict] | None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with quiet_profile(profile(activities=activities)) as prof:
        train_step()
        synchronize(device)
    if distributed.rank() != 0:
        return None
    Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(trace_path)
    return read_trace(trace_path).to_dict("records")


# ----------------------------------------------------------------------------------------------------------
# the sweep


def _config(size: str | ModelConfig, context: int) -> tuple[str, ModelConfig]:
    if isinstance(size, ModelConfig):
        return "custom", ModelConfig(**{**size.__dict__, "context_length": context})
    return size, config_for(size, context_length=context)


def run_config(impl: str, size: str | ModelConfig, world_size: int = 2, context: int = 512, batch: int = 2,
               dtype: str = "bf16", warmup: int = 2, steps: int = 5, device: str = "auto",
               trace_path: str | None = None, timeout_s: float = 180,
               fsdp_reduce_dtype: str | None = None) -> dict:
    """One row of the sharding benchmark: ``impl`` on ``size`` with ``world_size`` ranks (fresh processes).

    ``batch`` is per rank. Returns the spec's columns (impl, world_size, size, context, batch, dtype,
    step_ms, peak_init_gib, peak_before_step_gib, peak_after_step_gib, status) plus step_std_ms, peak_gib
    (the largest of the three), the
    breakdown (param_gib, grad_gib, optimizer_state_gib, activations_gib = peak before the step minus the
    three), the closed-form expectations (expected_*_gib), num_params, error, and ``timeline`` (a list of
    profiler rows) when ``trace_path`` is given. Out-of-memory on any rank gives ``status="oom"``; any other
    failure ``status="error"`` with the message, so a sweep always completes.
    """
    autocast_dtype(dtype)  # a clear error for an unknown name
    sharded_parts(impl)  # validates the name
    name, cfg = _config(size, context)
    row = dict(impl=impl, world_size=world_size, size=name, context=context, batch=batch, dtype=dtype,
               step_ms=math.nan, step_std_ms=math.nan, peak_init_gib=math.nan, peak_before_step_gib=math.nan,
               peak_after_step_gib=math.nan, peak_gib=math.nan, status="ok", error="")
    if impl == "fsdp":
        row["reduce_dtype"] = fsdp_reduce_dtype or dtype
    elif impl == "torch_fsdp2":
        row["reduce_dtype"] = dtype
    else:
        row["reduce_dtype"] = "fp32"
    try:
        per_rank = distributed.launch(sharding_worker, world_size, impl, cfg, batch, dtype, warmup, steps,
                                      trace_path, fsdp_reduce_dtype, device=device, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed configuration is a row, not a crashed sweep
        row.update(status="oom" if is_oom(exc) else "error", error=error_summary(exc, limit=300))
        return row
    # A step is over when its slowest rank is done: per step the max over ranks, then mean and std.
    samples = torch.tensor([r["step_samples_ms"] for r in per_rank], dtype=torch.float64).max(dim=0).values
    row["step_ms"] = samples.mean().item()
    row["step_std_ms"] = samples.std().item() if samples.numel() > 1 else 0.0
    for key in ("peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"):
        row[key] = max(r[key] for r in per_rank)  # the rank that needs the most memory decides whether it fits
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
    if trace_path is not None:
        row["timeline"] = per_rank[0].get("timeline")
    return row


def run_sharding_benchmark(impls: Sequence[str] = IMPLS, sizes: Sequence[str | ModelConfig] = ("xl", "2.7B"),
                           world_size: int = 2, context: int = 512, batch: int = 2, dtype: str = "bf16",
                           warmup: int = 2, steps: int = 5, device: str = "auto",
                           artifacts_dir: str | None = None, profile_impl: str | None = "fsdp",
                           timeout_s: float = 180, progress: bool = True,
                           fsdp_reduce_dtype: str | None = None) -> tuple[pd.DataFrame, dict]:
    """Every (size, impl) configuration through :func:`run_config`, with a tqdm progress bar.

    Returns ``(table, timelines)``: the table without the timeline column, and ``{size: timeline rows}``
    of ``profile_impl`` (its Chrome traces go to ``artifacts_dir/sharding_<impl>_<size>.json``).
    """
    from lab import paths

    rows, timelines = [], {}
    configs = [(s, i) for s in sizes for i in impls]
    for size, impl in tqdm(configs, desc="sharding benchmark", disable=not progress):
        trace = None
        if artifacts_dir is not None and impl == profile_impl:
            name = size if isinstance(size, str) else "custom"
            trace = str(paths.artifacts_dir(artifacts_dir) / f"sharding_{impl}_{name}.json")
        row = run_config(impl, size, world_size, context, batch, dtype, warmup, steps, device, trace, timeout_s,
                         fsdp_reduce_dtype)
        if row.get("timeline") is not None:
            timelines[row["size"]] = pd.DataFrame(row["timeline"])
        row.pop("timeline", None)
        rows.append(row)
    return pd.DataFrame(rows), timelines


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
    out = pd.DataFrame(rows)
    if not out.empty:
        out["ratio"] = out["measured_gib"] / out["expected_gib"]
    return out


# ----------------------------------------------------------------------------------------------------------
# communication volume, measured


def _average_gradients(model: torch.nn.Module) -> None:
    """DDP's gradient synchronization, unbucketed: all-reduce (sum) every gradient, divide by the world size."""
    import torch.distributed as dist

    from lab.parallel.sharded_optimizer import record_collective

    for p in model.parameters():
        if p.grad is not None:
            record_collective("all_reduce", p.grad)
            dist.all_reduce(p.grad)
            p.grad.div_(distributed.world_size())


def traffic_worker(cfg: ModelConfig, batch: int = 2) -> dict:
    """Inside a launched process: one training step of each schedule under a :class:`TrafficLog`.

    Returns ``{impl: {collective: ring bytes per rank}}`` for ddp (all-reduce of every gradient),
    sharded_optimizer, zero1 and fsdp (fp32), plus ``num_params``.
    """
    from lab.parallel.fsdp import FSDP
    from lab.parallel.sharded_optimizer import ShardedOptimizer, TrafficLog
    from lab.parallel.zero1 import ZeRO1Optimizer

    device, n = distributed.device(), distributed.world_size()
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())
    out: dict = {}
    for impl in ("ddp", "sharded_optimizer", "zero1", "fsdp"):
        torch.manual_seed(0)
        with torch.device(device):
            model = TransformerLM(cfg)
        out["num_params"] = model.num_parameters()
        if impl == "ddp":
            runnable, opt = model, torch.optim.AdamW(model.parameters(), lr=LR)
        elif impl == "sharded_optimizer":
            runnable, opt = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
        elif impl == "zero1":
            runnable, opt = model, ZeRO1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
        else:
            runnable = FSDP(model)
            opt = torch.optim.AdamW(runnable.parameters(), lr=LR)
        with TrafficLog() as log:
            lm_loss(runnable, tokens, targets).backward()
            if impl in ("ddp", "sharded_optimizer"):
                _average_gradients(model)
            opt.step()
        out[impl] = {op: log.bytes_per_rank(n, op) for op in log.summary()}
    return out


def measure_traffic(size: str | ModelConfig = "tiny", world_size: int = 2, context: int = 64,
                    device: str = "cpu") -> pd.DataFrame:
    """Bytes per rank of one step of each schedule, recorded from the collectives the code issues, next to
    :func:`lab.parallel.sharded_optimizer.optimizer_traffic`'s closed form (fp32 gradients and parameters).

    Columns: impl, collective, measured_bytes, expected_bytes (NaN for FSDP, which has no row in the
    optimizer closed form), measured_ratio_to_ddp.
    """
    from lab.parallel.sharded_optimizer import optimizer_traffic

    _, cfg = _config(size, context)
    res = distributed.launch(traffic_worker, world_size, cfg, device=device)[0]
    closed = optimizer_traffic(res["num_params"], world_size).set_index("impl")
    rows = []
    for impl in ("ddp", "sharded_optimizer", "zero1", "fsdp"):
        for op, measured in res[impl].items():
            expected = math.nan
            if impl in closed.index:
                c = closed.loc[impl]
                expected = c["gradient_bytes"] if op == c["gradient_collective"] else \
                    c["parameter_bytes"] if op == c["parameter_collective"] else math.nan
            rows.append(dict(impl=impl, collective=op, measured_bytes=measured, expected_bytes=expected))
    df = pd.DataFrame(rows)
    totals = df.groupby("impl", sort=False)["measured_bytes"].sum()
    df["measured_ratio_to_ddp"] = df["impl"].map(totals / totals["ddp"])
    return df


# ----------------------------------------------------------------------------------------------------------
# the performance goals, checked on the table


def performance_goals(df: pd.DataFrame) -> pd.DataFrame:
    """The 08 notebook's goals, per model size, from a :func:`run_sharding_benchmark` table.

    1. the sharded optimizer and ZeRO-1 use no more memory after the step than ``torch_zero`` and step at
       least as fast; 2. ``fsdp`` steps at least as fast as ``torch_fsdp2`` with at most 1.1x its peak memory.
    Returns rows: size, goal, impl, value, reference, met (bool, or None where a number is missing, e.g.
    peak memory on the CPU or an OOM row).
    """
    ok = df[df["status"] == "ok"].set_index(["size", "impl"])
    rows = []

    def check(size, goal, impl, ref_impl, column, factor=1.0):
        value = ok[column].get((size, impl), math.nan)
        reference = ok[column].get((size, ref_impl), math.nan)
        met = None if (pd.isna(value) or pd.isna(reference)) else bool(value <= factor * reference)
        rows.append(dict(size=size, goal=goal, impl=impl, reference_impl=ref_impl, value=value,
                         reference=reference, met=met))

    for size in dict.fromkeys(df["size"]):
        for impl in ("sharded_optimizer", "zero1"):
            check(size, "peak after step <= torch_zero", impl, "torch_zero", "peak_after_step_gib")
            check(size, "step time <= torch_zero", impl, "torch_zero", "step_ms")
        check(size, "step time <= torch_fsdp2", "fsdp", "torch_fsdp2", "step_ms")
        check(size, "peak memory <= 1.1 x torch_fsdp2", "fsdp", "torch_fsdp2", "peak_gib", 1.1)
    return pd.DataFrame(rows)
