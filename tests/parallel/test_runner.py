"""lab.parallel.runner on gloo with two CPU ranks: rows finished before a failure are kept, the failing rank's
cause names the item it failed in, an out-of-memory item resumes in new processes, and a deadline turns a hung
rank's items into failed rows."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from lab.parallel import launcher, runner

ITEMS = ["a", "b", "c", "d"]


def _blank(item, status, error):
    return dict(item=item, status=status, error=error, total=None)


def _measure(item, fail_on: str | None = None, how: str = "raise"):
    """Every rank all-reduces rank + 1 (2 ranks: 3); rank 1 fails at ``fail_on`` (raise, run out of memory, hang)."""
    if item == fail_on and launcher.rank() == 1:
        if how == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        if how == "hang":
            time.sleep(120)
        raise RuntimeError(f"boom in {item}")
    t = torch.tensor([launcher.rank() + 1.0])
    dist.all_reduce(t)
    return dict(item=item, status="ok", error="", total=t.item(), rank=launcher.rank(), pid=os.getpid())


def _run(fail_on=None, how="raise", **kwargs):
    return runner.run(runner.each_item, ITEMS, 2, lambda items, progress: (_measure, items, progress, fail_on, how),
                      blank=_blank, device="cpu", timeout_s=60, **kwargs)


def test_salvage_charges_the_failing_ranks_item():
    ok = {"status": "ok"}
    # rank 1 raised in item 2 while rank 0 waited there: 0 and 1 kept, 2 is the failure
    rows, failed = runner.salvage([({0: ok, 1: ok}, 2), ({0: ok, 1: ok}, 2)], 4, 1, hung=False)
    assert sorted(rows) == [0, 1] and failed == 2 and rows[0] == (ok, ok)
    # a hung launch: rank 0 ran ahead (no collectives) to item 3, rank 1 hangs in 1: the earliest is charged
    rows, failed = runner.salvage([({0: ok, 1: ok, 2: ok}, 3), ({0: ok}, 1)], 4, 0, hung=True)
    assert sorted(rows) == [0] and failed == 1
    # rank 0 out of memory in item 1 while rank 1 waited in it: that rank's row stands for the item
    oom = {"status": "oom", "error": "OutOfMemoryError: x"}
    rows, failed = runner.salvage([({0: ok, 1: oom}, None), ({0: ok}, 1)], 3, 0, hung=False)
    assert rows[1] == ({"status": "oom", "error": "rank 0: OutOfMemoryError: x"},) and failed == 2
    assert runner.salvage([({0: ok}, None), ({0: ok}, None)], 1, 0, hung=False) == ({0: (ok, ok)}, None)


def test_progress_ignores_a_line_cut_off_mid_write(tmp_path):
    progress = runner.Progress(str(tmp_path))
    progress.start(0)
    progress.finish({"status": "ok", "x": 1.5})
    progress.start(1)
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write('{"done": 1, "row": {"sta')
    assert progress.read(2) == [({0: {"status": "ok", "x": 1.5}}, 1), ({}, None)]


@pytest.mark.slow
def test_a_rank_failing_mid_list_keeps_the_rows_before_it():
    with pytest.raises(launcher.WorkerError, match="boom in c"):  # no deadline: the failure is raised
        _run("c")
    rows = _run("c", deadline_s=120)  # with one, what was not finished becomes failed rows with the cause
    assert [len(r) for r in rows] == [2, 2, 1, 1]
    assert [r[0]["total"] for r in rows[:2]] == [3.0, 3.0] and [r[1]["rank"] for r in rows[:2]] == [1, 1]
    assert [r[0]["status"] for r in rows[2:]] == ["failed", "failed"]
    assert all(r[0]["error"].startswith("rank 1 failed: RuntimeError: boom in c") for r in rows[2:])
    assert "\n" not in rows[2][0]["error"]
    # skip_failed: the item it failed in is a row, and the next ones run in new processes
    rows = _run("c", skip_failed=True)
    assert [r[0]["status"] for r in rows] == ["ok", "ok", "failed", "ok"] and rows[3][0]["total"] == 3.0
    assert rows[3][0]["pid"] != rows[0][0]["pid"]


def test_out_of_memory_on_one_rank_resumes_with_the_next_item_in_new_processes():
    started = time.monotonic()
    rows = _run("b", how="oom")  # rank 0 waits in b's all-reduce, which rank 1 never joins
    assert time.monotonic() - started < 30  # not the 60 s the waiting rank's collective would allow
    assert [r[0]["status"] for r in rows] == ["ok", "oom", "ok", "ok"]
    assert len(rows[1]) == 1 and rows[1][0]["error"] == "rank 1: OutOfMemoryError: CUDA out of memory (test)"
    assert [r[0]["total"] for r in rows if r[0]["status"] == "ok"] == [3.0, 3.0, 3.0]
    assert rows[2][0]["pid"] != rows[0][0]["pid"] and rows[2][0]["pid"] == rows[3][0]["pid"]


@pytest.mark.slow
def test_a_deadline_turns_a_hung_ranks_items_into_failed_rows():
    started = time.monotonic()
    rows = _run("b", how="hang", deadline_s=12)
    assert time.monotonic() - started < 25
    assert [r[0]["status"] for r in rows] == ["ok", "failed", "failed", "failed"] and rows[0][0]["total"] == 3.0
    assert all("deadline" in r[0]["error"] for r in rows[1:])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="items_per_launch"):
        runner.run(runner.each_item, ITEMS, 2, blank=_blank, items_per_launch=0)
