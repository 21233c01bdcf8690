"""Notebook 10's measurement plumbing: phases from a profiled step, the launch groups of a multi-GPU render,
running them on disjoint GPUs, and a recipe whose processes fail becoming a row."""

import math
import threading
import time

import pytest
import torch

from lab.bench import fastest as bench
from lab.measure.verdicts import MIN_SAMPLES
from lab.parallel.gpu_pool import run_on_gpus
from lab.recipes.fastest_step import ABLATION_BASE, CONFIGS, ablations, recipes_for


def test_the_leaderboards_ablations_get_gpus_of_their_own_where_there_are_enough():
    lb, one = recipes_for(CONFIGS["leaderboard"]), recipes_for(CONFIGS["2.7B"])
    jobs = {"leaderboard": [*lb.values(), *_ablations("leaderboard")], "2.7B": [*one.values(), *_ablations("2.7B")]}
    groups = bench.plan(jobs, gpus=4)
    assert [(name, [r.name for r in rs][:2]) for name, rs in groups] == [
        ("leaderboard", ["project", "stock_eager"]), ("leaderboard", [ABLATION_BASE, "flash_triton_attention"]),
        ("2.7B", ["project", "stock_eager"])]
    base = groups[1][1][0]
    assert base == lb["project"].__class__(**{**vars(lb["project"]), "name": ABLATION_BASE})
    assert len(groups[1][1]) == 1 + len(_ablations("leaderboard")) and len(groups[2][1]) == len(one) + 7
    # three GPUs cannot hold both halves of the leaderboard beside the 2.7B rung: one group each
    assert [len(rs) for _, rs in bench.plan(jobs, gpus=3)] == [14, len(one) + 7]
    assert [len(rs) for _, rs in bench.plan({"leaderboard": list(lb.values())}, gpus=4)] == [3]  # nothing to move


def _ablations(name):
    return ablations(recipes_for(CONFIGS[name])["project"])


def test_jobs_run_side_by_side_on_disjoint_gpus_in_order():
    lock, spans = threading.Lock(), []

    def job(name, width, seconds):
        def run(first):
            start = time.monotonic()
            time.sleep(seconds)
            with lock:
                spans.append((name, first, width, start, time.monotonic()))
            return name, first
        return width, run

    out = run_on_gpus([job("a", 2, 0.3), job("b", 2, 0.1), job("c", 1, 0.1), job("d", 3, 0.05)], gpus=4)
    assert out == [("a", 0), ("b", 2), ("c", 2), ("d", 0)]  # c waits for b's GPUs, d for all of a's
    for x in spans:  # no two jobs hold one GPU at once
        for y in spans:
            if x is not y and x[3] < y[4] and y[3] < x[4]:
                assert set(range(x[1], x[1] + x[2])).isdisjoint(range(y[1], y[1] + y[2])), (x, y)
    with pytest.raises(ValueError, match="needs 5 GPUs"):
        run_on_gpus([job("e", 5, 0)], gpus=4)

    def fails(first):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_on_gpus([(1, fails), job("f", 1, 0.01)], gpus=1)
    assert "f" not in [s[0] for s in spans]  # once a job failed, none behind it starts


def _hangs(*args, **kwargs):
    time.sleep(60)


@pytest.mark.slow
def test_recipes_whose_processes_miss_the_deadline_are_failed_rows(monkeypatch):
    # the worker hangs: with a deadline, each recipe of the launch becomes a row, failed with the reason
    monkeypatch.setattr(bench, "fastest_worker", _hangs)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    recipes = [r for r in recipes_for(CONFIGS["tiny"]).values()][:2]
    df = bench.benchmark("tiny", recipes, device="cpu", profile=False, deadline_s=3)
    assert list(df["impl"]) == ["project", "stock_eager"] and set(df["status"]) == {"failed"}
    assert df["error"].str.contains("deadline").all() and df["step_ms"].isna().all()
    assert set(df["alloc_conf"]) == {"expandable_segments:True"}


def _progress(args):
    """The launch's progress among a worker's arguments (fastest_worker's other arguments may grow)."""
    return next(a for a in args if isinstance(a, bench.runner.Progress))


def _one_recipe_then_hangs(config, recipes, *args):
    row = bench.empty_row(config, recipes[0])
    row.update(step_ms=12.5, step_n=2, timer="host", first_step_s=0.5, wall_s=1.0, peak_gib=2.0 + bench.launcher.rank())
    bench.run_recipes([recipes[0]], lambda recipe: row, _progress(args))
    time.sleep(60)


@pytest.mark.slow
def test_rows_finished_before_the_deadline_are_kept(monkeypatch, capfd):
    monkeypatch.setattr(bench, "fastest_worker", _one_recipe_then_hangs)
    recipes = [r for r in recipes_for(CONFIGS["tiny"]).values()][:3]
    df = bench.benchmark("tiny", recipes, device="cpu", profile=False, deadline_s=15)  # past a loaded start
    assert list(df["impl"]) == ["project", "stock_eager", "stock_compiled"]
    assert list(df["status"]) == ["ok", "failed", "failed"] and df["error"].iloc[1:].str.contains("deadline").all()
    assert df["step_ms"].iloc[0] == 12.5 and df["peak_gib"].iloc[0] == 3.0  # the largest peak over both ranks
    assert "[progress] fastest step: tiny project: ok, 12.5 ms a step (host)" in capfd.readouterr().err  # rank 0's


def _oom_on_rank_zero_in_the_second(config, recipes, *args):
    import os

    import torch.distributed as dist

    def measure(recipe):
        row = bench.empty_row(config, recipe)
        row.update(step_ms=10.0, step_n=2, timer="host", first_step_s=0.5, wall_s=float(os.getpid()), peak_gib=1.0)
        if recipe.name == "stock_eager":
            if bench.launcher.rank() == 0:
                row.update(status="oom", error="OutOfMemoryError: CUDA out of memory (test)", step_ms=math.nan)
            else:  # its peer waits in the recipe's collective, which rank 0 never joins
                dist.all_reduce(torch.ones(1))
        return row

    return bench.run_recipes(recipes, measure, _progress(args))


@pytest.mark.slow
def test_a_recipe_out_of_memory_on_one_rank_ends_its_launch_and_the_next_runs_anew(monkeypatch):
    monkeypatch.setattr(bench, "fastest_worker", _oom_on_rank_zero_in_the_second)
    recipes = [r for r in recipes_for(CONFIGS["tiny"]).values()][:3]
    started = time.monotonic()
    df = bench.benchmark("tiny", recipes, device="cpu", profile=False, timeout_s=600)
    assert time.monotonic() - started < 60  # not the 600 s the waiting rank's collective would allow
    assert list(df["status"]) == ["ok", "oom", "ok"] and df["step_ms"].iloc[[0, 2]].tolist() == [10.0, 10.0]
    assert df["error"].iloc[1] == "rank 0: OutOfMemoryError: CUDA out of memory (test)"
    assert df["wall_s"].iloc[0] != df["wall_s"].iloc[2]  # (the process id) the third recipe in new processes


def test_benchmark_configs_gives_ablations_alone_their_deadline(monkeypatch):
    import pandas as pd

    calls = []

    def fake_benchmark(name, recipes, device, **kwargs):
        calls.append((name, recipes[0].name, kwargs))
        return pd.DataFrame([dict(impl=r.name, config=name) for r in recipes])

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    ablations = [bench.ablation_base(recipes_for(CONFIGS["leaderboard"])["project"]), *_ablations("leaderboard")]
    bench.benchmark_configs({"leaderboard": ablations}, device="auto", peak_tflops=1.0, rep_ms=1)
    assert calls[-1][2]["deadline_s"] == 60 * len(ablations) and "fresh_cache" not in calls[-1][2]
    bench.benchmark_configs({"leaderboard": list(recipes_for(CONFIGS["leaderboard"]).values())}, device="auto",
                            peak_tflops=1.0, rep_ms=1)
    assert calls[-1][2]["fresh_cache"] and "deadline_s" not in calls[-1][2]


def test_benchmark_configs_with_the_host_busy_runs_inside_the_neighbours_and_says_so(monkeypatch):
    import contextlib

    import pandas as pd

    busy_now = []

    @contextlib.contextmanager
    def busy_host(n):
        busy_now.append(n)
        yield []
        busy_now.append(0)

    def fake_benchmark(name, recipes, device, **kwargs):
        return pd.DataFrame([dict(impl=r.name, config=name, during=busy_now[-1]) for r in recipes])

    monkeypatch.setattr(bench, "busy_host", busy_host)
    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    jobs = {"tiny_one_rank": [bench.ablation_base(recipes_for(CONFIGS["tiny_one_rank"])["project"])]}
    rows = bench.benchmark_configs(jobs, device="cpu", busy=3, rep_ms=1)
    assert list(rows["during"]) == [3] and list(rows["busy_host"]) == [3] and busy_now == [3, 0]
    assert "busy_host" not in bench.benchmark_configs(jobs, device="cpu", rep_ms=1)


def test_benchmark_configs_on_four_gpus_runs_the_plan_side_by_side(monkeypatch):
    import pandas as pd

    calls = []

    def fake_benchmark(name, recipes, device, first_gpu=0, **kwargs):
        calls.append((name, [r.name for r in recipes][0], first_gpu, kwargs))
        time.sleep(0.2 if recipes[0].name == "project" and name == "leaderboard" else 0.05)
        return pd.DataFrame([dict(impl=r.name, config=name, gpus=str(first_gpu)) for r in recipes])

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(bench, "benchmark", fake_benchmark)
    jobs = {"leaderboard": [*recipes_for(CONFIGS["leaderboard"]).values(), *_ablations("leaderboard")],
            "2.7B": list(recipes_for(CONFIGS["2.7B"]).values())}
    with pytest.raises(ValueError, match="no budget for"):
        bench.benchmark_configs(jobs, device="auto", peak_tflops=700.0, rep_ms={"2.7B": 1})
    df = bench.benchmark_configs(jobs, device="auto", peak_tflops=700.0, rep_ms={"leaderboard": 1, "2.7B": 2})
    assert len(df) == 3 + 1 + 11 + len(jobs["2.7B"])
    by = {(name, first): (gpu, kw) for name, first, gpu, kw in calls}
    assert by[("leaderboard", "project")][0] == 0 and by[("leaderboard", "project")][1]["fresh_cache"]
    gpu, kw = by[("leaderboard", ABLATION_BASE)]
    assert gpu == 2 and kw["deadline_s"] == 60 * 12 and "fresh_cache" not in kw  # 60 s for each of 12 recipes
    assert {k["env"]["PYTORCH_CUDA_ALLOC_CONF"] for _, _, _, k in calls} == {"expandable_segments:True"}
    assert by[("2.7B", "project")][0] == 2  # the 2.7B rung waits for a pair: the (quicker) ablations free 2-3
    assert all(kw["peak_tflops"] == 700.0 and kw["rep_ms"] == (1 if name == "leaderboard" else 2)
               for name, _, _, kw in calls)
    calls.clear()  # the leaderboard alone on four GPUs: its ablations still go to GPUs of their own
    alone = bench.benchmark_configs({"leaderboard": jobs["leaderboard"]}, device="auto", peak_tflops=1.0, rep_ms=1)
    assert len(alone) == 3 + 1 + len(_ablations("leaderboard"))
    assert sorted((first, gpu) for _, first, gpu, _ in calls) == [(ABLATION_BASE, 2), ("project", 0)]
    assert bench.benchmark_configs({}, device="auto").empty


def test_rows_say_what_a_comparison_holds_fixed():
    one = recipes_for(CONFIGS["2.7B"])
    rows = {n: bench.empty_row(CONFIGS["2.7B"], r) for n, r in one.items()}
    assert rows["stock_compiled"]["precision"] == "bf16_autocast" and rows["stock_compiled_bf16"]["precision"] == "bf16"
    assert {(r["batch"], r["context"]) for r in rows.values()} == {(4, 512)}
    assert bench.empty_row(CONFIGS["leaderboard"], recipes_for(CONFIGS["leaderboard"])["project"])["batch"] == 2


@pytest.mark.parametrize("name,ablation_steps", [("tiny_one_rank", 0), ("tiny", MIN_SAMPLES)])
def test_ablations_time_like_the_headline_on_one_gpu_and_by_the_host_clock_on_several(monkeypatch, name,
                                                                                   ablation_steps):
    """A one-GPU step takes milliseconds: its ablations get do_bench like the headline steps (``host_steps`` 0)
    and no host-timed reference is needed; a multi-GPU step takes seconds: the rule's minimum of host-timed
    steps, and the headline recipes add as many so that the ablations compare like for like."""
    config = CONFIGS[name]
    project = recipes_for(config)["project"]
    recipes = [project, *ablations(project)[:2]]
    seen = {}
    monkeypatch.setattr(bench, "measure_recipe", lambda *a, host_steps, host_reference, **k: seen.update(
        {a[1].name: (host_steps, host_reference)}) or {**bench.empty_row(config, a[1]), "timer": "host"})
    bench.fastest_worker(config, recipes, 1, 1, False, None, ("project",))
    assert seen["project"] == (0, ablation_steps > 0)
    assert [seen[r.name] for r in recipes[1:]] == [(ablation_steps, False)] * 2
