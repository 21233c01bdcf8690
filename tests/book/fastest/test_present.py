"""Notebook 10's claims: like-for-like goals under the one rule, ablations read in one direction, where a profiled
step's time goes, the leaderboard's rule, scaling over nodes, and the fused loss. Values and verdicts are asserted,
not the wording."""

import math
import statistics

import matplotlib
import pandas as pd
import pytest

from lab.book.claims import Observed, Share, Tally, Value, Versus, sentence
from lab.book.fastest import compare
from lab.book.fastest import present as fastest
from lab.recipes import plan
from lab.recipes.fastest_step import CONFIGS, recipes_for

matplotlib.use("Agg")


def _samples(ms, spread, n):
    """``n`` samples whose median is ``ms`` and whose robust spread is about ``spread``."""
    if n == 1:
        return [ms]
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]
    return [ms + spread * q for q in z]


def _row(impl, ms, spread=1.0, n=8, status="ok", host_ms=None, host_n=8, **extra):
    base = dict(impl=impl, config="leaderboard", status=status, step_ms=ms, step_spread_ms=spread, step_n=n,
                step_samples_ms=_samples(ms, spread, n) if status == "ok" else [], peak_gib=60.0,
                tokens_per_s=65536 / ms * 1e3, mfu=0.5, mfu_datasheet=0.4, matmul_ceiling_tflops=780.0,
                model_tflop_per_step=4745.0, params_gib=8.0, grads_gib=8.0, optimizer_gib=16.0,
                activations_and_other_gib=28.0, precision="bf16", batch=2, timer="do_bench")
    base.update({c: math.nan for c in fastest.PHASES})
    if host_ms is not None:
        base.update(host_step_ms=host_ms, host_step_n=host_n, host_step_samples_ms=_samples(host_ms, spread, host_n))
    base.update(extra)
    return base


def _one_gpu(impl, ms, precision, spread=0.5, n=30, **extra):
    return _row(impl, ms, spread, n, config="2.7B", precision=precision, batch=4, **extra)


def _only(claim, kind):
    return [f for f in claim.findings if isinstance(f, kind)]


def test_goal_is_met_missed_or_undecided_under_the_rule():
    df = pd.DataFrame([_row("project", 4500.0, 10.0), _row("stock_compiled", 6000.0, 10.0)])
    met = _only(compare.goal_claim(df, "leaderboard", 0.8), Versus)[0]
    assert met.goal_word == "met" and met.verdict == "faster"
    assert met.comparison.ratio == pytest.approx(0.75) and met.reference.label.startswith("stock_compiled (")
    assert _only(compare.goal_claim(df, "leaderboard", 0.7), Versus)[0].goal_word == "missed"
    noisy = pd.DataFrame([_row("project", 4700.0, 400.0), _row("stock_compiled", 6000.0, 400.0)])
    assert _only(compare.goal_claim(noisy, "leaderboard", 0.8), Versus)[0].goal_word == "undecided"
    few = pd.DataFrame([_row("project", 4500.0, 10.0, n=3), _row("stock_compiled", 6000.0, 10.0, n=3)])
    assert _only(compare.goal_claim(few, "leaderboard", 0.8), Versus)[0].verdict == "not decided"
    alone = compare.goal_claim(df[df.impl == "project"], "leaderboard", 0.8)
    assert not _only(alone, Versus) and _only(alone, Observed)
    assert compare.goal_claim(df, "tiny", 0.8, on_gpu=False).because == compare.CPU_NOTE


def test_the_goal_compares_only_equal_precision_and_names_the_stock_options():
    """2.7B on one GPU: the book's bf16 step is 0.776x the fp32-master stock_compiled, but against the stock
    compiled step with bf16 parameters it is slower. The goal is judged against the latter; the former
    comparison is at another precision, a stock option."""
    df = pd.DataFrame([_one_gpu("project", 97.6, "bf16", host_ms=97.9),
                       _one_gpu("stock_eager", 160.0, "bf16_autocast", host_ms=160.0),
                       _one_gpu("stock_compiled", 125.8, "bf16_autocast", host_ms=126.0),
                       _one_gpu("stock_eager_bf16", 130.0, "bf16", host_ms=130.0),
                       _one_gpu("stock_compiled_bf16", 95.1, "bf16", host_ms=95.3),
                       _row("fp32_master_weights", 128.5, 0.5, config="2.7B", precision="bf16_autocast", batch=4,
                            timer="host", host_ms=128.5)])
    t = compare.like_for_like_table(df).set_index("book")
    assert t.loc["project", "stock"] == "stock_compiled_bf16" and t.loc["project", "verdict"] == "slower"
    assert t.loc["project", "ratio"] == pytest.approx(97.6 / 95.1, rel=1e-3)
    assert t.loc["project", "stock_options"] == "" and t.loc["project", "own_parts"].startswith("fused_loss")
    # the precision ablation meets the fp32-master stock step on the host clock, the only timer both have
    assert t.loc["fp32_master_weights", "stock"] == "stock_compiled"
    assert t.loc["fp32_master_weights", "ratio"] == pytest.approx(128.5 / 126.0, rel=1e-3)
    claim = compare.goal_claim(df, "2.7B", 0.85)
    goal = _only(claim, Versus)[0]
    assert goal.goal_word == "missed" and goal.reference.median == pytest.approx(95.1)
    assert any("fused_loss" in o.seen for o in _only(claim, Observed))
    other = compare.other_precision_claims(df)
    versus = [f for f in other if isinstance(f, Versus)]
    assert len(versus) == 1 and versus[0].verdict == "faster"
    assert versus[0].comparison.speedup == pytest.approx(125.8 / 97.6, rel=1e-3)
    assert any("precision" in f.seen for f in other if isinstance(f, Observed))
    assert compare.other_precision_claims(df[df.precision == "bf16"]) == []
    options, own = compare.split_differences("2.7B", "project", "stock_compiled")
    assert [o.split()[0] for o in options] == ["precision"] and [o.split()[0] for o in own] == ["fused_loss"]
    leaderboard = pd.DataFrame([_row("project", 4500.0, 10.0), _row("stock_compiled", 6000.0, 10.0)])
    said = " ".join(o.seen for o in _only(compare.goal_claim(leaderboard, "leaderboard", 0.8), Observed))
    assert all(field in said for field in ("checkpoint", "compile", "fused_loss", "sharding"))


def test_ablations_read_in_one_direction_against_the_step_timed_the_same_way():
    """do_bench times the book's step at 100 ms, but its host-clock steps (as the ablations are timed) take
    110: an ablation at 112 ms on the host clock is within noise of it, not 12% slower."""
    df = pd.DataFrame([_row("project", 100.0, 2.0, host_ms=110.0),
                       _row("no_compile", 112.0, 2.0, timer="host", host_ms=112.0),
                       _row("no_fused_loss", 150.0, 1.0, timer="host", host_ms=150.0, peak_gib=113.3),
                       _row("no_flash_attention", 90.0, 0.5, timer="host", host_ms=90.0, peak_gib=67.7),
                       _row("full_recompute", math.nan, status="oom", limit_gib=79.2),
                       _row("stock_compiled", 150.0, 0.5)])
    a = compare.ablation_table(df).set_index("ablation")
    assert a.loc["no_compile", "base_ms"] == pytest.approx(110.0) and a.loc["no_compile", "verdict"] == "within noise"
    assert a.loc["no_fused_loss", "added_ms"] == pytest.approx(40.0) and a.loc["no_fused_loss", "verdict"] == "slower"
    assert a.loc["no_fused_loss", "change"] != "no_fused_loss"  # named by what changes, in words
    assert a.loc["full_recompute", "verdict"] == "out of memory at 79 GiB" and "stock_compiled" not in a.index
    claim = compare.ablation_claim(df, "leaderboard")
    tally = _only(claim, Tally)[0]
    assert sum(tally.counts().values()) == 4 == len(tally.comparisons)
    assert tally.counts() == {"within noise": 1, "slower": 1, "faster": 1, "out of memory at 79 GiB": 1}
    assert [o.seen for o in _only(claim, Observed)] == ["fits"]  # the faster change's peak: 67.7 GiB
    older = df.drop(columns=["host_step_ms", "host_step_n", "host_step_samples_ms"])  # no host times: step_ms
    assert compare.ablation_table(older).set_index("ablation").loc["no_compile", "base_ms"] == pytest.approx(100.0)


def test_a_failed_base_compares_nothing_and_the_base_beside_the_ablations_is_used():
    base_failed = pd.DataFrame([_row("project", 5186.0, 5.8), _row("ablation_base", math.nan, status="oom"),
                                _row("no_compile", 5400.0, 2.0, host_ms=5400.0)])
    assert compare.ablation_table(base_failed)["verdict"].tolist() == ["out of memory"]
    beside = pd.DataFrame([_row("project", 5186.0, 5.8, gpus="0,1"),
                           _row("ablation_base", 5300.0, 2.0, gpus="2,3", timer="host", host_ms=5300.0),
                           _row("full_recompute", 5900.0, 2.0, gpus="2,3", timer="host", host_ms=5900.0)])
    a = compare.ablation_table(beside).set_index("ablation")
    assert a.loc["full_recompute", "base_ms"] == pytest.approx(5300.0)
    assert a.loc["full_recompute", "verdict"] == "slower"
    # the copy measured on other cards is not set against the stock step of the headline's cards
    stock = pd.DataFrame([_row("stock_compiled", 5548.0, 2.0, gpus="0,1")])
    t = compare.like_for_like_table(pd.concat([beside, stock]))
    assert t["book"].tolist() == ["project"]


def test_phases_gaps_and_mfu():
    phases = dict(recompute_ms=1000.0, attention_ms=2000.0, matmul_ms=1500.0, loss_ms=100.0, optimizer_ms=50.0,
                  other_kernels_ms=200.0, exposed_communication_ms=20.0, idle_ms=130.0)
    theirs = dict(recompute_ms=0.0, attention_ms=2600.0, matmul_ms=2400.0, loss_ms=300.0, optimizer_ms=50.0,
                  other_kernels_ms=400.0, exposed_communication_ms=20.0, idle_ms=130.0)
    df = pd.DataFrame([_row("project", 5000.0, **phases), _row("stock_compiled", 6000.0, **theirs)])
    claim = fastest.phase_claim(df)
    shares = _only(claim, Share)
    assert [s.label for s in shares][:3] == ["attention", "matmul", "recompute"]  # largest first
    assert shares[0].fraction == pytest.approx(0.4) and _only(claim, Value)[0].measured.median == 5000.0
    assert not _only(fastest.phase_claim(df.assign(**dict.fromkeys(fastest.PHASES, math.nan))), Share)
    gap = fastest.gap_claim(df)
    moved = {v.measured.label.split(",")[0]: v.measured.median for v in _only(gap, Value)}
    assert moved["recompute"] == 1000.0 and moved["matmul"] == -900.0
    hidden = "recomputation with the phases it hides in (recompute + attention + matmul + other kernels)"
    assert moved[hidden] == 4700.0 - 5400.0
    assert gap.because  # the stock step recomputes inside its compiled blocks
    mfu = fastest.mfu_claim(df, on_gpu=True)
    assert _only(mfu, Share)[0].fraction == pytest.approx(0.5) and _only(mfu, Share)[1].part == pytest.approx(390.0)
    assert not _only(fastest.mfu_claim(df, on_gpu=False), Share)
    ablated = pd.DataFrame([_row("project", 5000.0, **phases),
                            _row("optimizer_in_backward", 5100.0, **{**phases, "idle_ms": 230.0})])
    values = {v.measured.label: v.measured.median for v in _only(fastest.ablation_phase_claim(ablated), Value)}
    assert values == {"optimizer_in_backward in all": 100.0, "optimizer_in_backward, idle": 100.0}


def test_compile_rule_and_other_kernels_table():
    df = pd.DataFrame([_row("project", 5186.0, wall_s=92.0, first_step_s=15.1,
                            other_kernels_top="triton_red_fused_rms=120.5; copy_kernel=80"),
                       _row("stock_compiled", 5548.0, wall_s=70.0, first_step_s=8.0,
                            other_kernels_top="copy_kernel=60.25; vectorized_elementwise=10")])
    claim = fastest.compile_claim(df, "leaderboard", on_gpu=True)
    assert [v.measured.median for v in _only(claim, Value)] == [15.1, 92.0] and _only(claim, Observed)[0].seen == "kept"
    assert _only(fastest.compile_claim(df, "leaderboard", True, limit_s=60), Observed)[0].seen == "exceeded"
    assert not _only(fastest.compile_claim(df, "leaderboard", on_gpu=False), Value)
    t = fastest.other_kernels_table(df)
    assert list(t["kernel"]) == ["triton_red_fused_rms", "copy_kernel", "vectorized_elementwise"]
    assert t.set_index("kernel").loc["copy_kernel", "stock_compiled"] == 60.25


def _loss(impl, ms, spread=1.0, n=8, extra=1.0, status="ok", vocab=151936):
    return dict(impl=impl, vocab=vocab, d_model=4096, tokens=32768, dtype="bf16", fwdbwd_ms=ms,
                fwdbwd_spread_ms=spread, fwdbwd_n=n, fwdbwd_samples_ms=_samples(ms, spread, n) if ms == ms else [],
                peak_extra_gib=extra, status=status)


def test_fused_loss_goals_and_peers():
    rows = [_loss("fused", 176.7, extra=0.5), _loss("torch", 250.0, extra=20.0), _loss("torch_compiled", 183.3),
            _loss("liger", 186.9), _loss("cce", 176.9, spread=5.0)]
    claim = fastest.fused_loss_claim(pd.DataFrame(rows), on_gpu=True)
    versus = {f.reference.label: f for f in _only(claim, Versus)}
    assert versus["compiled PyTorch"].goal_word == "met" and versus["compiled PyTorch"].verdict == "faster"
    assert versus["Liger's fused linear cross-entropy"].verdict == "faster"
    assert versus["Cut Cross-Entropy"].verdict == "within noise"
    assert _only(claim, Share)[0].fraction == pytest.approx(0.025) and _only(claim, Observed)[0].seen == "met"
    few = fastest.fused_loss_claim(pd.DataFrame([_loss("fused", 176.7, n=1), _loss("torch_compiled", 183.3, n=1)]),
                                   on_gpu=True)
    assert _only(few, Versus)[0].verdict == "not decided" and _only(few, Versus)[0].goal_word == "undecided"
    oom = fastest.fused_loss_claim(pd.DataFrame([_loss("fused", 176.7), _loss("torch", math.nan, status="oom")]),
                                   on_gpu=True)
    assert "out of memory" in _only(oom, Observed)[0].seen
    untimed = pd.DataFrame([{**_loss("fused", math.nan, status="not timed"), "fwdbwd_samples_ms": []},
                            _loss("torch", 2.0)])
    said = fastest.fused_loss_claim(untimed, on_gpu=False)
    assert "fused" in _only(said, Observed)[-1].seen and said.because == compare.CPU_NOTE
    assert "nan" not in sentence(said)


def test_scaling_over_nodes_is_per_gpu_throughput_against_the_one_node_step():
    """Two nodes of two GPUs train four sequences where one node trains two: equal tokens per GPU, so the
    per-GPU throughput ratio is the one-node step time over the two-node one (5,000 / 5,100 = 98.0%)."""
    def hsdp(impl, ms, spread=10.0):
        return _row(impl, ms, spread, config="leaderboard_hsdp")

    one_node = [_row("project", 5000.0, 10.0), _row("stock_compiled", 5500.0, 10.0)]
    claim = compare.scaling_claim(pd.DataFrame(one_node + [hsdp("project", 5100.0), hsdp("stock_compiled", 5610.0)]))
    ours, stock = _only(claim, Versus)
    assert ours.comparison.ratio == pytest.approx(5000 / 5100, rel=1e-3) and ours.goal_word == "met"
    assert ours.subject.median == pytest.approx(32768 / 5.1, rel=1e-3) and stock.goal is None
    slow = compare.scaling_claim(pd.DataFrame(one_node + [hsdp("project", 5600.0)]))
    assert _only(slow, Versus)[0].goal_word == "missed"
    assert compare.scaling_claim(pd.DataFrame(one_node)) is None  # one node only: nothing to scale


def test_profiles_are_set_against_the_stock_steps_of_equal_precision_fastest_first():
    df = pd.DataFrame([_one_gpu("project", 97.6, "bf16"), _one_gpu("stock_compiled", 125.8, "bf16_autocast"),
                       _one_gpu("stock_eager_bf16", 130.0, "bf16"), _one_gpu("stock_compiled_bf16", 95.1, "bf16")])
    assert compare.stocks_like(df) == ["stock_compiled_bf16", "stock_eager_bf16"]
    assert compare.stocks_like(df[df.impl != "project"]) == []


def test_quick_recipes_compile_nothing_and_ablations_for_some_configurations_only():
    quick = plan.recipes(CONFIGS["tiny"], quick=True)
    assert all(r.compile == "none" for r in quick)
    assert [r.name for r in quick] == ["project", "stock_eager", "flash_triton_attention", "no_fused_loss"]
    headline = ["project", "stock_eager", "stock_compiled"]
    assert [r.name for r in plan.recipes(CONFIGS["leaderboard"], quick=False, ablate=["2.7B"])] == headline
    assert len(plan.recipes(CONFIGS["2.7B"], quick=False, ablate=False)) == 5
    with pytest.raises(ValueError, match="unknown configurations"):
        plan.recipes(CONFIGS["2.7B"], quick=False, ablate=["2.7b"])
    with pytest.raises(ValueError, match="list of configuration names"):
        plan.recipes(CONFIGS["2.7B"], quick=False, ablate="2.7B")
    some = plan.recipes(CONFIGS["leaderboard"], quick=False, ablate={"leaderboard": ["flash_triton_attention"]})
    assert [r.name for r in some] == headline + ["flash_triton_attention"]
    with pytest.raises(ValueError, match="ablations of leaderboard"):
        plan.recipes(CONFIGS["leaderboard"], quick=False, ablate={"leaderboard": ["no_flash"]})
    assert len(fastest.config_table(["leaderboard"])) == 1


def test_carry_whole_configurations_or_their_headline_rows():
    configs = ["leaderboard", "2.7B"]
    measured = plan.measured_recipes(configs, ["2.7B"], quick=False)
    assert list(measured) == ["leaderboard"]
    split = plan.measured_recipes(configs, ["leaderboard:headline", "2.7B"], quick=False)
    assert list(split) == ["leaderboard"] and split["leaderboard"][0].name == "ablation_base"
    assert plan.measured_recipes(configs, ["leaderboard:headline"], quick=False, ablate=False) == {
        "2.7B": list(recipes_for(CONFIGS["2.7B"]).values())}
    saved = pd.DataFrame([_row(i, 1.0, config=c) for c in configs
                          for i in ("project", "stock_eager", "stock_compiled", "no_compile")])
    kept = plan.carried_rows(saved, configs, ["leaderboard:headline", "2.7B"])
    assert len(kept) == 3 + 4 and set(kept.loc[kept.config == "leaderboard", "impl"]) == {
        "project", "stock_eager", "stock_compiled"}
    for bad in (["2.7b"], ["leaderboard:ablations"], "2.7B"):
        with pytest.raises(ValueError, match="carry"):
            plan.measured_recipes(configs, bad, quick=False)


def test_measured_on_gpu_reads_the_rows_not_this_machine():
    assert fastest.measured_on_gpu(pd.DataFrame({"gpu": ["NVIDIA H200"] * 2}), default=False)
    assert not fastest.measured_on_gpu(pd.DataFrame({"gpu": ["cpu"]}), default=True)
    assert fastest.measured_on_gpu(pd.DataFrame({"x": [1]}), default=True)


def test_choices_table_keeps_the_rows_that_offload_capture_or_communicate():
    import dataclasses

    from lab.bench.fastest import empty_row
    from lab.recipes import fastest_step as fs

    one, hybrid = fs.CONFIGS["2.7B"], fs.CONFIGS["leaderboard_hsdp"]
    graphs = next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs")
    rows = [empty_row(one, fs.PROJECT_ONE_GPU), {**empty_row(one, graphs), "cuda_graphs": True},
            {**empty_row(hybrid, dataclasses.replace(fs.PROJECT, sharding="hsdp", name="offload_all", offload=1.0)),
             "offload_bytes": 3 * 2**30, "offload_wait_ms": 12.0}]
    t = fastest.choices_table(pd.DataFrame(rows)).set_index("impl")
    assert list(t.index) == ["cuda_graphs", "offload_all"]
    assert t.loc["offload_all", "offload_gib"] == 3.0 and t.loc["offload_all", "nodes"] == 2
    assert fastest.choices_table(pd.DataFrame([_row("project", 1.0)])).empty


def test_the_stock_one_gpu_steps_enter_the_ledger_as_the_other_reports_key_them():
    """10's eager and compiled stock 2.7B steps (bf16 autocast, SDPA, the model's loss) meet 01/04's lm_step rows and
    03's peak under one key each; the book's own step and the bf16-parameter stock steps measure something else."""
    from lab.book import ledger
    from lab.book.memory import present as memory_book

    rows = [_one_gpu("stock_eager", 149.0, "bf16_autocast", world_size=1, context=512, step_gpu_ms=60.0,
                     step_compute_gpu_ms=60.0, peak_gib=55.6),
            _one_gpu("stock_compiled", 113.0, "bf16_autocast", world_size=1, context=512, step_gpu_ms=110.0,
                     step_compute_gpu_ms=110.0),
            _one_gpu("stock_compiled_bf16", 92.0, "bf16", world_size=1, context=512),
            _one_gpu("project", 91.0, "bf16", world_size=1, context=512)]
    entries = compare.ledger_entries(pd.DataFrame(rows))
    steps = {e["key"]: e for e in entries if e["kind"] == "lm_step"}
    lm = pd.DataFrame([dict(size="2.7B", context=512, batch=4, dtype="bf16", attention="sdpa", compile=c,
                            fused_loss=False, status="ok", step_ms=ms, step_spread_ms=1.0, step_n=5)
                       for c, ms in ((False, 150.0), (True, 114.0))])
    theirs = [e for e in ledger.lm_step_entries(lm)]
    assert set(steps) == {e["key"] for e in theirs}
    eager = steps[theirs[0]["key"]]
    assert eager["host_bound"] and eager["gpu_ms"] == 60.0  # the GPU ran kernels for 60 of 149 ms
    assert not steps[theirs[1]["key"]]["host_bound"]
    peaks = memory_book.ledger_entries(pd.DataFrame([dict(size="2.7B", context=512, batch=4, dtype="bf16",
                                                          mode="train_step", peak_gib=55.7, status="ok")]))
    (peak,) = [e for e in entries if e["kind"] == "peak_memory"]
    assert peak["key"] == peaks[0]["key"] and peak["median"] == 55.6
    # a configuration that is no model size (the quick book's stand-ins) enters nothing
    assert compare.ledger_entries(pd.DataFrame([_row("stock_eager", 9.0, world_size=1, config="tiny_one_rank",
                                                     precision="bf16_autocast")])) == []


def test_one_gpu_ablations_are_timed_again_with_the_host_busy_and_say_where_the_verdict_moves():
    """plan.host_ablations: the one-GPU configurations' ablations, led by the book's step again, and nothing of
    the multi-GPU ones; host_claim: each change's verdict with the host busy, and where it differs from the
    quiet run's, that it depends on the host."""
    jobs = plan.host_ablations(["leaderboard", "2.7B"], quick=False)
    assert list(jobs) == ["2.7B"] and jobs["2.7B"][0].name == "ablation_base"
    assert {r.name for r in jobs["2.7B"][1:]} == {r.name for r in plan.recipes(CONFIGS["2.7B"], False)[5:]}
    assert plan.host_ablations(["2.7B"], quick=False, ablate=False) == {}
    alone = pd.DataFrame([_one_gpu("project", 91.0, "bf16"), _one_gpu("optimizer_in_backward", 91.2, "bf16"),
                          _one_gpu("no_compile", 118.0, "bf16")])
    busy = pd.DataFrame([_one_gpu("ablation_base", 95.0, "bf16"), _one_gpu("optimizer_in_backward", 137.8, "bf16"),
                         _one_gpu("no_compile", 160.0, "bf16")])
    claim = compare.host_claim(alone, busy, "2.7B")
    assert _only(claim, Tally)[0].counts() == {"slower": 2}
    seen = {o.label: o.seen for o in _only(claim, Observed)}
    assert len(seen) == 1  # no compile: slower alone too, so its verdict holds and is not listed
    moved = seen[f"{compare.change_label('optimizer_in_backward')}, the host busy"]
    assert moved.startswith("slower, within noise alone") and "depends on the host" in moved
    held = compare.host_claim(alone, busy.assign(step_samples_ms=[s for s in alone["step_samples_ms"]]), "2.7B")
    assert [(o.label, o.seen) for o in _only(held, Observed)] == [("verdicts that depend on the host", "none")]
