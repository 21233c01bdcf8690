"""The fastest step's CUDA-graph, offload and HSDP choices: recipes that validate, steps that train exactly
as the plain step (fp32, gloo), and rows that record what each choice did."""

import dataclasses
import gc
import math
import time

import pytest
import torch

from lab.accounting.collectives import ring_bytes_per_rank
from lab.bench import fastest as bench
from lab.parallel import launcher
from lab.parallel.collectives import TrafficLog
from lab.recipes import fastest_step as fs
from lab.recipes import step_parts
from tests.recipes.test_fastest_step import reference_step

CPU = torch.device("cpu")
#: fp32 and eager, so that steps can be compared bit for bit on the CPU
PLAIN = dataclasses.replace(fs.PROJECT, precision="fp32", compile="none", fused_loss=False, fused_adamw=False,
                            offload=0)


# ----------------------------------------------------------------------------------------------------------
# recipes


def test_new_choices_validate_and_ablate_one_thing_at_a_time():
    names = [r.name for r in fs.ablations(fs.PROJECT)]
    # the book's step offloads a quarter: the ablations offload more, or nothing
    assert fs.PROJECT.offload == 0.25 and names[-3:] == ["offload_half", "offload_all", "no_offload"]
    assert "offload_quarter" not in names and "cuda_graphs" not in names
    assert next(r for r in fs.ablations(fs.PROJECT) if r.name == "no_offload").offload == 0
    one = [r.name for r in fs.ablations(fs.PROJECT_ONE_GPU)]
    assert "cuda_graphs" in one and "offload_half" not in one  # nothing is recomputed on one GPU
    graphs = next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs")
    assert graphs.compile == "model_cudagraphs"
    for name in ("cuda_graphs", "offload_half", "offload_all", "no_offload"):
        assert fs.change_label(name) != name
    with pytest.raises(ValueError, match="offload"):
        fs.Recipe(offload=1.5)
    with pytest.raises(ValueError, match="offload"):
        dataclasses.replace(fs.STOCK_EAGER, offload=0.5)
    with pytest.raises(ValueError, match="offload"):
        dataclasses.replace(fs.PROJECT_ONE_GPU, offload=0.5)  # a whole-model compile
    with pytest.raises(ValueError, match="sharding"):
        fs.Recipe(sharding="hybrid")
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        dataclasses.replace(fs.STOCK_EAGER, sharding="fsdp2_hsdp", optimizer_in_backward=True)
    with pytest.raises(ValueError, match="hooks"):
        fs.build_model(fs.CONFIGS["tiny"].model, dataclasses.replace(fs.PROJECT, sharding="hsdp",
                                                                      compile="model_cudagraphs", offload=0), CPU)
    # the offload and our HSDP are the book's parts; CUDA graphs and FSDP2's HSDP are stock options
    hsdp = dataclasses.replace(fs.PROJECT, sharding="hsdp", offload=0.5)
    stock = dataclasses.replace(fs.STOCK_EAGER, sharding="fsdp2_hsdp")
    assert {f: option for f, _, _, option in fs.differences(hsdp, stock)} == dict(
        fused_loss=False, sharding=False, checkpoint=True, compile=True, offload=False)
    assert fs.stock_options(next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs"),
                            fs.PROJECT_ONE_GPU) == ["compile"]
    assert [step_parts.offloaded_count(f, 34) for f in (0, 0.25, 0.5, 1.0)] == [0, 8, 17, 33]
    assert [step_parts.offloaded_count(f, 2) for f in (0, 0.25, 1.0)] == [0, 1, 1]  # at least one, never the last


def test_an_offload_the_host_cannot_hold_is_refused_as_out_of_memory():
    from lab.measure.device import is_oom

    step_parts.check_host_memory(3 * 2**30, 2, available=10 * 2**30)  # 6 of 8 GiB allowed
    with pytest.raises(MemoryError, match="pinned host memory") as info:
        step_parts.check_host_memory(5 * 2**30, 2, available=10 * 2**30)
    assert is_oom(info.value)


# ----------------------------------------------------------------------------------------------------------
# CUDA graphs


def test_the_offload_share_the_host_holds():
    """Two ranks of 3 GiB a block on a host of 40 GiB: 0.8 x 40 / 6 = 5 blocks of 8; never the last block."""
    assert step_parts.offload_that_fits(3 * 2**30, 8, 2, available=40 * 2**30) == 5 / 8
    assert step_parts.offload_that_fits(3 * 2**30, 8, 2, available=400 * 2**30) == 7 / 8
    assert step_parts.offload_that_fits(3 * 2**30, 8, 2, available=5 * 2**30) == 0
    share = fs.offload_for_host(fs.CONFIGS["leaderboard"], fs.PROJECT, available=2**38)  # 256 GiB
    blocks = step_parts.offloaded_count(share, 34)
    saved = fs.saved_activation_bytes(fs.LEADERBOARD, 1, 32_768, "bf16")["blocks"] / 34
    assert 0 < blocks < 33 and blocks * saved * 2 <= step_parts.HOST_HEADROOM * 2**38 < (blocks + 1) * saved * 2
    step_parts.check_host_memory(blocks * saved, 2, available=2**38)  # what fits passes the build's own check


def test_cuda_graphs_apply_on_a_gpu_only():
    assert step_parts.compile_options("model_cudagraphs", torch.device("cuda", 0)) == dict(mode="reduce-overhead")
    assert step_parts.compile_options("model_cudagraphs", CPU) == {}
    assert step_parts.compile_options("model", torch.device("cuda", 0)) == {}
    recipe = next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs")
    step = fs.build_step(fs.CONFIGS["tiny_one_rank"], recipe, CPU)  # compiled lazily: nothing runs here
    assert step.loss_fn is fs.summed_loss  # no step marks on the CPU


def test_each_step_marks_its_beginning_for_cudagraph_trees(monkeypatch):
    """Cudagraph trees reuse a graph's output memory at the next replay: every step, and only once a step,
    first declares the previous step's outputs dead; the loss is the unmarked one."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    config = fs.CONFIGS["tiny_one_rank"]
    plain = fs.build_step(config, PLAIN, CPU)
    marked = fs.build_step(config, PLAIN, CPU)
    marked.loss_fn = step_parts.marking_steps(marked.loss_fn)
    for i in range(3):
        plain()
        marked()
        assert len(marks) == i + 1
    assert torch.equal(marked.forward(), plain.forward())
    for p, q in zip(plain.model.parameters(), marked.model.parameters()):
        assert torch.equal(p, q)


def _cheap_build(config, recipe, device, seed=0, rank=0):
    """The row's bookkeeping is under test, not the step: no Inductor compile and no Triton kernel in the
    interpreter (minutes on the CPU)."""
    cheap = dataclasses.replace(recipe, compile="none", fused_loss=False, fused_adamw=False, precision="fp32")
    return fs.build_step(config, cheap, device, seed, rank)


def test_a_cuda_graph_row_on_the_cpu_says_they_did_not_apply(monkeypatch):
    monkeypatch.setattr(bench, "build_step", _cheap_build)  # no Inductor compile on the CPU
    recipe = next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs")
    row = bench.measure_recipe(fs.CONFIGS["tiny_one_rank"], recipe, CPU, profile=False, host_steps=2)
    assert row["status"] == "ok" and row["cuda_graphs"] is False and "GPU" in row["note"]
    assert math.isnan(row["offload_bytes"]) and math.isnan(row["within_node_bytes"]) and row["nodes"] == 1


def test_graphs_inductor_left_out_of_cuda_graphs_are_noted(monkeypatch):
    """On a GPU Inductor may run a graph without capturing it (its log says why): the row says how many."""
    from torch._dynamo.utils import counters

    def build(*args, **kwargs):
        step = _cheap_build(*args, **kwargs)
        first = step.forward_backward

        def skipping():
            counters["inductor"]["cudagraph_skips"] += 2
            first()
            step.forward_backward = first

        step.forward_backward = skipping
        return step

    monkeypatch.setattr(bench, "build_step", build)
    monkeypatch.setattr(bench, "uses_cuda_graphs", lambda compile, device: True)  # as on a GPU
    recipe = next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs")
    row = bench.measure_recipe(fs.CONFIGS["tiny_one_rank"], recipe, CPU, profile=False, host_steps=2)
    assert row["cuda_graphs"] is True and "2 graph(s)" in row["note"]


def test_a_captured_step_is_timed_only_after_its_graphs_are_recorded(monkeypatch):
    """Cudagraph trees record on a function's second call: a row of a captured step runs the first step, then
    CUDA_GRAPH_WARMUP_STEPS more, and only then the timed ones (here the CPU's host-timed two)."""
    calls = []

    def build(*args, **kwargs):
        step = _cheap_build(*args, **kwargs)
        inner = step.forward_backward
        step.forward_backward = lambda: (calls.append(time.perf_counter()), inner())
        return step

    monkeypatch.setattr(bench, "build_step", build)
    monkeypatch.setattr(bench, "uses_cuda_graphs", lambda compile, device: True)  # as on a GPU
    recipe = next(r for r in fs.ablations(fs.PROJECT_ONE_GPU) if r.name == "cuda_graphs")
    row = bench.measure_recipe(fs.CONFIGS["tiny_one_rank"], recipe, CPU, profile=False, host_steps=2, samples=3)
    assert row["step_n"] == 3 and row["timer"] == "host"  # the larger of host_steps and samples
    assert len(calls) == 1 + step_parts.CUDA_GRAPH_WARMUP_STEPS + 3
    counted = []
    times = step_parts.warm_up_cuda_graphs(lambda: counted.append(1), CPU, steps=4)
    assert len(counted) == len(times) == 4 and all(t >= 0 for t in times)


@pytest.mark.gpu
def test_cuda_graph_step_trains_as_the_compiled_step_on_a_gpu():
    """Past cudagraph trees' warm-up and recording, replayed steps (whose outputs share memory from one replay
    to the next) train as the same compiled model without CUDA graphs (fp32)."""
    config, cuda = fs.CONFIGS["tiny_one_rank"], torch.device("cuda")
    compiled = dataclasses.replace(fs.PROJECT_ONE_GPU, precision="fp32", fused_loss=False)
    graphs = dataclasses.replace(compiled, compile="model_cudagraphs")
    a, b = fs.build_step(config, compiled, cuda), fs.build_step(config, graphs, cuda)
    for _ in range(5):
        a()
        b()
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    row = bench.measure_recipe(config, graphs, cuda, profile=False, host_steps=2, rep_ms=200)
    assert row["status"] == "ok" and row["cuda_graphs"] is True and row["note"] == ""
    # like the book's compiled step: do_bench over many replays, not two host-timed steps (one recording)
    assert row["timer"] == "do_bench" and row["step_n"] >= 10 and row["step_ms"] > 0


# ----------------------------------------------------------------------------------------------------------
# activation offload


@pytest.mark.parametrize("offload", [0.5, 1.0])
def test_offloaded_step_trains_as_the_plain_step_on_one_rank(offload):
    config = fs.CONFIGS["tiny_one_rank"]
    plain = fs.build_step(config, PLAIN, CPU)
    offloaded = fs.build_step(config, dataclasses.replace(PLAIN, offload=offload), CPU, offload_min_bytes=0)
    blocks = offloaded.model.blocks
    assert [type(b.block).__name__ for b in blocks] == ["TransformerBlock", "CheckpointedBlock"]  # 1 of 2 blocks
    for _ in range(3):
        plain()
        offloaded()
    for (name, p), q in zip(plain.model.named_parameters(), offloaded.model.parameters()):
        assert torch.equal(p, q), name
    stats = offloaded.offloader.stats()
    assert stats.bytes_offloaded == stats.bytes_fetched > 0
    model = offloaded.model
    del offloaded, plain
    gc.collect()
    assert type(model.blocks[0]).__name__ == "TransformerBlock"  # the offloading left with the step


@pytest.mark.slow
def test_offload_composes_with_the_compiled_pointwise_modules():
    """The book's step compiles RMSNorm, RoPE and the SwiGLU gate: under the offloader's saved-tensor hooks
    their compiled graphs save through the hooks too, and the step still trains bit for bit as without."""
    config = fs.CONFIGS["tiny_one_rank"]
    compiled = dataclasses.replace(PLAIN, compile="pointwise")
    plain = fs.build_step(config, compiled, CPU)
    offloaded = fs.build_step(config, dataclasses.replace(compiled, offload=1.0), CPU, offload_min_bytes=0)
    for _ in range(2):
        plain()
        offloaded()
    for (name, p), q in zip(plain.model.named_parameters(), offloaded.model.parameters()):
        assert torch.equal(p, q), name
    assert offloaded.offloader.stats().bytes_offloaded > 0


def test_offload_row_counts_one_steps_bytes(monkeypatch):
    config = fs.CONFIGS["tiny_one_rank"]
    recipe = dataclasses.replace(PLAIN, name="offload_all", offload=1.0)

    def build(*args, **kwargs):
        return fs.build_step(*args, **kwargs, offload_min_bytes=0)

    step = build(config, recipe, CPU)
    step.offloader.reset_stats()
    step()
    one = step.offloader.stats().bytes_offloaded
    monkeypatch.setattr(bench, "build_step", build)
    row = bench.measure_recipe(config, recipe, CPU, profile=False, host_steps=3)
    assert row["offload_bytes"] == one > 0 and row["offload_wait_ms"] >= 0


def offload_worker(recipe):
    """Inside a launched process: two steps of ``recipe`` on the tiny configuration; the full weights."""
    step = fs.build_step(fs.CONFIGS["tiny"], recipe, launcher.device(), rank=launcher.rank(), offload_min_bytes=0)
    step()
    step()
    moved = 0
    if hasattr(step, "offloader"):
        moved = step.offloader.stats().bytes_offloaded
        step.close_offloading()  # the blocks as lab.FSDP named them
    weights = step.model.gather_full_params()
    return {n.replace(".block.", "."): w for n, w in weights.items()}, moved


@pytest.mark.slow
def test_offloaded_step_under_lab_fsdp_trains_as_without():
    plain = launcher.launch(offload_worker, 2, PLAIN, device="cpu")
    offloaded = launcher.launch(offload_worker, 2, dataclasses.replace(PLAIN, offload=1.0), device="cpu")
    assert plain[0][1] == 0 and offloaded[0][1] > 0
    for name, weight in plain[0][0].items():
        assert torch.equal(offloaded[0][0][name], weight), name


# ----------------------------------------------------------------------------------------------------------
# HSDP


def test_node_size_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert step_parts.node_size(4) == 2 and step_parts.node_size(4, 4) == 4
    with pytest.raises(ValueError, match="whole nodes"):
        step_parts.node_size(4, 3)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert step_parts.node_size(4) == 4


def test_traffic_closed_forms():
    """Within a node and across nodes, by hand for the tiny model on two nodes of two ranks."""
    cfg = fs.CONFIGS["tiny_hsdp"].model
    d, f, v, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
    block, small = 4 * d * d + 3 * f * d, L * 2 * d + d
    ours = step_parts.sharded_traffic(cfg, "hsdp", 4, 2, 4, 4)
    gathered, grads = (2 * L * block + v * d + 2 * v * d) * 4, (L * block + 2 * v * d) * 4
    assert ours["within_node_bytes"] == pytest.approx(0.5 * gathered + 0.5 * grads + small * 4)
    assert ours["across_node_bytes"] == pytest.approx(grads / 2 + small * 4)  # all-reduce over 2: 2(r-1)/r = 1
    flat = step_parts.sharded_traffic(cfg, "fsdp", 4, 4, 4, 4)
    assert flat["across_node_bytes"] == 0 and flat["within_node_bytes"] == pytest.approx(
        0.75 * gathered + 0.75 * grads + 1.5 * small * 4)
    over_two = step_parts.sharded_traffic(cfg, "fsdp", 4, 2, 4, 4)  # a flat ring over two nodes
    assert over_two["across_node_bytes"] * 2 == pytest.approx(sum(flat.values()))
    stock = step_parts.sharded_traffic(cfg, "fsdp2_hsdp", 4, 2, 2, 2)
    root = v * d * 2 + d
    per_block = block + 2 * d
    gathered2, grads2 = (2 * L * per_block + root) * 2, (L * per_block + root) * 2  # bf16
    assert stock["within_node_bytes"] == pytest.approx(0.5 * gathered2 + 0.5 * grads2)
    assert stock["across_node_bytes"] == pytest.approx((L * per_block + root) * 2 / 2)
    row = bench.empty_row(fs.CONFIGS["tiny_hsdp"], dataclasses.replace(fs.PROJECT, sharding="hsdp"))
    assert row["nodes"] == 2 and row["across_node_bytes"] > 0


def test_data_parallel_traffic_is_one_all_reduce_of_every_gradient():
    """Two ranks: a ring all-reduce sends the gradients' bytes once (2(n-1)/n = 1), in the communication dtype;
    over two nodes of two ranks, one hop in two of the ring leaves its node."""
    cfg = fs.CONFIGS["tiny_hsdp"].model
    d, f, v, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
    grads = 2 * v * d + L * (4 * d * d + 3 * f * d + 2 * d) + d
    ddp = fs.Recipe("ddp", attention="sdpa", fused_loss=False, sharding="ddp", checkpoint="none", compile="none",
                    precision="bf16_autocast")
    two = fs.StepConfig("tiny", cfg, 64, 1, 2)
    assert fs.step_traffic(two, ddp) == dict(nodes=1, within_node_bytes=4 * grads, across_node_bytes=0.0)
    bf16 = dataclasses.replace(ddp, reduce_dtype="bf16")
    assert fs.step_traffic(two, bf16)["within_node_bytes"] == 2 * grads
    torch_ddp = dataclasses.replace(ddp, sharding="torch_ddp", precision="bf16")  # bf16 gradients: 2 bytes anyway
    assert fs.step_traffic(two, torch_ddp)["within_node_bytes"] == 2 * grads
    four = fs.StepConfig("tiny", cfg, 64, 1, 4, gpus_per_node=2)
    sent = ring_bytes_per_rank("all_reduce", 4 * grads, 4)
    assert fs.step_traffic(four, ddp) == dict(nodes=2, within_node_bytes=sent / 2, across_node_bytes=sent / 2)
    assert math.isnan(fs.step_traffic(two, fs.PROJECT_ONE_GPU)["within_node_bytes"])


def hsdp_worker(recipe):
    """Inside a launched process: one step of ``recipe`` on tiny_hsdp under a traffic log; this rank's loss,
    batch, full gradients and weights (lab.FSDP) or full weights (FSDP2), and the log's bytes by collective."""
    config = fs.CONFIGS["tiny_hsdp"]
    step = fs.build_step(config, recipe, launcher.device(), seed=0, rank=launcher.rank())
    model = step.model
    with TrafficLog() as log:
        loss = step.forward()
        step.backward(loss)
    if recipe.sharding == "hsdp":
        grads = {n.replace(".block.", "."): g for n, g in model.gather_full_grads().items()}
        step.optimizer_step()
        weights = {n.replace(".block.", "."): w for n, w in model.gather_full_params().items()}
    else:
        step.optimizer_step()
        grads = None
        weights = {n.replace(".block.", ".").replace("_orig_mod.", ""): p.full_tensor()
                   for n, p in model.named_parameters()}
    return loss.detach(), step.tokens, step.targets, grads, weights, log.summary()


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["hsdp", "fsdp2_hsdp"])
def test_hsdp_on_two_nodes_of_two_ranks_matches_the_plain_step(sharding):
    """tiny_hsdp (four gloo ranks as two nodes of two) trains like one process on the global batch (fp32);
    for lab.FSDP the bytes its collectives carry are those of the closed form."""
    recipe = dataclasses.replace(PLAIN, sharding=sharding, checkpoint="block", offload=0)
    config = fs.CONFIGS["tiny_hsdp"]
    out = launcher.launch(hsdp_worker, 4, recipe, device="cpu")
    tokens, targets = torch.cat([o[1] for o in out]), torch.cat([o[2] for o in out])
    loss, ref_grads, ref = reference_step(config, recipe, tokens, targets)
    torch.testing.assert_close(sum(o[0] for o in out), loss, rtol=1e-5, atol=1e-5)
    for name, weight in ref.items():
        grad = ref_grads[name]
        scale = grad.abs().max()
        if out[0][3] is not None:
            torch.testing.assert_close(out[0][3][name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
        sure = grad.abs() > 1e-3 * scale  # AdamW's first update is lr * sign(g)
        torch.testing.assert_close(out[0][4][name][sure], weight[sure], rtol=1e-5, atol=1e-6, msg=name)
        for other in out[1:]:
            torch.testing.assert_close(other[4][name], out[0][4][name], rtol=0, atol=0)
    if sharding == "hsdp":
        log = out[0][5]
        cfg = config.model
        small = (cfg.num_layers * 2 * cfg.d_model + cfg.d_model) * 4
        within = (ring_bytes_per_rank("all_gather", log["all_gather"], 2)
                  + ring_bytes_per_rank("reduce_scatter", log["reduce_scatter"], 2)
                  + ring_bytes_per_rank("all_reduce", small, 2))
        across = ring_bytes_per_rank("all_reduce", log["all_reduce"] - small, 2)
        closed = fs.step_traffic(config, recipe)  # the first blocks recomputed: the embedding regathered
        assert closed["within_node_bytes"] == pytest.approx(within)
        assert closed["across_node_bytes"] == pytest.approx(across)



def test_two_node_configurations_shard_within_nodes():
    hybrid = fs.recipes_for(fs.CONFIGS["leaderboard_hsdp"])
    assert {n: r.sharding for n, r in hybrid.items()} == dict(project="hsdp", stock_eager="fsdp2_hsdp",
                                                              stock_compiled="fsdp2_hsdp")
    assert fs.CONFIGS["leaderboard_hsdp"].tokens_per_step == 4 * 32_768
    flat = next(r for r in fs.ablations(hybrid["project"]) if r.name == "flat_sharding")
    assert flat.sharding == "fsdp" and "flat_sharding" not in [r.name for r in fs.ablations(fs.PROJECT)]
    one_node = dataclasses.replace(fs.CONFIGS["tiny_hsdp"], gpus_per_node=4)
    assert fs.recipes_for(one_node)["project"].sharding == "fsdp"
