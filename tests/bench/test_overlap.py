"""lab.bench.overlap and tools/overlap_check.sh: the plans read each entry against the one a choice away, the
profiled step's optimizer overlap is read off the kernels, and the measurement runs end to end on CPU ranks with a
tiny model, writing the tables the GPU run writes (one row per entry, the losses of each)."""

import contextlib
import dataclasses
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest

from lab.bench import overlap
from lab.bench.interleaved import Interleaving
from lab.model import config_for
from lab.paths import REPO_ROOT
from lab.recipes import recipe as rc

COLUMNS = ["entry", "reference", "part", "size", "context", "batch", "world_size", "precision", "step_ms",
           "step_spread_ms", "step_n", "step_samples_ms", "schedule", "vs_reference_ratio",
           "vs_reference_low", "vs_reference_high", "vs_reference_verdict", "vs_baseline_ratio", "vs_baseline_low",
           "vs_baseline_high", "vs_baseline_verdict", "comm_ms", "overlap_frac", "optimizer_ms",
           "optimizer_overlapped_ms", "trace", "loss_first", "loss_last", "recipe", "status", "error"]


def _fields(a: rc.Recipe, b: rc.Recipe) -> list[str]:
    return [f.name for f in dataclasses.fields(rc.Recipe)
            if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)]


def test_the_plans_read_each_entry_against_one_choice_away():
    one = {e.name: e for e in overlap.one_gpu_plan()}
    assert list(one) == ["project", "block_compile", "optimizer_in_backward", "clip_grad_norm",
                         "optimizer_in_backward_clipped", "stock_compiled_bf16"]
    assert {n: e.reference for n, e in one.items()} == dict(
        project="stock_compiled_bf16", block_compile="project", optimizer_in_backward="block_compile",
        clip_grad_norm="project", optimizer_in_backward_clipped="optimizer_in_backward", stock_compiled_bf16=None)
    for name, entry in one.items():
        if entry.reference and name != "project":
            assert len(_fields(entry.recipe, one[entry.reference].recipe)) == 1, name
    ddp = {e.name: e for e in overlap.ddp_plan(bucket_mb=10)}
    assert [n for n, e in ddp.items() if e.solo] == ["single_gpu"]
    assert all(e.recipe.bucket_mb == 10 and e.recipe.precision == "bf16_autocast" for e in ddp.values())
    assert _fields(ddp["ddp_ready"].recipe, ddp["ddp_reverse"].recipe) == ["bucket_order"]
    assert _fields(ddp["ddp_ready_bf16"].recipe, ddp["ddp_ready"].recipe) == ["reduce_dtype"]
    assert _fields(ddp["ddp_ready_bf16_in_backward"].recipe, ddp["ddp_ready_bf16"].recipe) == ["optimizer_in_backward"]
    assert _fields(ddp["torch_ddp_bf16"].recipe, ddp["torch_ddp"].recipe) == ["reduce_dtype"]
    assert all(e.reference in ddp for e in ddp.values() if e.reference)
    with pytest.raises(ValueError, match="part"):
        overlap.plan_for("two_gpus")
    compiled = overlap.plan_for("ddp", 10, compile="block")
    assert [e.name for e in compiled] == list(ddp)
    assert all(_fields(e.recipe, ddp[e.name].recipe) == ["compile"] and e.recipe.compile == "block" for e in compiled)
    assert overlap.table_name("ddp", "xl", "block") == "overlap_ddp_xl_block"
    with pytest.raises(ValueError, match="ddp part only"):
        overlap.plan_for("one_gpu", compile="block")


def test_optimizer_overlap_is_the_update_kernels_time_beside_other_streams():
    """An update on a side stream from 5 to 12 ms, beside a matmul from 0 to 10 ms on the compute stream and an
    elementwise kernel from 11 to 11.5 ms on the side stream itself: 7 ms of updates, 5 of them hidden."""
    timeline = pd.DataFrame([
        ("stream 7", "compute", "sm90_xmma_gemm_bf16", 0.0, 10.0),
        ("stream 20", "compute", "multi_tensor_apply_kernel<FusedAdamMathFunctor>", 5.0, 7.0),
        ("stream 20", "compute", "elementwise_kernel", 11.0, 0.5),
        ("stream 9", "communication", "ncclDevKernel_AllReduce", 0.0, 12.0),
    ], columns=["lane", "kind", "name", "start_ms", "dur_ms"])
    assert overlap.optimizer_overlap(timeline) == dict(optimizer_ms=7.0, optimizer_overlapped_ms=5.0)
    assert overlap.optimizer_overlap(timeline.iloc[[0]]) == dict(optimizer_ms=0.0, optimizer_overlapped_ms=0.0)


@pytest.mark.parametrize("argv,phrase", [(["--part", "one_gpu", "--world-size", "2"], "one rank"),
                                         (["--part", "ddp", "--size", "huge"], "unknown model size"),
                                         (["--part", "ddp", "--world-size", "64", "--device", "cpu"], "ranks"),
                                         (["--part", "ddp", "--entries", "ddp_ready", "fsdp"], "fsdp not in the ddp"),
                                         (["--part", "one_gpu", "--compile", "block"], "applies to the ddp part")])
def test_bad_input_is_one_line(argv, phrase, capsys):
    assert overlap.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert phrase in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_the_script_measures_the_ddp_part_on_two_cpu_ranks(tmp_path):
    """tools/overlap_check.sh with a tiny model on two gloo ranks: one tarball with the table (every entry, five
    rounds, the comparisons filled) and the losses, where torch DDP and ours in both orders train alike, bf16
    communication alike under torch's hook and ours, and close to fp32."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               OVERLAP_ARGS="--context 16 --rounds 5 --steps-per-round 1 --warmup 2 --loss-steps 3 --bucket-mb 0.01 "
                            "--device cpu")
    done = subprocess.run(["bash", "tools/overlap_check.sh", "0" * 40, "ddp", "tiny", "900"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with tarfile.open(out / "overlap_ddp_tiny.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    table = pd.read_csv(tmp_path / "back" / "results" / "overlap_ddp_tiny.csv")
    assert set(COLUMNS) <= set(table.columns)
    assert list(table["entry"]) == [e.name for e in overlap.ddp_plan()]
    assert (table["status"] == "ok").all() and (table["step_n"] == 5).all()
    assert list(table["world_size"]) == [1] + [2] * 6
    assert table.set_index("entry")["vs_baseline_ratio"].drop("single_gpu").gt(0).all()
    assert table.set_index("entry").loc["ddp_ready", "comm_ms"] > 0
    losses = pd.read_csv(tmp_path / "back" / "results" / "overlap_ddp_tiny_loss.csv")
    curves = {name: list(group["loss"]) for name, group in losses.groupby("entry")}
    assert "single_gpu" not in curves and all(len(c) == 3 for c in curves.values())
    assert curves["torch_ddp"] == curves["ddp_reverse"] == curves["ddp_ready"]
    assert curves["torch_ddp_bf16"] == curves["ddp_ready_bf16"] == curves["ddp_ready_bf16_in_backward"]
    assert curves["ddp_ready_bf16"] != curves["ddp_ready"]
    assert max(abs(a - b) / b for a, b in zip(curves["ddp_ready_bf16"], curves["ddp_ready"])) < 1e-3


@pytest.mark.slow
def test_the_one_gpu_part_with_a_tiny_model_on_the_cpu(tmp_path):
    """The one-GPU plan's entries, each built eagerly (Inductor's C++ compile of six steps takes many minutes on
    a CPU; the compiled steps are the GPU's): a row per entry, and the update inside the backward trains exactly
    as the step it is read against."""
    tiny = config_for("tiny", vocab_size=64)  # the fused loss runs in Triton's interpreter: a small vocabulary
    plan = [dataclasses.replace(e, recipe=dataclasses.replace(e.recipe, compile="none"))
            for e in overlap.one_gpu_plan()]
    table, losses = overlap.measure("one_gpu", tiny, context=16, batch=2, device="cpu",
                                    interleaving=Interleaving(5, 1, 1, "resident"), loss_steps=3,
                                    artifacts_dir=str(tmp_path), plan=plan)
    assert list(table["entry"]) == [e.name for e in overlap.one_gpu_plan()]
    assert (table["status"] == "ok").all() and (table["step_n"] == 5).all()
    assert (table["optimizer_ms"] > 0).all() and (table["optimizer_overlapped_ms"] == 0).all()  # one CPU thread
    curves = {name: list(group["loss"]) for name, group in losses.groupby("entry")}
    assert curves["optimizer_in_backward"] == curves["block_compile"]


def test_busy_host_times_beside_running_neighbours_and_saves_apart(tmp_path, monkeypatch):
    """--busy-host 2: the measurement runs while two neighbours spin (alive during it, gone after), and its rows
    go to a table of their own, each saying how busy the host was."""
    def children() -> set[int]:  # this process's (a test beside may spin its own; a resource tracker may stay)
        found = set()
        for p in (p for p in os.listdir("/proc") if p.isdigit()):
            with contextlib.suppress(OSError):
                if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.add(int(p))
        return found

    before, alive = children(), []

    def fake_measure(*args, **kwargs):
        alive.extend(children() - before)
        cols = ["entry", "reference", "step_ms", "step_spread_ms", "step_n", "vs_reference_ratio",
                "vs_reference_verdict", "vs_baseline_ratio", "comm_ms", "overlap_frac", "optimizer_ms",
                "optimizer_overlapped_ms", "loss_last", "status"]
        return pd.DataFrame([dict.fromkeys(cols, 1.0)]), pd.DataFrame(columns=["entry", "step", "loss"])

    monkeypatch.setattr(overlap, "measure", fake_measure)
    assert overlap.main(["--part", "ddp", "--size", "tiny", "--device", "cpu", "--busy-host", "2",
                         "--results-dir", str(tmp_path)]) == 0
    assert len(alive) >= 2 and not any(Path(f"/proc/{p}").exists() for p in alive)
    saved = pd.read_csv(tmp_path / "overlap_ddp_tiny_busy2.csv")
    assert list(saved["busy_host"]) == [2]
    assert overlap.table_name("ddp", "xl", "block", busy_host=16) == "overlap_ddp_xl_block_busy16"
