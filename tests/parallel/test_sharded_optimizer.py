"""ShardedOptimizer and ZeRO-1 against unsharded AdamW (gloo, 2 processes, fp32, exact equality).

Why exact equality is possible: AdamW updates every element independently, so an optimizer that owns a
subset of the parameters computes bit for bit what the unsharded one computes for them, given the same
averaged gradient. The gradients are averaged the same way on both sides (sum over the 2 ranks, then
divide by 2): a sum of two numbers does not depend on the order, and dividing by a power of two is exact.
ZeRO-1 updates a flat slice instead of the parameter tensors; elementwise kernels give the same result for
an element wherever it sits in a tensor (the vectorized and the scalar tail loops round the same way on
the CPUs we run on), so ZeRO-1 is also compared with ``torch.equal``.
"""

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lab.model.transformer import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel.sharded_optimizer import (
    ShardedOptimizer,
    TrafficLog,
    assign_balanced,
    optimizer_traffic,
    record_collective,
    ring_bytes_per_rank,
)
from lab.parallel.zero1 import ZeRO1Optimizer

CFG = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=64)
STEPS = 10
ADD_GROUP_AT = 4  # the LM head joins the optimizer as a third parameter group at this step


def _model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(CFG)


def _groups(model: TransformerLM):
    """Two groups with their own hyperparameters, and a third (the LM head) added during training."""
    head = {id(model.lm_head.weight)}
    matrices = [p for p in model.parameters() if p.ndim == 2 and id(p) not in head]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    first = [{"params": matrices, "lr": 1e-2, "weight_decay": 0.1},
             {"params": vectors, "lr": 3e-3, "weight_decay": 0.0}]
    late = {"params": [model.lm_head.weight], "lr": 5e-3, "betas": (0.8, 0.95)}
    return first, late


def _local_loss(model, step: int) -> torch.Tensor:
    """Mean cross-entropy on this rank's batch (different on each rank and step)."""
    g = torch.Generator().manual_seed(1000 * step + distributed.rank())
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))


def _all_reduce_mean(model) -> None:
    """What DDP does to the gradients: sum over ranks, divide by the world size."""
    for p in model.parameters():
        record_collective("all_reduce", p.grad)
        dist.all_reduce(p.grad)
        p.grad.div_(distributed.world_size())


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def _state_equal(sd_a: dict, sd_b: dict) -> bool:
    if sorted(sd_a["state"]) != sorted(sd_b["state"]):
        return False
    for k, sa in sd_a["state"].items():
        sb = sd_b["state"][k]
        if sorted(sa) != sorted(sb) or not all(torch.equal(sa[n].cpu(), sb[n].cpu()) for n in sa):
            return False
    return sd_a["param_groups"] == sd_b["param_groups"]


# ----------------------------------------------------------------------------------------------------------
# workers (module level so spawned processes can import them)


def _sharded_worker(steps: int) -> dict:
    warnings.simplefilter("error")  # no Python warnings in normal use
    torch.use_deterministic_algorithms(True)
    model, ref = _model(), _model()
    first, late = _groups(model)
    ref_first, ref_late = _groups(ref)
    # 8 KB chunks: the step updates and broadcasts the parameters in several chunks
    opt = ShardedOptimizer(first, torch.optim.AdamW, lr=1e-3, chunk_size_mb=0.008)
    ref_opt = torch.optim.AdamW(ref_first, lr=1e-3)
    equal_each_step, traffic = [], None
    for step in range(steps):
        if step == ADD_GROUP_AT:
            opt.add_param_group(late)
            ref_opt.add_param_group(ref_late)
        if step == ADD_GROUP_AT + 2:  # what an LR scheduler does: edit the outer groups between steps
            for o in (opt, ref_opt):
                o.param_groups[0]["lr"] *= 0.5
        opt.zero_grad()
        ref_opt.zero_grad()
        _local_loss(model, step).backward()
        _local_loss(ref, step).backward()
        with TrafficLog() as log:
            _all_reduce_mean(model)
            opt.step()
        _all_reduce_mean(ref)
        ref_opt.step()
        if step == steps - 1:
            traffic = log
        equal_each_step.append(_same(model, ref))
    # checkpoint: the gathered state must be the unsharded optimizer's state, and survive a save/load
    sd = opt.state_dict()
    ref_sd = copy.deepcopy(ref_opt.state_dict())
    buf = io.BytesIO()
    torch.save(sd, buf)
    restored = ShardedOptimizer(_groups(model)[0], torch.optim.AdamW, lr=1e-3)
    restored.add_param_group(_groups(model)[1])
    restored.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    for step in range(steps, steps + 3):
        restored.zero_grad()
        ref_opt.zero_grad()
        _local_loss(model, step).backward()
        _local_loss(ref, step).backward()
        _all_reduce_mean(model)
        _all_reduce_mean(ref)
        restored.step()
        ref_opt.step()
        equal_each_step.append(_same(model, ref))
    inner_state_numel = sum(t.numel() for s in opt.inner.state.values() for t in s.values() if t.ndim > 0)
    return {"equal": equal_each_step, "state_equal": _state_equal(sd, ref_sd),
            "local_numel": opt.local_numel(), "inner_state_numel": inner_state_numel, "chunks": len(opt._chunks()),
            "n_params": sum(p.numel() for p in model.parameters()),
            "largest": max(p.numel() for p in model.parameters()),
            "lr_groups": [g["lr"] for g in opt.param_groups], "betas": opt.param_groups[2]["betas"],
            "broadcast_bytes": traffic.bytes_per_rank(distributed.world_size(), "broadcast"),
            "all_reduce_bytes": traffic.bytes_per_rank(distributed.world_size(), "all_reduce")}


def _zero1_worker(steps: int) -> dict:
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    model, ref = _model(), _model()
    first, late = _groups(model)
    ref_first, ref_late = _groups(ref)
    # 10 KB buckets: several per group, so the in-order launching from backward hooks is exercised
    opt = ZeRO1Optimizer(first, torch.optim.AdamW, lr=1e-3, bucket_size_mb=0.01)
    ref_opt = torch.optim.AdamW(ref_first, lr=1e-3)
    equal, logs, launched_in_backward = [], [], []
    for step in range(steps):
        if step == ADD_GROUP_AT:
            opt.add_param_group(late)
            ref_opt.add_param_group(ref_late)
        opt.zero_grad()
        ref_opt.zero_grad()
        _local_loss(ref, step).backward()
        with TrafficLog() as log:
            # no all-reduce: ZeRO-1 is the gradient synchronization; its reduce-scatters start in backward
            _local_loss(model, step).backward()
            launched_in_backward.append(opt._next_launch == len(opt._order))
            opt.step()
        with TrafficLog() as ddp_log:
            _all_reduce_mean(ref)
        ref_opt.step()
        logs.append((log, ddp_log))
        equal.append(_same(model, ref))
    # per-rank checkpoint round trip: continue from a restored optimizer
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    opt2 = ZeRO1Optimizer(_groups(model)[0], torch.optim.AdamW, lr=1e-3, bucket_size_mb=0.01)
    opt2.add_param_group(_groups(model)[1])
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    for step in range(steps, steps + 2):
        opt2.zero_grad()
        ref_opt.zero_grad()
        _local_loss(model, step).backward()
        _local_loss(ref, step).backward()
        opt2.step()
        _all_reduce_mean(ref)
        ref_opt.step()
        equal.append(_same(model, ref))
    # gradients still live in the flat buffer after backward (autograd accumulated into the views)
    log, ddp_log = logs[-1]
    n = distributed.world_size()
    group_numels = [sum(p.numel() for p in g["params"]) for g in opt.param_groups]
    return {"equal": equal, "zero1_bytes": log.bytes_per_rank(n), "ddp_bytes": ddp_log.bytes_per_rank(n),
            "launched_in_backward": launched_in_backward, "buckets": len(opt._order),
            "zero1_calls": log.summary(), "group_numels": group_numels, "local_numel": opt.local_numel(),
            "grad_is_view": all(p.grad.untyped_storage().data_ptr() == f.flat_grad.untyped_storage().data_ptr()
                                for f in opt2._flat for p in f.params)}


# ----------------------------------------------------------------------------------------------------------
# tests


def test_balanced_assignment_is_greedy_largest_first():
    loads = [0, 0]
    # 7 -> rank 0, 5 -> rank 1, 3 -> rank 1 (5 < 7), 1 -> rank 0 (7 < 8)
    assert assign_balanced([5, 1, 7, 3], 2, loads) == [1, 0, 0, 1]
    assert loads == [8, 8]
    # a later group continues the balance (ties go to the lower rank)
    assert assign_balanced([4, 2], 2, loads) == [0, 1] and loads == [12, 10]


def test_traffic_closed_form():
    n, p = 4, 1000
    df = optimizer_traffic(p, n).set_index("impl")
    assert df.loc["ddp", "total_bytes"] == 2 * 3 / 4 * 4000
    assert df.loc["zero1", "total_bytes"] == df.loc["ddp", "total_bytes"]  # reduce-scatter + all-gather = all-reduce
    assert df.loc["sharded_optimizer", "ratio_to_ddp"] == pytest.approx(1.5)
    # padding: 1001 elements on 4 ranks are padded to 1004
    assert optimizer_traffic(1001, 4).set_index("impl").loc["zero1", "gradient_bytes"] == 3 / 4 * 1004 * 4
    assert ring_bytes_per_rank("all_gather", 100, 1) == 0
    with pytest.raises(ValueError):
        ring_bytes_per_rank("gossip", 1, 2)


@pytest.mark.slow
def test_sharded_optimizer_matches_adamw_exactly():
    for run in range(2):  # a second launch catches ordering races between the broadcasts
        out = distributed.launch(_sharded_worker, 2, STEPS, device="cpu", timeout_s=120)
        for r in out:
            assert all(r["equal"]), f"run {run}: parameters differ from unsharded AdamW at steps " \
                                    f"{[i for i, e in enumerate(r['equal']) if not e]}"
            assert r["lr_groups"] == [5e-3, 3e-3, 5e-3] and tuple(r["betas"]) == (0.8, 0.95)
            assert r["state_equal"], "state_dict() is not the unsharded AdamW's state_dict"
            assert r["chunks"] > 3  # the chunked update-then-broadcast path was exercised
        total = out[0]["n_params"]
        shares = [r["local_numel"] for r in out]
        assert sum(shares) == total  # every parameter has exactly one owner
        assert abs(shares[0] - shares[1]) <= out[0]["largest"]  # balanced up to one parameter
        for r in out:  # AdamW keeps two moments for exactly the owned elements
            assert r["inner_state_numel"] == 2 * r["local_numel"]
        expected = optimizer_traffic(total, 2).set_index("impl").loc["sharded_optimizer"]
        assert out[0]["broadcast_bytes"] == expected["parameter_bytes"]
        assert out[0]["all_reduce_bytes"] == expected["gradient_bytes"]


@pytest.mark.slow
def test_zero1_matches_ddp_adamw_exactly_with_ddp_traffic():
    out = distributed.launch(_zero1_worker, 2, STEPS, device="cpu", timeout_s=120)
    for r in out:
        bad = [i for i, e in enumerate(r["equal"]) if not e]
        assert not bad, f"ZeRO-1 differs from DDP + AdamW at steps {bad}"
        assert r["grad_is_view"]
        assert all(r["launched_in_backward"]) and r["buckets"] > 3  # overlapped with backward, several buckets
        assert set(r["zero1_calls"]) == {"reduce_scatter", "all_gather"}  # no all-reduce, no broadcast
    r = out[0]
    # bucket sizes are even here (no padding), so the per-group closed form is exact
    expected = optimizer_traffic(r["group_numels"], 2).set_index("impl")
    assert r["zero1_bytes"] == expected.loc["zero1", "total_bytes"]
    assert r["ddp_bytes"] == expected.loc["ddp", "total_bytes"]
    # the counts are even, so there is no padding and ZeRO-1 moves exactly DDP's bytes
    assert all(c % 2 == 0 for c in r["group_numels"]) and r["zero1_bytes"] == r["ddp_bytes"]
    assert sum(x["local_numel"] for x in out) == sum(r["group_numels"])


def test_bad_arguments():
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2))], object)
    with pytest.raises(RuntimeError, match="process group"):
        ShardedOptimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="process group"):
        ZeRO1Optimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.AdamW)
