"""lab.bench.interleaved: the order of turns, the aggregation over ranks and rounds, and a real gloo run with
two processes (both schedules, a rank-0-only entry, out-of-memory as a row, a verdict from the samples)."""

import contextlib
import io
import json
import math
import time
import weakref

import pytest

from lab.bench import interleaved
from lab.bench.interleaved import Interleaving
from lab.measure.verdicts import compare, compare_paired
from lab.parallel import launcher as distributed


def test_rotation_puts_every_name_in_every_position():
    names = ["a", "b", "c"]
    orders = [interleaved.rotated(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert interleaved.rotated(names, 4) == ["b", "c", "a"]
    for position in range(3):
        assert {order[position] for order in orders} == set(names)
    assert interleaved.rotated([], 2) == []


def test_interleaving_is_validated_and_reported():
    assert Interleaving(4, 2, 0, "rebuild").params() == dict(rounds=4, steps_per_round=2, warmup=0,
                                                              schedule="rebuild")
    with pytest.raises(ValueError, match="rounds"):
        Interleaving(rounds=0)
    with pytest.raises(ValueError, match="schedule"):
        Interleaving(schedule="sometimes")


def test_choose_schedule_by_memory():
    assert interleaved.choose_schedule(1e9, 6, 20e9) == "resident"  # 6 GB of 20: fits in half
    assert interleaved.choose_schedule(4e9, 6, 20e9) == "rebuild"
    assert interleaved.choose_schedule(4e9, 6, 20e9, fraction=1.5) == "resident"


def test_combine_ranks_takes_each_step_at_its_slowest_rank():
    rank0 = {"a": {"status": "ok", "error": "", "steps_ms": [[1.0, 3.0], [2.0, 2.0]]},
             "solo": {"status": "ok", "error": "", "steps_ms": [[7.0], [9.0]]},
             "gone": {"status": "ok", "error": "", "steps_ms": []}}
    rank1 = {"a": {"status": "ok", "error": "", "steps_ms": [[2.0, 1.0], [5.0, 1.0]]},
             "solo": {"status": "ok", "error": "", "steps_ms": [[], []]},  # sat out: rank 0 alone
             "gone": {"status": "oom", "error": "MemoryError: x", "steps_ms": []}}
    out = interleaved.combine_ranks([rank0, rank1])
    assert out["a"]["round_ms"] == [2.5, 3.5]  # rounds: mean of max(1,2), max(3,1); mean of max(2,5), max(2,1)
    assert out["solo"]["round_ms"] == [7.0, 9.0]
    assert out["gone"] == {"status": "oom", "error": "MemoryError: x", "round_ms": []}


def test_summarize_rounds_is_a_measurement_record_with_samples_through_json():
    s = interleaved.summarize_rounds([4.0, 1.0, 10.0, 3.0, 2.0])
    assert (s["step_ms"], s["step_n"]) == (3.0, 5)
    assert s["step_spread_ms"] == pytest.approx(1.4826)  # 1.4826 x the median absolute deviation (1)
    assert interleaved.samples(s["step_samples_ms"]) == [4.0, 1.0, 10.0, 3.0, 2.0]  # in round order
    assert json.loads(s["step_samples_ms"]) == [4.0, 1.0, 10.0, 3.0, 2.0]
    empty = interleaved.summarize_rounds([])
    assert math.isnan(empty["step_ms"]) and empty["step_n"] == 0 and interleaved.samples(empty["step_samples_ms"]) == []
    assert interleaved.samples(float("nan")) == [] and interleaved.samples([1, 2]) == [1.0, 2.0]


def test_rounds_kept_in_order_compare_paired_and_cancel_a_drifting_host():
    """Rounds alternate between a quiet and a busy host; A is 10 % faster than B in every round."""
    host = [10.0, 30.0] * 5
    a, b = (interleaved.samples(interleaved.summarize_rounds(x)["step_samples_ms"]) for x in ([0.9 * h for h in host],
                                                                                           host))
    assert compare(a, b).verdict == "within noise"  # unpaired, the host's drift swamps the difference
    paired = compare_paired(a, b)
    assert paired.verdict == "faster" and paired.ratio == pytest.approx(0.9)


# ----------------------------------------------------------------------------------------------------------
# a real run: module-level workers, so that spawned processes can import them

ORDER: list[str] = []


def _contestant(name: str, ms: float, oom_on_rank: int | None = None):
    def build():
        if oom_on_rank == distributed.rank():
            raise MemoryError(f"{name} does not fit")  # an out-of-memory on one rank only

        def step():
            ORDER.append(name)
            time.sleep(ms / 1e3)

        return step, lambda: None
    return build


def _interleaved_worker() -> dict:
    out = {}
    for schedule in ("resident", "rebuild"):
        ORDER.clear()
        builders = {"fast": _contestant("fast", 2), "slow": _contestant("slow", 40),
                    "single": _contestant("single", 1), "too_big": _contestant("too_big", 1, oom_on_rank=1)}
        plan = Interleaving(rounds=5, steps_per_round=1, warmup=1, schedule=schedule)
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            timings = interleaved.time_interleaved(builders, plan, distributed.device(), solo={"single"})
        out[schedule] = {"timings": timings, "order": list(ORDER), "said": said.getvalue().splitlines()}
    return out


def test_time_interleaved_on_two_gloo_processes():
    per_rank = distributed.launch(_interleaved_worker, 2, device="cpu", timeout_s=60, deadline_s=120)
    for schedule in ("resident", "rebuild"):
        rounds = interleaved.combine_ranks([r[schedule]["timings"] for r in per_rank])
        assert list(rounds) == ["fast", "slow", "single", "too_big"]
        assert rounds["too_big"]["status"] == "oom" and "does not fit" in rounds["too_big"]["error"]
        assert rounds["too_big"]["round_ms"] == []
        for name in ("fast", "slow", "single"):
            assert rounds[name]["status"] == "ok" and len(rounds[name]["round_ms"]) == 5
        # every sample holds the step (sleep) and nothing much else
        # (20x apart: a busy 2-core machine once stretched 2 and 8 ms steps until they were within noise)
        assert min(rounds["slow"]["round_ms"]) >= 40 and min(rounds["fast"]["round_ms"]) >= 2
        assert compare(rounds["fast"]["round_ms"], rounds["slow"]["round_ms"]).verdict == "faster"
        # the turns rotate over the entries still in (too_big left after its failed build); resident: one
        # warm-up step each first, rebuild: a warm-up step before every timed one
        turns = [n for r in range(5) for n in interleaved.rotated(["fast", "slow", "single"], r)]
        order0 = per_rank[0][schedule]["order"]
        if schedule == "resident":
            assert order0 == ["fast", "slow", "single"] + turns
        else:
            assert order0 == [n for n in turns for _ in range(2)]
        # the rank-0-only entry never ran on rank 1
        assert "single" not in per_rank[1][schedule]["order"]
        # rank 0 says where the run is after every round, with each entry's mean step of that round
        rounds_said = [line for line in per_rank[0][schedule]["said"] if "interleaved: round" in line]
        assert [line.split("interleaved: round ")[1].split(" in ")[0] for line in rounds_said] == \
            [f"{r} of 5" for r in range(1, 6)]
        assert all("slow " in line and "too_big" not in line for line in rounds_said)
        assert not [line for line in per_rank[1][schedule]["said"] if "interleaved: round" in line]


# An implementation whose objects form a reference cycle and that something outside Python holds for a
# moment after its turn (NCCL keeps the tensors of queued work until its watchdog reaps them): simulated by
# HELD, which close() fills and the next build empties.
HELD: list = []
BUILT: list = []
LINGERING: list = []  # at each build: how many models of turns before the last one are still alive


def _cyclic(name: str):
    def build():
        LINGERING.append(sum(ref() is not None for ref in BUILT[:-1]))
        HELD.clear()

        class Wrapper:
            pass

        w = Wrapper()
        w.me = w  # a cycle: only the collector frees it
        BUILT.append(weakref.ref(w))

        def close():
            HELD.append(w)

        return (lambda: w), close
    return build


def _cycle_worker() -> list[int]:
    BUILT.clear()
    LINGERING.clear()
    plan = Interleaving(rounds=3, steps_per_round=1, warmup=0, schedule="rebuild")
    interleaved.time_interleaved({"a": _cyclic("a"), "b": _cyclic("b")}, plan, distributed.device())
    return list(LINGERING)


def test_rebuild_frees_a_cycle_that_was_held_at_its_release():
    """Report 08's first GPU render ran out of memory in every row: each turn's model, still held at its
    release, was frozen by gc.freeze and never collected. At every build, no model older than the last
    turn's may be alive."""
    lingering = distributed.launch(_cycle_worker, 2, device="cpu", timeout_s=60, deadline_s=120)
    assert lingering[0] == [0] * 6 and lingering[1] == [0] * 6


@pytest.mark.parametrize("allocated,said", [
    ([3, 3, 0], "3.0 GiB still allocated after closing 'zero'; released within"),  # held a moment, then freed
    ([3] * 100, "3.0 GiB still allocated after closing 'zero'; 3.0 GiB after"),  # still there: a leak
])
def test_memory_left_after_a_turn_is_watched_before_it_is_called_a_leak(monkeypatch, capsys, allocated, said):
    import torch

    readings = iter([a * 2**30 for a in allocated])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(readings))
    monkeypatch.setattr(interleaved.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(interleaved, "_release", lambda device: None)
    interleaved._warn_if_left("zero", torch.device("cuda", 0), baseline=0, wait_s=0.5)
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
    assert "a leak: the next builds" not in err  # nothing to compare with yet: kept, not (yet) a leak
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2**29)  # half a GiB: nothing said
    interleaved._warn_if_left("zero", torch.device("cuda", 0), baseline=0)
    assert capsys.readouterr().err == ""


def test_memory_kept_from_turn_to_turn_is_a_leak_only_when_it_grows(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(interleaved.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(interleaved, "_release", lambda device: None)
    previous = {}

    def turn(gib):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: gib * 2**30)
        interleaved._warn_if_left("torch_ddp", torch.device("cuda", 0), baseline=0, wait_s=0.2, previous=previous)
        return capsys.readouterr().err

    first, same, grown = turn(2.0), turn(2.4), turn(4.0)
    assert "a leak if it grows" in first
    assert "not growing" in same and "a leak:" not in same
    assert "up from 2.4 GiB" in grown and "a leak: the next builds" in grown
