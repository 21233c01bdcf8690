"""Timing the recipes of :mod:`lab.recipes.fastest_step`: step time (``triton.testing.do_bench`` of one
complete step), peak memory and memory by category, tokens/s, MFU, and time by phase from one profiled
step. ``python -m lab.fastest`` is its command line.

Every recipe of one configuration runs in the same processes one after the other (the model rebuilt for
each), so the stock baseline and the book's step are measured side by side on the same GPUs in one run.
Out-of-memory is a row (``status="oom"``), never a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
import torch
from torch._dynamo.utils import counters

from lab import paths
from lab.bench.progress import progress_line
from lab.measure.device import available_memory_bytes, empty_cache, error_summary, is_oom, synchronize
from lab.measure.machine import busy_host
from lab.measure.profiling import PHASE_COLUMNS, gpu_kernel_times, phase_breakdown, profile_step
from lab.measure.timing import matmul_tflops, time_callable, time_kernel
from lab.measure.verdicts import MIN_SAMPLES, summarize
from lab.parallel import launcher, runner
from lab.parallel.gpu_pool import run_on_gpus
from lab.recipes.fastest_step import (
    ABLATION_BASE,
    CONFIGS,
    HEADLINE,
    Recipe,
    StepConfig,
    ablation_base,
    build_step,
    mfu,
    model_flops_per_step,
    step_traffic,
)
from lab.recipes.step_parts import uses_cuda_graphs, warm_up_cuda_graphs
from lab.units import GiB

#: Ablations profiled once like the headline steps: those that change where the step waits rather than which
#: kernels it runs (copies to and from the host, optimizer updates inside the backward), whose cost the phases
#: locate (idle time, slower kernels, or more of them) where a timed step only sums it.
PROFILED_ABLATIONS = ("optimizer_in_backward", "offload_quarter", "offload_half", "offload_all", "no_offload")


def profiled(name: str, headline: Sequence[str]) -> bool:
    """Whether the recipe ``name`` gets one profiled step: the headline recipes and :data:`PROFILED_ABLATIONS`."""
    return name in headline or name in PROFILED_ABLATIONS


def _state_bytes(step) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (sharded tensors count their local part)."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for p in step.model.parameters()]
    # an optimizer stepped inside the backward keeps its state in its inner optimizers
    optimizers = getattr(step.optimizer, "inner", [step.optimizer])
    state = [v for o in optimizers for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    return dict(params=sum(local(p) for p in params), grads=sum(local(p) for p in params),
                optimizer=sum(local(t) for t in state))


#: The CUDA caching allocator's settings for every recipe's processes, stock included: expandable segments
#: map more memory into a segment instead of caching fixed blocks, so freed memory is reused whatever its
#: size. Without them the book's leaderboard step can run out of memory on an 80 GB card with gigabytes
#: reserved but unallocated (fragmentation).
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def allocator_env() -> dict[str, str]:
    """The allocator settings for the ranks: the user's ``PYTORCH_CUDA_ALLOC_CONF`` where set, else
    :data:`ALLOCATOR`. Read once, before any launch thread starts (a launch sets the variable for a moment
    while its processes start)."""
    own = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return {"PYTORCH_CUDA_ALLOC_CONF": own} if own is not None else dict(ALLOCATOR)


def empty_row(config: StepConfig, recipe: Recipe, status: str = "ok", error: str = "") -> dict:
    """A recipe's row before anything is measured (and the row of one whose processes failed). The columns
    that say what a comparison holds fixed: ``precision`` (the recipe's), ``batch`` (sequences per step over
    all ranks) and ``context``; what a step sends within and across nodes (``step_traffic``);
    ``offload_bytes`` (per step and rank, to the host) and ``offload_wait_ms`` (per step, waiting for copies
    back; NaN without offloading); ``cuda_graphs`` (captured or not) and ``note`` (why a choice did not apply)."""
    return dict(impl=recipe.name, config=config.name, world_size=config.world_size, status=status, error=error,
                precision=recipe.precision, batch=config.batch_per_rank * config.world_size, context=config.context,
                step_ms=math.nan, step_spread_ms=math.nan, step_n=0, step_samples_ms=[], step_gpu_ms=math.nan,
                step_compute_gpu_ms=math.nan, first_step_s=math.nan,
                wall_s=math.nan, host_step_ms=math.nan, host_step_spread_ms=math.nan, host_step_n=0,
                host_step_samples_ms=[],
                peak_gib=math.nan, limit_gib=math.nan, params_gib=math.nan, grads_gib=math.nan, optimizer_gib=math.nan,
                activations_and_other_gib=math.nan, **dict.fromkeys(PHASE_COLUMNS, math.nan),
                other_kernels_top="", offload_bytes=math.nan, offload_wait_ms=math.nan, cuda_graphs=False, note="",
                **step_traffic(config, recipe), recipe=repr(recipe.for_world(config.world_size)))


def measure_recipe(config: StepConfig, recipe: Recipe, device: torch.device, warmup_ms: float = 1,
                   rep_ms: float = 3000, profile: bool = True, trace_dir: str | None = None, seed: int = 0,
                   host_steps: int = 0, host_reference: bool = False, samples: int = MIN_SAMPLES) -> dict:
    """One recipe on this rank: build, the first step (compilation and autotuning included), then
    ``triton.testing.do_bench`` of whole steps (``rep_ms`` of them; do_bench also runs five steps to estimate
    their time), or with ``host_steps`` that many steps timed by the host clock (cheaper, for ablations),
    the peak memory of those steps, memory by category, and one profiled step's phases. Returns this rank's
    row (``timer`` says which timer; ``wall_s``: from the build to the end of the timing; ``step_gpu_ms`` and
    ``step_compute_gpu_ms``: one more step's kernel time, with and without collectives). ``host_step_*`` are
    host-clock times: the ablations' own, and with ``host_reference`` two more steps of a do_bench-timed
    recipe, so that the ablations are compared with the book's step timed the same way. ``note`` says where
    CUDA graphs were asked for but not (all) captured: on the CPU, or graphs Inductor left out of them. A
    captured step is timed once :func:`lab.recipes.step_parts.warm_up_cuda_graphs` recorded its graphs, on a
    GPU with do_bench even as an ablation (like for like with the compiled step it captures)."""
    row = empty_row(config, recipe)
    rank = launcher.rank()
    row["cuda_graphs"] = uses_cuda_graphs(recipe.compile, device)
    if recipe.compile == "model_cudagraphs" and not row["cuda_graphs"]:
        row["note"] = "CUDA graphs need a GPU: the model compiled without them"
    skips = counters["inductor"]["cudagraph_skips"]
    empty_cache()
    step = None
    begun = time.perf_counter()
    try:
        step = build_step(config, recipe, device, seed, rank)
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        row["first_step_s"] = time.perf_counter() - start
        if row["cuda_graphs"]:
            warm_up_cuda_graphs(step, device)
        if row["cuda_graphs"] and counters["inductor"]["cudagraph_skips"] > skips:  # its log says why
            row["note"] = f"Inductor ran {counters['inductor']['cudagraph_skips'] - skips} graph(s) without CUDA graphs"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        offloader = getattr(step, "offloader", None)
        if device.type == "cuda" and (not host_steps or row["cuda_graphs"]):
            timing, row["timer"] = time_kernel(step, device, warmup_ms=warmup_ms, rep_ms=rep_ms), "do_bench"
        else:
            if offloader is not None:
                offloader.reset_stats()
            timing, row["timer"] = time_callable(step, warmup=0, steps=max(host_steps, samples), device=device), \
                "host"
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        s = summarize(timing.samples_ms)
        row.update(step_ms=s.median, step_spread_ms=s.spread, step_n=s.n, step_samples_ms=timing.samples_ms)
        row["wall_s"] = time.perf_counter() - begun
        if offloader is not None:
            row.update(_offload_per_step(step, offloader, len(timing.samples_ms) if row["timer"] == "host" else 0))
        if row["timer"] == "do_bench" and host_reference:
            timing = time_callable(step, warmup=0, steps=samples, device=device)
        if row["timer"] == "host" or host_reference:
            s = summarize(timing.samples_ms)
            row.update(host_step_ms=s.median, host_step_spread_ms=s.spread, host_step_n=s.n,
                       host_step_samples_ms=timing.samples_ms)
        # one more step for its kernels alone (every rank steps: collectives must match): how long the GPU ran
        # kernels, and kernels other than collectives (the GPU's own work, which another host does not change)
        times = gpu_kernel_times(step, device)
        row.update(step_gpu_ms=times["gpu_ms"], step_compute_gpu_ms=times["compute_ms"])
        state = _state_bytes(step)
        row.update({f"{k}_gib": v / GiB for k, v in state.items()})
        if row["peak_gib"] == row["peak_gib"]:
            row["activations_and_other_gib"] = row["peak_gib"] - sum(state.values()) / GiB
        if profile:
            row.update(_profile(step, trace_dir, f"fastest_{config.name}_{recipe.name}_rank{rank}.json"))
    except Exception as exc:  # noqa: BLE001 - out of memory is a result
        if not is_oom(exc):
            raise
        row.update(status="oom", error=error_summary(exc), limit_gib=available_memory_bytes(device) / GiB)
    step = None  # noqa: F841
    gc.collect()
    empty_cache()
    return row


def _offload_per_step(step, offloader, steps: int) -> dict:
    """``offload_bytes`` and ``offload_wait_ms`` per step: over the ``steps`` steps just timed, or (0: do_bench
    timed them, and counted them itself) over one more step."""
    if not steps:
        offloader.reset_stats()
        step()
    stats, steps = offloader.stats(), steps or 1
    return dict(offload_bytes=stats.bytes_offloaded / steps, offload_wait_ms=stats.wait_s * 1e3 / steps)


def _profile(step, trace_dir: str | None, name: str) -> dict:

    path = (Path(trace_dir) if trace_dir else paths.artifacts_dir("artifacts/traces")) / name
    profile_step(step, "train_step", warmup=0, steps=1, trace_path=path)
    return phase_breakdown(path)


def _announce(row: dict) -> dict:
    """On rank 0, a :func:`progress_line` for a recipe's row."""
    if launcher.rank() == 0:
        done = (f"{row['step_ms']:.1f} ms a step ({row['timer']})" if row["status"] == "ok"
                else str(row["error"]).split(":")[0])
        progress_line(f"fastest step: {row['config']} {row['impl']}: {row['status']}, {done}; first step "
                      f"{row['first_step_s']:.1f} s")
    return row


def fastest_worker(config: StepConfig, recipes: list[Recipe], warmup_ms: float, rep_ms: float, profile: bool,
                   trace_dir: str | None, headline: tuple[str, ...], fresh_cache: bool = False,
                   progress: runner.Progress | None = None, samples: int = MIN_SAMPLES) -> list[dict]:
    """Inside a launched process: every recipe in turn on this rank (the ``headline`` ones timed with
    do_bench and profiled, as are :data:`PROFILED_ABLATIONS`; the others with do_bench on one GPU, whose
    steps take milliseconds, and with :data:`~lab.measure.verdicts.MIN_SAMPLES` host-timed steps on several, whose
    steps take seconds; where both kinds run, each headline recipe with as many host-timed steps more, so that
    an ablation can be compared with any of them timed the same way);
    returns the rows, each also recorded in ``progress`` as it finishes (:func:`run_recipes`).
    ``fresh_cache``: compile into empty Inductor and Triton caches of this process's own
    (removed at the end), so the first recipe's ``first_step_s`` and ``wall_s`` include every compilation
    and autotuning from scratch, as the leaderboard's 10-minute rule counts them."""
    device = launcher.device()
    host_steps = {r.name: 0 if r.name in headline or config.world_size == 1 else samples for r in recipes}
    ablated = any(host_steps.values()) and any(r.name == "project" for r in recipes)
    fresh = (tempfile.TemporaryDirectory(prefix="lab_fastest_cache_", ignore_cleanup_errors=True) if fresh_cache
             else contextlib.nullcontext())
    with fresh as cache:
        caches = dict(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                      TRITON_CACHE_DIR=os.path.join(cache, "triton")) if cache else {}
        with launcher.environment(caches):  # a torchrun rank is this very process: its environment is restored
            return run_recipes(recipes, lambda r: measure_recipe(
                config, r, device, warmup_ms, rep_ms, profile and profiled(r.name, headline), trace_dir,
                host_steps=host_steps[r.name], host_reference=ablated and r.name in headline, samples=samples),
                progress or runner.Progress(""))


def run_recipes(recipes: Sequence[Recipe], measure, progress: runner.Progress) -> list[dict]:
    """``measure(recipe)`` of each recipe in turn on this rank (:func:`lab.parallel.runner.each`), each row
    recorded in ``progress`` and announced (:func:`_announce`) as it comes; on a rank of several launched
    processes, a recipe that ran out of memory ends the launch (:class:`lab.parallel.runner.StoppedAfterOOM`)."""
    return runner.each(recipes, measure, progress, announce=_announce)


def matmul_ceiling_tflops(device: torch.device | str = "cuda", n: int = 8192) -> float:
    """bf16 matmul rate of this GPU (TFLOP/s): ``triton.testing.do_bench`` median of an ``n^3`` product on
    random data; NaN on the CPU."""
    device = torch.device(device)
    return matmul_tflops(torch.bfloat16, n, device, rep_ms=200) if device.type == "cuda" else math.nan


def benchmark(config: str | StepConfig, recipes: Sequence[Recipe], world_size: int | None = None, device: str = "auto",
              warmup_ms: float = 1, rep_ms: float = 3000, profile: bool = True, trace_dir: str | None = None,
              peak_tflops: float | None = None, timeout_s: float = 1800,
              headline: Sequence[str] = HEADLINE, first_gpu: int = 0, deadline_s: float | None = None,
              fresh_cache: bool = False, env: dict[str, str] | None = None, samples: int = MIN_SAMPLES) -> pd.DataFrame:
    """Every recipe of the configuration on ``world_size`` ranks (default: the configuration's), side by side
    in the same processes. One row per recipe with ``impl``, ``config``, ``world_size``, ``step_ms`` (median
    over the timed steps of rank 0), ``step_spread_ms``, ``step_n``, ``peak_gib`` (the largest over ranks), memory by
    category on rank 0, phase times, ``tokens_per_s``, ``mfu`` (against ``peak_tflops`` per GPU: by default
    the bf16 matmul rate measured here, :func:`matmul_ceiling_tflops`; datasheet MFU in ``mfu_datasheet``).
    The ``headline`` recipes are timed with do_bench and profiled; the others (ablations) as
    :func:`fastest_worker` says (do_bench on one GPU, host-timed steps on several). On GPUs, rank ``r``
    drives GPU ``first_gpu + r`` (``gpus`` column).

    The ranks run with ``env`` (default :func:`allocator_env`; ``alloc_conf`` column).

    A recipe that runs out of memory on a rank ends the launch (its peers may wait in its collectives) and
    the next recipe is measured in new processes (compiling into the default caches).
    ``deadline_s``: ranks that hang or die past it (or fail otherwise) make every recipe they had not
    finished a row of ``status`` ``failed`` (the reason in ``error``) rather than an exception; the rows
    they finished are kept. ``fresh_cache``: the first recipe compiles
    from empty caches (:func:`fastest_worker`). ``samples``: the host-timed steps of a recipe (on the CPU every
    recipe's; do_bench gives at least as many on a GPU): fewer than the rule's minimum decide nothing, which a
    quick render whose interpreted kernels say nothing about GPUs can accept to stay quick."""
    config = CONFIGS[config] if isinstance(config, str) else config
    world_size = world_size or config.world_size
    if world_size != config.world_size:
        config = dataclasses.replace(config, world_size=world_size)

    env = allocator_env() if env is None else env
    per_recipe = runner.run(
        fastest_worker, recipes, world_size,
        lambda todo, progress: (config, todo, warmup_ms, rep_ms, profile, trace_dir, tuple(headline),
                                fresh_cache and progress.launch == 0, progress, samples),
        blank=lambda recipe, status, error: empty_row(config, recipe, status=status, error=error),
        deadline_s=deadline_s, device=device, timeout_s=timeout_s, first_gpu=first_gpu,
        env=None if launcher.is_torchrun() else env)
    if peak_tflops is None:
        peak_tflops = matmul_ceiling_tflops("cuda") if torch.cuda.is_available() else math.nan
    on_gpu = launcher.resolve_backend(world_size, None, device)[1] == "cuda"
    gpus = ",".join(str(first_gpu + r) for r in range(world_size)) if on_gpu else ""
    rows = []
    for ranks in per_recipe:
        row = dict(ranks[0])
        peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] == r["peak_gib"]]
        row["peak_gib"] = max(peaks) if peaks else math.nan
        if any(r["status"] == "oom" for r in ranks):
            row.update(status="oom", error=next(r["error"] for r in ranks if r["error"]))
        row["tokens_per_s"] = config.tokens_per_step / (row["step_ms"] * 1e-3) if row["step_ms"] else math.nan
        row["model_tflop_per_step"] = model_flops_per_step(config) / 1e12
        row["matmul_ceiling_tflops"] = peak_tflops
        row["mfu"] = mfu(config, row["step_ms"], peak_tflops)
        row["mfu_datasheet"] = mfu(config, row["step_ms"], 989.0)  # H100/H200 SXM dense bf16
        row["gpus"] = gpus
        row["alloc_conf"] = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
        rows.append(row)
    return pd.DataFrame(rows)


def plan(jobs: Mapping[str, Sequence[Recipe]], gpus: int,
         headline: Sequence[str] = HEADLINE) -> list[tuple[str, list[Recipe]]]:
    """How :func:`benchmark_configs` splits the work over a machine's ``gpus``: a list of (configuration,
    recipes), one launch group each. A configuration of several ranks has its ablations moved to a group of
    their own, led by :data:`ABLATION_BASE` (the book's step again, on their GPUs), where the machine has
    room for both halves of it at once (two of its world size) and for every configuration's ranks; that
    group comes right after its headline group. A one-GPU configuration's ablations (seconds a step) stay
    with its headline recipes."""
    configs = {name: CONFIGS[name] for name in jobs}
    out = []
    for name, recipes in jobs.items():
        top = [r for r in recipes if r.name in headline]
        rest = [r for r in recipes if r.name not in headline]
        project = next((r for r in recipes if r.name == "project"), None)
        world = configs[name].world_size
        roomy = world > 1 and gpus >= max(2 * world, sum(c.world_size for c in configs.values()))
        if rest and project is not None and roomy and top:
            out += [(name, top), (name, [ablation_base(project), *rest])]
        else:
            out.append((name, list(recipes)))
    return out


def benchmark_configs(jobs: Mapping[str, Sequence[Recipe]], device: str = "auto", ablation_deadline_s: float = 60,
                      rep_ms: float | Mapping[str, float] = 3000, busy: int = 0, **kwargs) -> pd.DataFrame:
    """:func:`benchmark` of each configuration (name -> its recipes), concatenated. On a machine with a GPU
    for every rank of every configuration (four for the leaderboard's two and the 2.7B's one), the launch
    groups of :func:`plan` run side by side, each on GPUs of its own as they come free
    (:func:`lab.parallel.gpu_pool.run_on_gpus`; their processes share only the host): the headline recipes
    compile from empty caches, and ablations on GPUs of their own become ``failed`` rows if their launch
    passes ``ablation_deadline_s`` per recipe. Otherwise everything runs one after the other in one launch
    per configuration (on GPUs, compiling from empty caches; a configuration of ablations only, its headline
    rows carried, with the same deadline). ``rep_ms``: do_bench's budget, or one per
    configuration. The matmul ceiling is measured first, on an idle GPU. ``busy``: that many processes keep
    host cores busy while the recipes run (:func:`lab.measure.machine.busy_host`; the rows' ``busy_host``)."""
    if not jobs:
        return pd.DataFrame()
    budget = rep_ms if isinstance(rep_ms, Mapping) else dict.fromkeys(jobs, rep_ms)
    if set(jobs) - set(budget):
        raise ValueError(f"rep_ms has no budget for {sorted(set(jobs) - set(budget))}")
    configs = {name: CONFIGS[name] for name in jobs}
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if gpus and "peak_tflops" not in kwargs:
        kwargs["peak_tflops"] = matmul_ceiling_tflops("cuda")  # with the host quiet too
    kwargs.setdefault("env", allocator_env())
    groups = plan(jobs, gpus)

    def extra(recipes):  # a group of ablations only (led by the book's step again) has a deadline
        ablations = recipes[0].name == ABLATION_BASE
        return dict(deadline_s=ablation_deadline_s * len(recipes)) if ablations else dict(fresh_cache=bool(gpus))

    def job(name, recipes):
        return configs[name].world_size, lambda first: benchmark(name, recipes, device=device, first_gpu=first,
                                                                  rep_ms=budget[name], **extra(recipes), **kwargs)

    with busy_host(busy):
        if not gpus or sum(c.world_size for c in configs.values()) > gpus or len(groups) < 2:
            parts = [benchmark(name, recipes, device=device, rep_ms=budget[name], **extra(recipes), **kwargs)
                     for name, recipes in jobs.items()]
        else:
            parts = run_on_gpus([job(n, r) for n, r in groups], gpus)
    table = pd.concat(parts, ignore_index=True)
    return table.assign(busy_host=busy) if busy else table


def results_table(df: pd.DataFrame) -> pd.DataFrame:
    """The spec's ``fastest_step.csv`` columns first; the samples kept as JSON lists (a comparison bootstraps
    them when the table is read back)."""
    first = ["impl", "config", "world_size", "step_ms", "peak_gib", "tokens_per_s", "mfu", "status"]
    df = df.assign(**{c: df[c].map(lambda x: json.dumps([round(float(v), 4) for v in x]) if isinstance(x, list)
                                   else x) for c in df.columns if c.endswith("_samples_ms")})
    return df[first + [c for c in df.columns if c not in first]]
