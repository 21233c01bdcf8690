"""Memory and time of data parallelism with and without sharding on a TransformerLM: six implementations,
all training with AdamW under the same autocast, one process per GPU:

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
  phase: model and optimizer construction (``peak_init``), then, in each of several steady-state steps,
  forward + backward (``peak_before_step``) and the optimizer step (``peak_after_step``): the steps are the
  samples of a peak, so that peaks compare under the same rule as times. The breakdown counts the bytes of
  this rank's parameter, gradient and optimizer-state tensors and compares them with the closed form
  (:func:`expected_state_bytes`). One more step of ``profile_impl`` can be profiled there (its trace).
* **step time** (:func:`step_times`): all implementations in the same processes, taking turns
  (:mod:`lab.bench.interleaved`), so host drift cannot rank them; each reports its median and spread over
  rounds, the torch baselines included.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Sequence

import pandas as pd
import torch

from lab import cli, paths
from lab.accounting import parameter_count
from lab.bench.distributed import check_command, model_config, resolve_schedule
from lab.bench.interleaved import Interleaving, closer, combine_entry, summarize_rounds, time_interleaved
from lab.bench.progress import progress_bar
from lab.dtypes import autocast_dtype
from lab.measure.device import available_memory_bytes, error_summary, is_oom
from lab.measure.profiling import gpu_kernel_times, profile_step
from lab.measure.results import save_results
from lab.measure.step import TrainStep, random_batch
from lab.measure.verdicts import summarize
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel import runner
from lab.parallel.ddp import torch_ddp
from lab.parallel.fsdp import FSDP
from lab.parallel.sharded_optimizer import ShardedOptimizer
from lab.parallel.zero1 import ZeRO1Optimizer
from lab.units import GiB

IMPLS = ("ddp", "sharded_optimizer", "zero1", "fsdp", "torch_zero", "torch_fsdp2")
#: The peaks measured in each steady-state step: before the optimizer step, after it, and the step's largest.
PEAKS = ("peak_before_step", "peak_after_step", "peak")
LR = 1e-4
WEIGHT_DECAY = 0.01
#: Every implementation's optimizer: torch's AdamW as constructed (foreach on CUDA), whose temporaries the
#: sharded optimizers' chunking bounds; the ledger keys a step by it.
OPTIMIZER = "AdamW, torch's default (foreach on CUDA)"


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


def build_impl(impl: str, model: TransformerLM, device: torch.device, dtype: str, fsdp_reduce_dtype: str | None = None):
    """Wrap ``model`` for ``impl``; returns ``(runnable model, optimizer, optimizer-state holder)``.

    ``fsdp_reduce_dtype`` ("fp32", "bf16", or None for the compute dtype) is the dtype :class:`lab.FSDP`
    reduce-scatters gradients in. None matches FSDP2's default policy (a bf16 ``param_dtype`` reduces in
    bf16), so the ``fsdp`` and ``torch_fsdp2`` rows move the same bytes; the shards' gradients are fp32.
    """

    adamw = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    if impl == "ddp":
        wrapped = torch_ddp(model)
        opt = torch.optim.AdamW(wrapped.parameters(), **adamw)
        return wrapped, opt, opt
    if impl == "sharded_optimizer":
        wrapped = torch_ddp(model)
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

        wrapped = torch_ddp(model)
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


def memory_worker(impl: str, cfg: ModelConfig, batch: int, dtype: str, warmup: int, steps: int = 5,
                  trace_path: str | None = None, fsdp_reduce_dtype: str | None = None) -> dict:
    """Inside a launched process: build ``impl``, run ``warmup`` steps (at least one: the optimizer state
    exists from then on), then ``steps`` steady-state steps in phases, reading the peak of each phase.

    Returns this rank's peaks (GiB: the construction's, and one per step before and after the optimizer step)
    and the bytes of its parameter / gradient / optimizer-state tensors; with ``trace_path``, one more step is
    profiled (rank 0 writes the Chrome trace there).
    """
    device = distributed.device()
    peaks = _Peaks(device)
    peaks.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    num_params = model.num_parameters()
    runnable, opt, state_holder = build_impl(impl, model, device, dtype, fsdp_reduce_dtype)
    out = {"rank": distributed.rank(), "num_params": num_params, "peak_init_gib": peaks.peak_gib(),
           "before_gib": [], "after_gib": []}
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())
    train_step = TrainStep(runnable, opt, tokens, targets, dtype=dtype)
    for _ in range(max(warmup, 1)):
        train_step()
    params = list(runnable.parameters())
    for _ in range(max(steps, 1)):
        peaks.reset()
        train_step.forward_backward()
        out["before_gib"].append(peaks.peak_gib())
        out["param_bytes"], out["grad_bytes"] = _bytes(params), _bytes(p.grad for p in params)
        peaks.reset()
        opt.step()
        out["after_gib"].append(peaks.peak_gib())
        out["optimizer_state_bytes"] = _bytes(t for s in state_holder.state.values() for t in s.values()
                                              if torch.is_tensor(t) and t.ndim > 0)
        opt.zero_grad(set_to_none=True)
    # one more step profiled for its kernels alone, on every rank (collectives must match): how long the GPU
    # ran kernels (``step_gpu_ms``: the host kept it busy or not) and kernels other than collectives
    # (``step_compute_gpu_ms``: its own work, which another host does not change); NaN off CUDA
    times = gpu_kernel_times(train_step, device)
    out["step_gpu_ms"], out["step_compute_gpu_ms"] = times["gpu_ms"], times["compute_ms"]
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
               deadline_s: float | None = None, steps: int = 5) -> dict:
    """Peak memory by phase of ``impl`` on ``size`` with ``world_size`` ranks, in fresh processes.

    ``batch`` is per rank. Returns impl, world_size, size, context, batch, dtype, reduce_dtype, peak_init_gib
    (construction), and for each of ``steps`` steady-state steps (the samples) peak_before_step, peak_after_step
    and peak (the largest of the three phases), each as ``<name>_gib`` (the median over steps), ``<name>_n`` and
    ``<name>_samples_gib`` (a JSON list), every step's peak at its largest rank (the rank that needs the most
    decides whether it fits); the breakdown (param_gib, grad_gib, optimizer_state_gib, activations_gib = peak
    before the step minus the three), the closed-form expectations (expected_*_gib), num_params, rank 0's
    step_gpu_ms and step_compute_gpu_ms (one more step's kernel time, with and without the collectives'
    kernels; NaN off CUDA), trace, status, error and limit_gib (the memory a rank had). Out-of-memory on any
    rank gives ``status="oom"``; any other failure (a collective that hangs fails after ``timeout_s``; the
    whole run after ``deadline_s`` where given) ``status="failed"`` with the failing rank's cause
    (:func:`lab.parallel.runner.run`), so a sweep always completes.
    """
    autocast_dtype(dtype)  # a clear error for an unknown name
    sharded_parts(impl)  # validates the name
    name, cfg = model_config(size, context)
    _, device_type = distributed.resolve_backend(world_size, device=device)
    row = dict(impl=impl, world_size=world_size, size=name, context=context, batch=batch, dtype=dtype,
               reduce_dtype=_reduce_dtype(impl, dtype, fsdp_reduce_dtype), peak_init_gib=math.nan,
               **{f"{k}_gib": math.nan for k in PEAKS}, step_gpu_ms=math.nan, step_compute_gpu_ms=math.nan,
               trace=trace_path, status="ok", error="",
               limit_gib=available_memory_bytes(device_type) / GiB)
    try:
        per_rank = runner.run(runner.each_item, [impl], world_size,
                              lambda todo, progress: (memory_worker, todo, progress, cfg, batch, dtype, warmup,
                                                      steps, trace_path, fsdp_reduce_dtype),
                              blank=lambda item, status, error: dict(status=status, error=error),
                              skip_failed=True, deadline_s=deadline_s, device=device, timeout_s=timeout_s)[0]
    except Exception as exc:  # noqa: BLE001 - a failed configuration is a row, not a crashed sweep
        row.update(status="oom" if is_oom(exc) else "failed", error=error_summary(exc, limit=300), trace=None)
        return row
    failed = [r for r in per_rank if r.get("status", "ok") != "ok"]
    if failed:
        row.update(status=failed[0]["status"], error=str(failed[0]["error"])[:300], trace=None)
        return row
    init = max(r["peak_init_gib"] for r in per_rank)
    before = [max(step) for step in zip(*(r["before_gib"] for r in per_rank))]
    after = [max(step) for step in zip(*(r["after_gib"] for r in per_rank))]
    row["peak_init_gib"] = init
    first = min(per_rank, key=lambda r: r["rank"])
    row["step_gpu_ms"], row["step_compute_gpu_ms"] = first["step_gpu_ms"], first["step_compute_gpu_ms"]
    for key, xs in zip(PEAKS, (before, after, [max(init, b, a) for b, a in zip(before, after)])):
        s = summarize(xs)
        row.update({f"{key}_gib": s.median, f"{key}_n": s.n, f"{key}_samples_gib": json.dumps(list(s.samples))})
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


def parser() -> cli.Parser:
    """The command line of ``python -m lab.bench.sharding``."""
    p = cli.Parser(prog="python -m lab.bench.sharding",
                   description="Peak memory by phase and interleaved step time of DDP, the sharded optimizer, "
                               "ZeRO-1, FSDP and torch's ZeroRedundancyOptimizer and FSDP2.")
    p.add_argument("--sizes", nargs="+", default=["xl", "2.7B"])
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--context", type=cli.positive_int, default=512)
    p.add_argument("--batch", type=cli.positive_int, default=2, help="sequences per rank")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--world-size", type=cli.positive_int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--rounds", type=cli.positive_int, default=6)
    p.add_argument("--steps-per-round", type=cli.positive_int, default=3)
    p.add_argument("--warmup", type=cli.non_negative_int, default=2)
    p.add_argument("--schedule", choices=["auto", "resident", "rebuild"], default="auto")
    p.add_argument("--results-dir", default=None, help="also save the rows as <dir>/sharding_benchmark.csv")
    return p


def sharding_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.bench.sharding --sizes 2.7B`` (2 GPUs by default): the arguments, output path, ranks and
    (on the CPU) memory are checked before any rank starts."""
    args = parser().parse_args(argv)
    check_command(args.sizes, args.context, args.batch, args.dtype, args.world_size, args.device,
                  results_dir=args.results_dir)
    interleaving = Interleaving(args.rounds, args.steps_per_round, args.warmup, args.schedule)
    df = run_sharding_benchmark(args.impls, args.sizes, args.world_size, args.context, args.batch, args.dtype,
                                interleaving, args.warmup, args.device)
    cols = ["size", "impl", "step_ms", "step_spread_ms", "step_n", "peak_gib", "peak_after_step_gib", "status"]
    print(df[cols].to_markdown(index=False, floatfmt=",.3f"))
    if args.results_dir:
        print(save_results(df, "sharding_benchmark", args.results_dir, vars(args), source="lab.bench.sharding"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`sharding_main`, every mistake answered in one line (see :mod:`lab.cli`)."""
    return cli.run(sharding_main, argv, prog="python -m lab.bench.sharding")


if __name__ == "__main__":
    sys.exit(main())
