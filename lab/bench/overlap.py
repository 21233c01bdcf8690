"""Does hiding the optimizer and the gradients' communication behind the backward pay? Two comparisons, each
timed interleaved (:mod:`lab.bench.interleaved`: the entries take turns round after round in the same
processes, so host drift cannot rank them) and reported as medians over rounds with their spread:

* ``one_gpu``: the book's 2.7B step on one GPU (the whole model compiled, bf16 parameters), the same compiled
  block by block, with the optimizer inside the backward, each clipped by the global norm, and the stock
  compiled step at the same precision (:func:`one_gpu_plan`);
* ``ddp``: chapter 07's step (fp32 master weights under bf16 autocast, eager) on several ranks with
  ``lab.DDPBucketed`` in reverse registration order, in the backward's order, with bf16 communication and with
  the optimizer inside the backward; torch DDP with and without bf16 communication; one GPU alone, the ideal a
  data-parallel step approaches (:func:`ddp_plan`).

Every entry is a :class:`lab.recipes.recipe.Recipe` built by :func:`lab.recipes.fastest_step.build_step`, so the
switches timed here are the ones chapter 10 ablates. After the timing each entry is built once more: it trains
``loss_steps`` steps from the same weights on fresh batches (the global loss per token of each step: what bf16
communication does to the loss), then one profiled step on rank 0 gives its communication time, the share of it
that overlapped compute (:func:`lab.measure.traces.step_overlap`) and the fused AdamW kernels' time and the part
of it that overlapped other kernels (:func:`optimizer_overlap`).

``python -m lab.bench.overlap --part one_gpu --size 2.7B --results-dir DIR`` and ``--part ddp --size 2.7B
--world-size 2`` (``--compile block``: the same step with each block compiled, so that the kernels rather than
the host's launches set its pace); ``tools/overlap_check.sh`` runs the whole measurement on a GPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

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
from lab.measure.device import available_memory_bytes, error_summary, is_oom, synchronize
from lab.measure.machine import busy_host
from lab.measure.profiling import PHASE_COLUMNS, phase_breakdown, profile_step
from lab.measure.results import save_results
from lab.measure.step import random_batch
from lab.measure.traces import intersect_intervals, intervals_length, read_trace, step_overlap, union_intervals
from lab.measure.verdicts import compare_paired
from lab.model import ModelConfig, config_for
from lab.parallel import launcher, runner
from lab.recipes.fastest_step import StepConfig, build_step
from lab.recipes.recipe import (
    PROJECT_ONE_GPU,
    STOCK_ONE_GPU_COMPILED_BF16,
    Recipe,
    ablations,
    compared_with,
    overlap_ablations,
)

PARTS = ("one_gpu", "ddp")
#: Per part, the entry every row is also compared with: the goal's reference.
BASELINE = {"one_gpu": "stock_compiled_bf16", "ddp": "single_gpu"}
#: Bytes per parameter of one built entry: fp32 weights, gradients, AdamW's moments, a bf16 bucket (data
#: parallel); bf16 weights, gradients and moments (one GPU).
BYTES_PER_PARAM = {"ddp": 4 + 4 + 8 + 2, "one_gpu": 2 + 2 + 4}


@dataclass(frozen=True)
class Entry:
    """One timed step: its ``name``, the ``recipe`` that builds it, the entry it is read against
    (``reference``: one choice changed; None for none) and whether it runs on rank 0 alone (``solo``)."""

    name: str
    recipe: Recipe
    reference: str | None = None
    solo: bool = False


def one_gpu_plan(project: Recipe = PROJECT_ONE_GPU) -> list[Entry]:
    """The book's one-GPU step, its overlap ablations (:func:`lab.recipes.recipe.overlap_ablations`, each read
    against what :func:`~lab.recipes.recipe.compared_with` names), ``optimizer_in_backward`` and the stock
    compiled step at bf16 parameters."""
    wanted = ("block_compile", "optimizer_in_backward", "clip_grad_norm", "optimizer_in_backward_clipped")
    variants = {r.name: r for r in ablations(project) + overlap_ablations(project) if r.name in wanted}
    entries = [Entry("project", project, BASELINE["one_gpu"])]
    entries += [Entry(n, variants[n], compared_with(variants[n], project)) for n in wanted if n in variants]
    return entries + [Entry("stock_compiled_bf16", STOCK_ONE_GPU_COMPILED_BF16)]


#: Chapter 07's step as a recipe: the model's own loss on materialized logits, fp32 master weights under bf16
#: autocast, eager, nothing recomputed.
DDP_STEP = Recipe("ddp_ready", attention="sdpa", fused_loss=False, sharding="ddp", checkpoint="none", compile="none",
                  precision="bf16_autocast")


def ddp_plan(bucket_mb: float = 25.0, step: Recipe = DDP_STEP) -> list[Entry]:
    """Chapter 07's step on one GPU (rank 0 alone), under torch DDP (with and without its bf16 compression
    hook) and under ``lab.DDPBucketed`` at ``bucket_mb`` MiB: reverse registration order, the backward's order,
    bf16 communication, and the optimizer inside the backward; each read against the entry one choice away."""
    base = dataclasses.replace(step, bucket_mb=bucket_mb)

    def variant(name: str, **change) -> Recipe:
        return dataclasses.replace(base, name=name, **change)

    return [Entry("single_gpu", variant("single_gpu", sharding="none"), solo=True),
            Entry("torch_ddp", variant("torch_ddp", sharding="torch_ddp"), "single_gpu"),
            Entry("torch_ddp_bf16", variant("torch_ddp_bf16", sharding="torch_ddp", reduce_dtype="bf16"), "torch_ddp"),
            Entry("ddp_reverse", variant("ddp_reverse", bucket_order="reverse"), "torch_ddp"),
            Entry("ddp_ready", base, "ddp_reverse"),
            Entry("ddp_ready_bf16", variant("ddp_ready_bf16", reduce_dtype="bf16"), "ddp_ready"),
            Entry("ddp_ready_bf16_in_backward", variant("ddp_ready_bf16_in_backward", reduce_dtype="bf16",
                                                        optimizer_in_backward=True), "ddp_ready_bf16")]


#: How chapter 07's step may be compiled in the ``ddp`` part: eager (the chapter's own step, whose launches
#: from the host can outlast its kernels), or each block compiled (few launches: the kernels set the pace).
DDP_COMPILES = ("none", "block")


def plan_for(part: str, bucket_mb: float = 25.0, compile: str = "none") -> list[Entry]:
    """The entries of ``part`` (:data:`PARTS`); ``compile`` (:data:`DDP_COMPILES`) applies to the ``ddp`` part."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    if compile not in DDP_COMPILES:
        raise ValueError(f"compile must be one of {', '.join(DDP_COMPILES)}, got {compile!r}")
    if part == "one_gpu" and compile != "none":
        raise ValueError("--compile applies to the ddp part only (the one_gpu part times its own compile choices)")
    return one_gpu_plan() if part == "one_gpu" else ddp_plan(bucket_mb, dataclasses.replace(DDP_STEP, compile=compile))


# ----------------------------------------------------------------------------------------------------------
# what a profiled step says


def optimizer_overlap(timeline: pd.DataFrame) -> dict[str, float]:
    """``optimizer_ms``: the time the fused AdamW kernels ran (their names hold ``adam``; the union of their
    intervals), and ``optimizer_overlapped_ms``: the part of it during which another compute kernel ran on
    another stream (the update hidden behind the backward), from a :func:`lab.measure.traces.read_trace`
    timeline (ms; 0 where no such kernel ran)."""
    compute = timeline[timeline["kind"] == "compute"]
    adam = compute["name"].str.contains("adam", case=False)

    def spans(rows: pd.DataFrame) -> list[tuple[float, float]]:
        return union_intervals(zip(rows["start_ms"], rows["start_ms"] + rows["dur_ms"]))

    updates = compute[adam]
    others = compute[~adam & ~compute["lane"].isin(set(updates["lane"]))]
    hidden = intersect_intervals(spans(updates), spans(others))
    return dict(optimizer_ms=intervals_length(spans(updates)), optimizer_overlapped_ms=intervals_length(hidden))


def _profile(step, path: Path) -> dict:
    profile_step(step, "train_step", warmup=0, steps=1, trace_path=path)
    trace = json.loads(path.read_text())  # read once, for the timeline and the phases
    timeline = read_trace(trace)
    summary = step_overlap(timeline)
    phases = {k: v for k, v in phase_breakdown(trace, 1, summary).items() if k in PHASE_COLUMNS and k != "optimizer_ms"}
    return dict(comm_ms=summary["communication_ms"], overlap_frac=summary["overlap_share"],
                **phases, **optimizer_overlap(timeline), trace=str(path))  # the update's own time is the union


# ----------------------------------------------------------------------------------------------------------
# inside each rank


def loss_curve(step, config: StepConfig, steps: int, rank: int, world: int) -> list[float]:
    """``steps`` training steps of a fresh ``step``, each on fresh batches (the same on every entry); returns
    each step's global loss per token (the mean over the ranks' summed losses)."""
    losses = []
    tokens_per_step = config.batch_per_rank * config.context * world
    for i in range(steps):
        step.tokens, step.targets = random_batch(config.model, config.batch_per_rank, step.device, config.context,
                                                 seed=10_000 + i * world + rank)
        step.model.zero_grad(set_to_none=True)
        loss = step.forward()
        step.backward(loss)
        step.optimizer_step()
        total = loss.detach().float().reshape(1)
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / tokens_per_step)
    return losses


def overlap_worker(plan: list[Entry], config: StepConfig, interleaving: Interleaving, trace_dir: str,
                   loss_steps: int = 0, profile: bool = True, progress: runner.Progress | None = None) -> list[dict]:
    """Inside a launched process: time the entries of ``plan`` interleaved (``solo`` ones on rank 0 alone),
    then build each once more for its loss curve (``loss_steps``; not for solo entries) and, on rank 0, one
    profiled step (the other ranks step along). Returns one row per entry: ``status``, ``error``, this rank's
    ``timing`` (:func:`lab.bench.interleaved.time_interleaved`), ``losses`` and rank 0's ``profile``."""
    progress = progress or runner.Progress("")
    rank, world, device = launcher.rank(), launcher.world_size(), launcher.device()

    def builder(index: int, entry: Entry):
        def build():
            progress.start(index)
            step = build_step(config, entry.recipe, device, rank=rank)
            return runner.entering(progress, index, step), closer(step.model, step.model, step.optimizer)
        return build

    builders = {e.name: builder(i, e) for i, e in enumerate(plan)}
    with progress.charging():
        timings = time_interleaved(builders, interleaving, device, solo={e.name for e in plan if e.solo})
    rows = []
    for index, entry in enumerate(plan):
        row = dict(status=timings[entry.name]["status"], error=timings[entry.name]["error"],
                   timing=timings[entry.name], losses=[], profile={})
        here = rank == 0 or not entry.solo
        if row["status"] == "ok" and here and (profile or (loss_steps and not entry.solo)):
            progress.start(index)
            step = build_step(config, entry.recipe, device, rank=rank)
            try:
                if loss_steps and not entry.solo:
                    row["losses"] = loss_curve(step, config, loss_steps, rank, world)
                if profile:
                    step()  # the first step after a build allocates the optimizer's state
                    if rank == 0:
                        row["profile"] = _profile(step, Path(trace_dir) / f"overlap_{config.name}_{entry.name}.json")
                    else:
                        step()
                synchronize(device)
            except Exception as exc:  # noqa: BLE001 - out of memory is a result
                if not is_oom(exc):
                    raise
                row["profile"] = dict(error=error_summary(exc))
            closer(step.model, step.model, step.optimizer)()
            del step
        if entry.solo and world > 1:
            dist.barrier()  # the other ranks waited for rank 0's solo entry
        rows.append(progress.finish(row, index))
    return rows


# ----------------------------------------------------------------------------------------------------------
# the measurement


def step_config(size: str | ModelConfig, context: int, batch: int, world_size: int) -> StepConfig:
    """The :class:`StepConfig` of a size name (or an explicit model configuration) at ``context`` tokens, with
    ``batch`` sequences per rank on ``world_size`` ranks."""
    name, cfg = (size, config_for(size, context_length=context)) if isinstance(size, str) else (
        "custom", dataclasses.replace(size, context_length=context))
    return StepConfig(name, cfg, context, batch, world_size)


def _comparison(samples: dict[str, list[float]], subject: str, reference: str | None, prefix: str) -> dict:
    """``subject``'s rounds against ``reference``'s, paired by round (:func:`lab.measure.verdicts.compare_paired`),
    as columns."""
    if reference is None or not samples.get(subject) or not samples.get(reference):
        ratio, low, high, verdict = math.nan, math.nan, math.nan, ""
    else:
        c = compare_paired(samples[subject], samples[reference])
        ratio, low, high, verdict = c.ratio, c.low, c.high, c.verdict
    return {f"{prefix}_ratio": ratio, f"{prefix}_low": low, f"{prefix}_high": high, f"{prefix}_verdict": verdict}


def measure(part: str, size: str | ModelConfig = "2.7B", context: int = 512, batch: int | None = None,
            world_size: int | None = None, device: str = "auto", interleaving: Interleaving = Interleaving(),
            bucket_mb: float = 25.0, loss_steps: int = 10, profile: bool = True, artifacts_dir: str = "artifacts",
            timeout_s: float = 600, plan: list[Entry] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Time the entries of ``part`` (:func:`plan_for`): ``one_gpu`` on one rank (batch 4 per step by default),
    ``ddp`` on ``world_size`` ranks (default 2; batch 2 per rank by default). Returns two tables: one row per
    entry (``entry``, ``reference``, ``part``, ``size``, ``context``, ``batch`` per rank, ``world_size`` (1 for
    the solo entry), ``precision``, the rounds as :func:`lab.bench.interleaved.summarize_rounds` records them
    (``step_ms`` the median), ``schedule``; ``vs_reference_ratio``, ``_low``, ``_high`` and ``_verdict`` against
    the entry's ``reference`` and ``vs_baseline_*`` against :data:`BASELINE` (paired by round,
    :func:`lab.measure.verdicts.compare_paired`); ``comm_ms``, ``overlap_frac``, ``optimizer_ms``,
    ``optimizer_overlapped_ms`` and ``trace`` from the profiled step; ``loss_first``/``loss_last``; ``recipe``,
    ``status``, ``error``), and the loss curves (``entry``, ``step``, ``loss``). ``plan`` replaces the part's
    entries (e.g. eager ones for a quick check)."""
    plan = plan_for(part, bucket_mb) if plan is None else plan
    world = (1 if part == "one_gpu" else 2) if world_size is None else world_size
    if part == "one_gpu" and world != 1:
        raise ValueError(f"the one_gpu part runs on one rank, not {world}")
    config = step_config(size, context, batch or (4 if part == "one_gpu" else 2), world)
    if interleaving.schedule == "auto":
        _, device_type = launcher.resolve_backend(world, device=device)
        available = available_memory_bytes(device_type) / (world if device_type == "cpu" else 1)
        schedule = choose_schedule(parameter_count(config.model) * BYTES_PER_PARAM[part], len(plan), available)
        interleaving = dataclasses.replace(interleaving, schedule=schedule)
    trace_dir = str(paths.artifacts_dir(Path(artifacts_dir) / "overlap_traces"))
    per_entry = runner.run(
        overlap_worker, plan, world,
        lambda todo, progress: (todo, config, interleaving, trace_dir, loss_steps, profile, progress),
        blank=lambda entry, status, error: dict(status=status, error=error, timing=dict(status=status, error=error),
                                                losses=[], profile={}),
        skip_failed=True, device=device, timeout_s=timeout_s)
    timings = {e.name: combine_entry([r["timing"] for r in ranks]) for e, ranks in zip(plan, per_entry)}
    samples = {name: t["round_ms"] for name, t in timings.items()}
    rows, losses = [], []
    for entry, ranks in zip(plan, per_entry):
        timing, first = timings[entry.name], ranks[0]
        profile_row = first.get("profile", {})
        curve = first.get("losses", [])
        losses += [dict(entry=entry.name, step=i, loss=v) for i, v in enumerate(curve)]
        rows.append(dict(entry=entry.name, reference=entry.reference or "", part=part, size=config.name,
                         context=context, batch=config.batch_per_rank, world_size=1 if entry.solo else world,
                         precision=entry.recipe.precision, **summarize_rounds(timing["round_ms"]),
                         schedule=interleaving.schedule,
                         **_comparison(samples, entry.name, entry.reference, "vs_reference"),
                         **_comparison(samples, entry.name, BASELINE[part] if entry.name != BASELINE[part] else None,
                                       "vs_baseline"),
                         comm_ms=profile_row.get("comm_ms", math.nan), overlap_frac=profile_row.get("overlap_frac",
                                                                                                     math.nan),
                         optimizer_ms=profile_row.get("optimizer_ms", math.nan),
                         optimizer_overlapped_ms=profile_row.get("optimizer_overlapped_ms", math.nan),
                         **{c: profile_row.get(c, math.nan) for c in PHASE_COLUMNS if c != "optimizer_ms"},
                         trace=paths.repo_relative(profile_row.get("trace")),
                         loss_first=curve[0] if curve else math.nan, loss_last=curve[-1] if curve else math.nan,
                         recipe=repr(entry.recipe), status=timing["status"],
                         error=timing["error"] or profile_row.get("error", "")))
    return pd.DataFrame(rows), pd.DataFrame(losses, columns=["entry", "step", "loss"])


# ----------------------------------------------------------------------------------------------------------
# the command line


def table_name(part: str, size: str, compile: str = "none", busy_host: int = 0) -> str:
    """The results table of one part at one size: ``overlap_ddp_2.7B``, ``overlap_ddp_2.7B_block`` with the
    blocks compiled, ``..._busy16`` timed beside 16 busy neighbours (its losses: ``..._loss``)."""
    return (f"overlap_{part}_{size}" + ("" if compile == "none" else f"_{compile}")
            + (f"_busy{busy_host}" if busy_host else ""))


def parser() -> cli.Parser:
    """The command line of ``python -m lab.bench.overlap``."""
    p = cli.Parser(prog="python -m lab.bench.overlap",
                   description="Time the optimizer inside the backward and DDP's hidden communication, interleaved.")
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--size", default="2.7B")
    p.add_argument("--context", type=cli.positive_int, default=512)
    p.add_argument("--batch", type=cli.positive_int, default=None, help="sequences per rank (one_gpu 4, ddp 2)")
    p.add_argument("--world-size", type=cli.positive_int, default=None, help="ranks of the ddp part (2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--bucket-mb", type=cli.positive_float, default=25.0)
    p.add_argument("--compile", choices=DDP_COMPILES, default="none",
                   help="ddp part: chapter 07's step eager (none) or compiled block by block")
    p.add_argument("--rounds", type=cli.positive_int, default=6)
    p.add_argument("--steps-per-round", type=cli.positive_int, default=3)
    p.add_argument("--warmup", type=cli.non_negative_int, default=2)
    p.add_argument("--schedule", choices=["auto", "resident", "rebuild"], default="auto")
    p.add_argument("--entries", nargs="+", default=None, metavar="NAME",
                   help="time only these entries of the part (keep each one's reference beside it)")
    p.add_argument("--loss-steps", type=cli.non_negative_int, default=10)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step of each entry")
    p.add_argument("--busy-host", type=cli.non_negative_int, default=0, metavar="N",
                   help="time beside N processes that each keep a host core busy (lab.measure.machine.busy_host): "
                        "does the verdict hold when the host is not the step's alone?")
    p.add_argument("--timeout-s", type=cli.positive_float, default=600)
    p.add_argument("--artifacts-dir", default="artifacts")
    p.add_argument("--results-dir", default=None,
                   help="save the rows as <dir>/overlap_<part>_<size>.csv, the losses as ..._loss.csv")
    return p


def overlap_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.bench.overlap --part ddp --size 2.7B --results-dir $OUT``: the arguments, output paths
    and ranks are checked before any rank starts."""
    args = parser().parse_args(argv)
    try:
        config_for(args.size)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = ("cuda" if gpus else "cpu") if args.device == "auto" else args.device
    if args.part == "one_gpu" and args.world_size not in (None, 1):
        raise cli.UsageError("--part one_gpu runs on one rank: leave --world-size out")
    cli.check_ranks([args.world_size or (1 if args.part == "one_gpu" else 2)], device, gpus)
    for flag in ("results_dir", "artifacts_dir"):
        if getattr(args, flag):
            cli.writable_dir(getattr(args, flag), "--" + flag.replace("_", "-"))
    try:
        plan = plan_for(args.part, args.bucket_mb, args.compile)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    if args.entries:
        unknown = [n for n in args.entries if n not in {e.name for e in plan}]
        if unknown:
            raise cli.UsageError(f"--entries: {', '.join(unknown)} not in the {args.part} part "
                                 f"({', '.join(e.name for e in plan)})")
        plan = [e for e in plan if e.name in args.entries]
    interleaving = Interleaving(args.rounds, args.steps_per_round, args.warmup, args.schedule)
    with busy_host(args.busy_host) as neighbours:
        if neighbours:
            print(f"the host is kept busy by {len(neighbours)} neighbours (pids {', '.join(map(str, neighbours))})",
                  flush=True)
        table, losses = measure(args.part, args.size, args.context, args.batch, args.world_size, args.device,
                                interleaving, args.bucket_mb, args.loss_steps, not args.no_profile,
                                args.artifacts_dir, args.timeout_s, plan)
    table["busy_host"] = args.busy_host
    cols = ["entry", "reference", "step_ms", "step_spread_ms", "step_n", "vs_reference_ratio", "vs_reference_verdict",
            "vs_baseline_ratio", "comm_ms", "overlap_frac", "optimizer_ms", "optimizer_overlapped_ms", "loss_last",
            "status"]
    print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if args.results_dir:
        name, params = table_name(args.part, args.size, args.compile, args.busy_host), dict(vars(args))
        print(save_results(table, name, args.results_dir, params, source="lab.bench.overlap"))
        print(save_results(losses, f"{name}_loss", args.results_dir, params, source="lab.bench.overlap"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run :func:`overlap_main`, every mistake answered in one line (see :mod:`lab.cli`)."""
    return cli.run(overlap_main, argv, prog="python -m lab.bench.overlap")


if __name__ == "__main__":
    sys.exit(main())
