"""lab.recipes.recipe: the switches that hide the optimizer and the gradients' communication validate, ablate one
choice at a time, change in the built step what they say (gloo, 2 ranks), and train as the plain step (fp32)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lab.model import ModelConfig
from lab.parallel import launcher
from lab.parallel.ddp import DDPBucketed
from lab.parallel.optimizer_in_backward import OptimizerInBackward
from lab.recipes import fastest_step as fs
from lab.recipes import recipe as rc

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=40, context_length=16)
TWO_RANKS = fs.StepConfig("tiny", TINY, context=16, batch_per_rank=1, world_size=2)
ONE_RANK = fs.StepConfig("tiny_one_rank", TINY, context=16, batch_per_rank=2, world_size=1)
#: data parallelism in fp32 and eager, so that steps can be compared bit for bit on the CPU; small buckets
DDP = rc.Recipe("ddp", attention="sdpa", fused_loss=False, sharding="ddp", checkpoint="none", compile="none",
                precision="fp32", fused_adamw=False, bucket_mb=0.01)


def test_the_new_switches_validate():
    for bad, phrase in ((dict(sharding="fsdp", bucket_order="reverse"), "bucket_order"),
                        (dict(sharding="none", reduce_dtype="bf16"), "reduce_dtype"),
                        (dict(sharding="torch_ddp", optimizer_in_backward=True), "optimizer_in_backward"),
                        (dict(sharding="none", compile="model", optimizer_in_backward=True), "whole-model"),
                        (dict(sharding="ddp", compile="model"), "whole-model"),
                        (dict(sharding="ddp", offload=0.5, compile="none"), "offload"),
                        (dict(sharding="none", clip_grad_norm=-1.0), "clip_grad_norm"),
                        (dict(sharding="fsdp", clip_grad_norm=1.0), "shards"),
                        (dict(sharding="ddp", bucket_mb=0), "bucket_mb"),
                        (dict(sharding="ddp", bucket_order="sideways"), "bucket_order")):
        with pytest.raises(ValueError, match=phrase):
            dataclasses.replace(DDP, **bad)
    # one rank reduces nothing: the data-parallel switches go with the sharding
    alone = dataclasses.replace(DDP, bucket_order="reverse", reduce_dtype="bf16").for_world(1)
    assert (alone.sharding, alone.bucket_order, alone.reduce_dtype) == ("none", "ready", "grad")
    # the stock options among them: torch DDP with its bf16 hook and clip_grad_norm_; lab.DDPBucketed is ours
    torch_bf16 = dataclasses.replace(DDP, sharding="torch_ddp", reduce_dtype="bf16", clip_grad_norm=1.0)
    assert rc.stock_options(torch_bf16, DDP) == ["sharding", "reduce_dtype", "clip_grad_norm"]
    assert rc.stock_options(DDP, torch_bf16) == ["reduce_dtype", "clip_grad_norm"]  # lab.DDPBucketed is ours


def _names(recipes):
    return [r.name for r in recipes]


def _changed(a: rc.Recipe, b: rc.Recipe) -> list[str]:
    return [f.name for f in dataclasses.fields(rc.Recipe)
            if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)]


def test_overlap_ablations_change_one_choice_against_what_they_are_read_against():
    one = rc.PROJECT_ONE_GPU
    assert _names(rc.overlap_ablations(one)) == ["block_compile", "clip_grad_norm", "optimizer_in_backward_clipped"]
    assert rc.overlap_ablations(rc.PROJECT) == []  # lab.FSDP's shards: no global norm; the in-backward is an ablation
    autocast_ddp = dataclasses.replace(DDP, precision="bf16_autocast", compile="block", optimizer_in_backward=True)
    assert _names(rc.overlap_ablations(autocast_ddp)) == ["no_optimizer_in_backward", "clip_grad_norm",
                                                         "reverse_bucket_order", "bf16_reduce"]
    bf16_params = dataclasses.replace(autocast_ddp, precision="bf16")  # the gradients are bf16 already
    assert "bf16_reduce" not in _names(rc.overlap_ablations(bf16_params))
    assert _names(rc.overlap_ablations(dataclasses.replace(autocast_ddp, reduce_dtype="bf16")))[-1] == \
        "grad_dtype_reduce"
    for base in (one, autocast_ddp, DDP):
        known = {base.name: base, **{r.name: r for r in rc.ablations(base) + rc.overlap_ablations(base)}}
        for r in rc.overlap_ablations(base):
            assert rc.change_label(r.name) != r.name
            against = known[rc.compared_with(r, base)]
            assert len(_changed(r, against)) == 1, (base.name, r.name, _changed(r, against))


# ----------------------------------------------------------------------------------------------------------
# what each switch does in the step it builds (2 gloo ranks)


def _step_facts(recipe: rc.Recipe) -> dict:
    """Build the step on this rank and run one by phases, watching the all-reduces: what was built, the dtypes
    that travelled, the gradients left after the backward, and the gradients' global norm after the update."""
    step = fs.build_step(TWO_RANKS, recipe, launcher.device(), rank=launcher.rank())
    travelled = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        travelled.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        loss = step.forward()
        step.backward(loss)
        grads_left = sum(p.grad is not None for p in step.model.parameters())
        step.optimizer.step()
        grads = [p.grad for p in step.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).item() if grads else None
    finally:
        dist.all_reduce = original
    model = step.model
    return dict(wrapper=type(model).__name__, optimizer=type(step.optimizer).__name__,
                follows=getattr(step.optimizer, "_ddp", None) is model,
                order=getattr(model, "bucket_order", None), ready_order=getattr(model, "ready_order", None),
                bucket_dtypes=sorted({str(b.buffer.dtype) for b in getattr(model, "buckets", [])}),
                travelled=sorted({str(t) for t in travelled}), grads_left=grads_left, norm=norm,
                params=sum(1 for _ in model.parameters()))


def switches_worker(recipes: list[rc.Recipe]) -> list[dict]:
    return [_step_facts(r) for r in recipes]


def test_each_switch_changes_what_it_says_in_the_built_step():
    recipes = [DDP, dataclasses.replace(DDP, bucket_order="reverse"), dataclasses.replace(DDP, reduce_dtype="bf16"),
               dataclasses.replace(DDP, optimizer_in_backward=True), dataclasses.replace(DDP, clip_grad_norm=1e-3),
               dataclasses.replace(DDP, sharding="torch_ddp", reduce_dtype="bf16")]
    plain, reverse, bf16, inside, clipped, torch_bf16 = launcher.launch(switches_worker, 2, recipes, device="cpu",
                                                                        timeout_s=180)[0]
    assert (plain["wrapper"], plain["order"], plain["travelled"]) == ("DDPBucketed", "ready", ["torch.float32"])
    assert plain["ready_order"] is None  # recorded in the first backward, and the buckets rebuilt after it
    assert (reverse["order"], reverse["ready_order"]) == ("reverse", None)  # never recorded
    assert bf16["bucket_dtypes"] == ["torch.bfloat16"] and bf16["travelled"] == ["torch.bfloat16"]
    assert plain["grads_left"] == plain["params"] and plain["norm"] > 1e-3
    assert (inside["optimizer"], inside["follows"], inside["grads_left"]) == ("OptimizerInBackward", True, 0)
    assert clipped["optimizer"] == "AdamW" and clipped["norm"] == pytest.approx(1e-3, rel=1e-4)
    assert torch_bf16["wrapper"] == "DistributedDataParallel" and torch_bf16["travelled"] == ["torch.bfloat16"]
    assert issubclass(DDPBucketed, torch.nn.Module) and issubclass(OptimizerInBackward, torch.optim.Optimizer)


# ----------------------------------------------------------------------------------------------------------
# the same weights as the plain step (fp32, bit for bit)


def weights_worker(recipes: list[rc.Recipe], config: fs.StepConfig, steps: int = 3) -> list[list[torch.Tensor]]:
    out = []
    for recipe in recipes:
        step = fs.build_step(config, recipe, launcher.device(), rank=launcher.rank())
        for _ in range(steps):
            step()
        inner = getattr(step.model, "module", step.model)
        out.append([p.detach().clone() for p in inner.parameters()])
    return out


def _assert_same(weights: list[list[torch.Tensor]], names: list[str]) -> None:
    for name, other in zip(names[1:], weights[1:]):
        for p, q in zip(weights[0], other):
            assert torch.equal(p, q), name


def test_data_parallel_recipes_train_as_the_plain_step():
    """Two gloo ranks: the optimizer inside the backward (after each bucket's all-reduce), buckets in either order
    and torch DDP give the plain bucketed step's weights, clipped or not."""
    variants = dict(plain=DDP, inside=dataclasses.replace(DDP, optimizer_in_backward=True),
                    reverse=dataclasses.replace(DDP, bucket_order="reverse"),
                    torch_ddp=dataclasses.replace(DDP, sharding="torch_ddp"),
                    clipped=dataclasses.replace(DDP, clip_grad_norm=0.05),
                    inside_clipped=dataclasses.replace(DDP, optimizer_in_backward=True, clip_grad_norm=0.05))
    out = launcher.launch(weights_worker, 2, list(variants.values()), TWO_RANKS, device="cpu", timeout_s=240)
    for rank in out:
        _assert_same(rank[:4], list(variants)[:4])
        _assert_same(rank[4:], list(variants)[4:])
        assert not all(torch.equal(p, q) for p, q in zip(rank[0], rank[4]))  # the clipping changed the update
    for p, q in zip(out[0][0], out[1][0]):
        assert torch.equal(p, q)  # the replicas agree


def test_one_rank_clipped_update_inside_the_backward_trains_as_the_plain_clipped_step():
    plain = dataclasses.replace(rc.PROJECT_ONE_GPU, precision="fp32", compile="none", fused_loss=False,
                                fused_adamw=False, clip_grad_norm=0.05)
    inside = dataclasses.replace(plain, optimizer_in_backward=True)
    _assert_same(weights_worker([plain, inside], ONE_RANK), ["plain", "inside"])
