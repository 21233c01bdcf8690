"""Interleaved timing: several implementations of one training step timed in the same processes, taking
turns, so that they all see the same host and device conditions.

Why: a 2-rank step at a small batch is often host-bound, and the host's load drifts. Timing each
implementation in a block of steps of its own (or in a launch of its own) then ranks them by *when* they
ran as much as by what they do: the same configuration measured minutes apart can differ by tens of
percent, while its memory repeats to the byte. Taking turns removes that drift from the comparison, and
repeating the turns gives a spread to judge differences against (:mod:`lab.measure.verdicts`).

The protocol (:func:`time_interleaved`, run inside every rank of a launch):

* ``schedule="resident"``: every implementation is built once and kept; each **round** runs
  ``steps_per_round`` steps of each (1: step by step), the order rotated by one place every round, so each
  implementation takes every position in the round equally often. For models whose copies fit together.
* ``schedule="rebuild"``: one implementation lives at a time; each round builds each in turn (rotated
  order), runs ``warmup`` untimed steps and ``steps_per_round`` timed ones, and tears it down. For models
  whose copies do not fit together.

Every timed step starts after a barrier (the ranks start together) and ends with a device synchronize; a
step's time is that of its slowest rank (:func:`combine_ranks`), and an implementation's sample for a
round is the mean of its timed steps in that round. So every implementation, the torch baselines
included, reports the median and spread over rounds (:func:`summarize_rounds`).

Out-of-memory is a result: an implementation whose build or step runs out of memory on any rank is
marked ``oom`` (the ranks agree after each turn) and leaves the rotation; the others go on.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from lab.bench.progress import progress_line
from lab.measure.device import error_summary, is_oom, synchronize
from lab.measure.verdicts import summarize
from lab.units import GiB

#: ``build()`` returns ``(step, close)``: one training step, and what releases the implementation.
Build = Callable[[], tuple[Callable[[], None], Callable[[], None]]]
SCHEDULES = ("resident", "rebuild")
ANOTHER_RANK = "out of memory on another rank"


@dataclass(frozen=True)
class Interleaving:
    """How implementations take turns: ``rounds`` rounds of ``steps_per_round`` timed steps each, after
    ``warmup`` untimed steps (once per implementation when resident, after every build when rebuilding);
    ``schedule`` ``"resident"``, ``"rebuild"`` or ``"auto"`` (resident when all copies fit, see
    :func:`choose_schedule`)."""

    rounds: int = 6
    steps_per_round: int = 1
    warmup: int = 1
    schedule: str = "auto"

    def __post_init__(self):
        if self.rounds < 1 or self.steps_per_round < 1 or self.warmup < 0:
            raise ValueError(f"need rounds >= 1, steps_per_round >= 1, warmup >= 0; got {self}")
        if self.schedule not in (*SCHEDULES, "auto"):
            raise ValueError(f"schedule must be one of {SCHEDULES} or 'auto', got {self.schedule!r}")

    def params(self) -> dict:
        return asdict(self)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: ``names`` rotated left by ``round_index`` places."""
    names = list(names)
    if not names:
        return []
    k = round_index % len(names)
    return names[k:] + names[:k]


def choose_schedule(bytes_per_copy: float, copies: int, available_bytes: float, fraction: float = 0.5) -> str:
    """``"resident"`` when ``copies`` implementations of ``bytes_per_copy`` each fit in ``fraction`` of the
    ``available_bytes`` (the rest is left for activations and the allocator), else ``"rebuild"``."""
    return "resident" if bytes_per_copy * copies <= fraction * available_bytes else "rebuild"


# ----------------------------------------------------------------------------------------------------------
# inside each rank


def _barrier(device: torch.device) -> None:
    synchronize(device)
    dist.barrier()
    synchronize(device)


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is set on any rank (a collective: every rank must call it)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _release(device: torch.device) -> None:
    """Free what a closed implementation held: a wrapper in a reference cycle (torch DDP's reducer, hooks)
    keeps its memory and its hooks on the model until the cycle collector runs.

    Nothing may be frozen here (``gc.freeze``): a cycle that something outside Python still holds for a
    moment after the step (NCCL keeps the tensors of its queued work until its watchdog reaps them) would be
    frozen with everything it holds and never collected, and every later build of the rotation would run out
    of memory (report 08's first GPU render). Such a cycle goes at the next release instead, which runs
    before every build."""
    synchronize(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def closer(wrapped, model, optimizer=None) -> Callable[[], None]:
    """The ``close`` a builder returns for a model ``wrapped`` for data parallelism: the wrapper's hooks
    removed, the gradients dropped (a bucketed wrapper's ``.grad`` are views of its buckets) and, when the
    implementation owns its ``optimizer``, its hooks removed too (an update inside the backward) and AdamW's
    moments cleared (of each ``inner`` optimizer where it has several). The largest parts then go by reference
    counting, whatever cycle the hooks make."""
    def close():
        for owner in (wrapped, optimizer):
            if hasattr(owner, "remove_hooks"):
                owner.remove_hooks()
        model.zero_grad(set_to_none=True)
        if optimizer is not None:
            for inner in getattr(optimizer, "inner", [optimizer]):
                inner.state.clear()
    return close


LEAK_WARNING_BYTES = GiB


def _warn_if_left(name: str, device: torch.device, baseline: int, wait_s: float = 2.0,
                  previous: dict[str, int] | None = None) -> None:
    """Say so on stderr (rank 0; a progress line, which a report drops) when more than 1 GiB above ``baseline`` is still
    allocated after the collection that follows ``name``'s turn (before the next build): the later builds of the
    rotation would run out of memory, and this line names the implementation that left it. Rank 0 then collects
    again for up to ``wait_s`` and says what is left, telling memory held a moment past the release (by work still
    queued somewhere, NCCL's for instance) from memory kept. Kept memory is a leak only if it grows from turn to
    turn: ``previous`` (name -> bytes left after its last turn, updated here) tells the two apart."""
    if device.type != "cuda" or dist.get_rank() != 0:
        return
    left = torch.cuda.memory_allocated(device) - baseline
    if left <= LEAK_WARNING_BYTES:
        return
    start = time.perf_counter()
    later = left
    while later > LEAK_WARNING_BYTES and time.perf_counter() - start < wait_s:
        time.sleep(0.1)
        _release(device)
        later = torch.cuda.memory_allocated(device) - baseline
    waited = time.perf_counter() - start
    before = None if previous is None else previous.get(name)
    if later > LEAK_WARNING_BYTES and previous is not None:
        previous[name] = later
    if later <= LEAK_WARNING_BYTES:
        then = f"released within {waited:.1f} s (held a moment past the release, not leaked)"
    elif before is None:
        then = (f"{later / GiB:.1f} GiB after {waited:.1f} s more (kept past its release; a leak if it grows by "
                "its next turn)")
    elif later <= before + LEAK_WARNING_BYTES:
        then = (f"{later / GiB:.1f} GiB after {waited:.1f} s more, against {before / GiB:.1f} GiB after its last "
                "turn (kept, not growing)")
    else:
        then = (f"{later / GiB:.1f} GiB after {waited:.1f} s more, up from {before / GiB:.1f} GiB after its last "
                "turn (a leak: the next builds may run out of memory)")
    # the operator's line (the terminal, a render's log), not a result: a report keeps its rows, whose out of
    # memory, where memory did run out, is recorded there
    progress_line(f"time_interleaved: {left / GiB:.1f} GiB still allocated after closing {name!r}; {then}")


def _attempt(fn: Callable[[], None]) -> BaseException | None:
    """Run ``fn``; an out-of-memory error is returned (a result), any other error propagates."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - out of memory is a result
        if not is_oom(exc):
            raise
        return exc
    return None


def time_interleaved(builders: dict[str, Build], plan: Interleaving, device: torch.device,
                     solo: Collection[str] = ()) -> dict[str, dict]:
    """Inside a launched process: time the implementations of ``builders`` taking turns (see the module
    docstring). ``solo`` names implementations that run on rank 0 alone (e.g. the single-device step; the
    other ranks wait at the barrier). ``plan.schedule`` must be resident or rebuild (resolve "auto" first).

    The ranks agree after every build, every warm-up and every turn whether any of them ran out of memory
    (so that none is left waiting in a collective the others skipped); such an implementation is marked
    ``oom`` and leaves the rotation.

    Returns, for this rank, ``{name: {"status": "ok"|"oom", "error": str, "steps_ms": [[ms per timed
    step] per round]}}`` in the order of ``builders``; combine the ranks with :func:`combine_ranks`.
    Errors other than out-of-memory propagate.
    """
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"resolve the schedule before timing: got {plan.schedule!r}")
    rank = dist.get_rank()
    out = {name: {"status": "ok", "error": "", "steps_ms": []} for name in builders}
    runs_here = {name: rank == 0 or name not in solo for name in builders}
    alive = list(builders)
    live: dict[str, tuple] = {}
    closed: list[str] = []  # the implementation closed at the end of the last turn (rebuild)

    def agreed_failure(name: str, error: BaseException | None) -> bool:
        """Collective: True (and the entry marked oom, released, out of the rotation) if any rank failed."""
        if not _any_rank(error is not None, device):
            return False
        out[name].update(status="oom", error=error_summary(error) if error else ANOTHER_RANK,
                         steps_ms=[])
        alive.remove(name)
        if name in live:
            live.pop(name)[1]()
        _release(device)
        return True

    def build(name: str) -> None:
        nonlocal floor
        _release(device)  # what the last turn left behind, including what was still held at its release
        if closed:  # measured here, not at the turn's own release, where NCCL may still hold its tensors
            name_closed = closed.pop()
            if floor is None:  # what the first turn leaves is what every turn leaves (see below)
                floor = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            else:
                _warn_if_left(name_closed, device, floor, previous=left_after)
        if runs_here[name]:
            live[name] = builders[name]()

    def warm_up(name: str) -> None:
        for _ in range(plan.warmup if name in live else 0):
            live[name][0]()

    def timed_turn(name: str) -> None:
        times = []
        for _ in range(plan.steps_per_round):
            _barrier(device)
            if name in live:
                start = time.perf_counter()
                live[name][0]()
                synchronize(device)
                times.append((time.perf_counter() - start) * 1e3)
        out[name]["steps_ms"].append(times)

    def turn(name: str, rebuild: bool) -> None:
        if rebuild and (agreed_failure(name, _attempt(lambda: build(name)))
                        or agreed_failure(name, _attempt(lambda: warm_up(name)))):
            return
        failed = agreed_failure(name, _attempt(lambda: timed_turn(name)))
        if rebuild and not failed:
            if name in live:
                live.pop(name)[1]()
            _release(device)
            closed[:] = [name]

    # What lives now lives through the run (torch's modules, the inputs, a shared model): out of the
    # collector's sight, so that the collections between turns are quick; unfrozen at the end.
    gc.collect()
    gc.freeze()
    # A leak is memory that grows from turn to turn. The floor is measured after the first turn's release, not
    # before it: state the run keeps from its first step on (a shared model's gradients or AdamW moments, NCCL's
    # and cuBLAS's workspaces) is allocated then and stays, the same after every turn, without ever growing.
    floor: int | None = None
    left_after: dict[str, int] = {}  # what each implementation kept past its last turn (rank 0)
    try:
        if plan.schedule == "resident":
            for name in list(alive):
                if not agreed_failure(name, _attempt(lambda: build(name))):
                    agreed_failure(name, _attempt(lambda: warm_up(name)))
        for r in range(plan.rounds):
            started = time.perf_counter()
            for name in rotated(alive, r):
                turn(name, rebuild=plan.schedule == "rebuild")
            if rank == 0:  # a rebuilt step's build and warm-up can take longer than its timing: say where it is
                steps = ", ".join(f"{n} {statistics.fmean(out[n]['steps_ms'][-1]):.1f} ms" for n in alive
                                  if out[n]["steps_ms"] and out[n]["steps_ms"][-1])
                progress_line(f"interleaved: round {r + 1} of {plan.rounds} in {time.perf_counter() - started:.0f} s"
                              f" ({plan.schedule}): {steps or 'no step timed'}")
    finally:
        for _, close in live.values():
            close()
        live.clear()
        gc.unfreeze()
        _release(device)
    return out


# ----------------------------------------------------------------------------------------------------------
# in the caller


def combine_ranks(per_rank: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """The ranks' results of :func:`time_interleaved` as one sample per round, implementation by
    implementation (:func:`combine_entry`). Returns ``{name: {"status", "error", "round_ms": [ms per round]}}``."""
    return {name: combine_entry([pr[name] for pr in per_rank]) for name in per_rank[0]}


def combine_entry(results: Sequence[dict]) -> dict:
    """One implementation's results on every rank as one sample per round: each step at its slowest rank,
    then the mean of the round's steps; ranks without samples (those that sat out a ``solo``
    implementation) are skipped. A rank's row of another status than ``ok`` or ``oom`` (the ``failed`` row
    :func:`lab.parallel.runner.run` makes of an implementation whose launch failed) is the result, without
    rounds. Returns ``{"status", "error", "round_ms": [ms per round]}``."""
    failed = [r for r in results if r["status"] not in ("ok", "oom")]
    if failed:
        return {"status": failed[0]["status"], "error": failed[0]["error"], "round_ms": []}
    status = "oom" if any(r["status"] == "oom" for r in results) else "ok"
    errors = [r["error"] for r in results if r["error"]]
    error = next((e for e in errors if e != ANOTHER_RANK), errors[0] if errors else "")  # the cause first
    round_ms = []
    if status == "ok":
        active = [r["steps_ms"] for r in results if any(r["steps_ms"])]
        for rounds in zip(*active):
            slowest = [max(step) for step in zip(*rounds)]
            round_ms.append(statistics.fmean(slowest))
    return {"status": status, "error": error, "round_ms": round_ms}


def summarize_rounds(round_ms: Sequence[float]) -> dict:
    """The rounds as a measurement record (ms): ``step_ms`` (the median), ``step_spread_ms`` (the robust
    spread, :func:`lab.measure.verdicts.summarize`), ``step_n`` (rounds) and ``step_samples_ms`` (the samples in
    round order as a JSON list, so that a table keeps them through a CSV file and two implementations of one
    launch compare round by round; read them back with :func:`samples`). NaN without samples."""
    s = summarize(round_ms)
    return dict(step_ms=s.median, step_spread_ms=s.spread, step_n=s.n,
                step_samples_ms=json.dumps([round(float(x), 4) for x in round_ms]))


def samples(value) -> list[float]:
    """The per-round samples of a table cell written by :func:`summarize_rounds` (a JSON list, as read back
    from CSV, or a list); empty for a missing value."""
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return []
    return [float(v) for v in json.loads(value)]
