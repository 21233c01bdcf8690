"""The parallel wrappers on process groups other than the default one (gloo, 4 processes, fp32, exact).

Two layouts of four ranks: strided groups {0, 2} and {1, 3} (made with ``new_group``: the first member of the
second group is global rank 1, and a member's group rank differs from its global rank), and the rows
{0, 1}, {2, 3} of a 2 x 2 ``DeviceMesh``. Each group trains its own replica on its own data, so a wrapper
that talked to the default group, or broadcast from global rank 0, or cut its shards by global rank, would
mix the groups and fail the equality.

Why equality is exact (as in test_ddp and test_fsdp): a group of two sums two gradients (one IEEE
addition, order-free) and divides by two (exact); the single-process reference computes the two gradients
in the same process with the same code and does the same. Under HSDP (shard groups of two, replicated
twice), the sum is (sum over one shard group) + (sum over the other), divided by 4, and the reference adds
the four gradients in exactly those pairs. Every rank starts from different weights (seeded by rank): only
the wrappers' broadcast from the group's first rank makes the replicas equal to the reference.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lab.model.transformer import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel.ddp import DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP
from lab.parallel.fsdp import FSDP
from lab.parallel.process_groups import global_rank, members
from lab.parallel.sharded_optimizer import ShardedOptimizer
from lab.parallel.zero1 import ZeRO1Optimizer
from tests.parallel.test_ddp import ToyModel as _Toy

WORLD = 4
STEPS = 3
CFG = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=64)


def _toy(seed: int) -> _Toy:
    torch.manual_seed(seed)
    return _Toy()


def _lm(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(CFG)


def _toy_batch(group_id: int, step: int, k: int):
    """Member ``k``'s batch of group ``group_id`` at ``step`` (each group has its own data)."""
    g = torch.Generator().manual_seed(10_000 * group_id + 100 * step + k)
    return torch.randn(3, 10, generator=g), torch.randint(0, 5, (3,), generator=g)


def _lm_batch(key: int, step: int, k: int):
    g = torch.Generator().manual_seed(10_000 * key + 100 * step + k)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def _per_member_grads(ref, batches) -> list[list[torch.Tensor]]:
    """Gradient of each member's mean loss, computed one member after another in this process."""
    grads = []
    for x, y in batches:
        ref.zero_grad()
        _loss(ref, x, y).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    return grads


def _set_average(ref, grads, pairs) -> None:
    """``ref``'s gradients := (sum of each pair, pairs summed) / number of members: the wrappers' order."""
    n = sum(len(p) for p in pairs)
    for i, p in enumerate(ref.parameters()):
        sums = [grads[a][i] + grads[b][i] for a, b in pairs]
        total = sums[0] if len(sums) == 1 else sums[0] + sums[1]
        p.grad = total / n


def _strided_group() -> dist.ProcessGroup:
    """{0, 2} or {1, 3}: this rank's one. Every rank creates both, in the same order (new_group requires it)."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return groups[dist.get_rank() % 2]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------------------
# workers


DDP_WRAPPERS = {
    "naive": NaiveDDP, "flat": FlatDDP, "individual": DDPIndividualParameters,
    "bucketed": lambda m, process_group: DDPBucketed(m, bucket_size_mb=0.002, process_group=process_group),
}


def _ddp_worker() -> dict:
    torch.use_deterministic_algorithms(True)
    r = dist.get_rank()
    strided = _strided_group()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # dp slices: rows {0, 1}, {2, 3}
    layouts = {"strided": strided, "mesh": mesh["dp"]}
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layout, group_like in layouts.items():
            group = group_like if isinstance(group_like, dist.ProcessGroup) else group_like.get_group()
            first, k = global_rank(group, 0), dist.get_rank(group)
            for name, wrap in DDP_WRAPPERS.items():
                reference = _toy(seed=first)  # the group's first rank's initial weights
                model = wrap(_toy(seed=r), process_group=group_like)
                started = _same(model.module.parameters(), reference.parameters()) and \
                    _same(model.module.buffers(), reference.buffers())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
                ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
                equal = []
                for step in range(STEPS):
                    batches = [_toy_batch(first, step, j) for j in range(2)]
                    opt.zero_grad()
                    _loss(model, *batches[k]).backward()
                    model.finish_gradient_synchronization()
                    opt.step()
                    _set_average(reference, _per_member_grads(reference, batches), [(0, 1)])
                    ref_opt.step()
                    equal.append(_same(model.module.parameters(), reference.parameters()))
                out[(layout, name)] = {"started_as_first": started, "equal": equal, "first": first}
    out["warnings"] = [str(w.message) for w in caught]
    out["errors"] = _bad_groups(mesh)
    return out


def _bad_groups(mesh) -> dict:
    """Errors raised (on every rank alike, before any collective) for groups a wrapper cannot use."""
    errors = {}
    other = [dist.new_group([0, 1]), dist.new_group([2, 3])][1 - dist.get_rank() // 2]  # not this rank's
    cases = {"mesh_2d": lambda: NaiveDDP(_toy(0), process_group=mesh),
             "not_member": lambda: NaiveDDP(_toy(0), process_group=other),
             "not_a_group": lambda: NaiveDDP(_toy(0), process_group="dp"),
             "fsdp_groups_overlap": lambda: FSDP(_toy(0), process_group=mesh["dp"], replicate_group=mesh["dp"])}
    for name, build in cases.items():
        try:
            build()
            errors[name] = None
        except (ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _optimizer_worker() -> dict:
    torch.use_deterministic_algorithms(True)
    r = dist.get_rank()
    group = _strided_group()
    first, k = global_rank(group, 0), dist.get_rank(group)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("sharded", "zero1"):
            reference = _lm(seed=first)
            if name == "sharded":  # gradients averaged by DDP over the group; the optimizer broadcasts from owners
                model = NaiveDDP(_lm(seed=r), process_group=group)
                opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, chunk_size_mb=0.008,
                                       process_group=group)
                params = model.module.parameters
            else:  # ZeRO-1 is the gradient synchronization; it broadcasts the first rank's weights itself
                model = _lm(seed=r)
                opt = ZeRO1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_size_mb=0.01,
                                     process_group=group)
                params = model.parameters
            started = _same(params(), reference.parameters())
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
            equal = []
            for step in range(STEPS):
                batches = [_lm_batch(first, step, j) for j in range(2)]
                opt.zero_grad()
                _loss(model, *batches[k]).backward()
                if name == "sharded":
                    model.finish_gradient_synchronization()
                opt.step()
                _set_average(reference, _per_member_grads(reference, batches), [(0, 1)])
                ref_opt.step()
                equal.append(_same(params(), reference.parameters()))
            owners = sorted({opt.owner(p) for p in params()}) if name == "sharded" else None
            out[name] = {"started_as_first": started, "equal": equal, "owners": owners,
                         "local_numel": opt.local_numel(), "total": sum(p.numel() for p in reference.parameters())}
        sd = opt.state_dict()
        out["zero1_layout"] = (sd["world_size"], sd["rank"])
    out["warnings"] = [str(w.message) for w in caught]
    out["group_rank"], out["first"] = k, first
    return out


def _fsdp_worker() -> dict:
    """FSDP within a strided group (each group its own model and data), then HSDP over all four ranks twice:
    a 2 x 2 mesh ("replicate", "shard") and explicit strided shard groups with row replicate groups."""
    torch.use_deterministic_algorithms(True)
    r = dist.get_rank()
    strided = _strided_group()
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])][r // 2]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # shard groups: rows
    cases = {"subgroup": dict(process_group=strided), "hsdp_mesh": dict(process_group=mesh),
             "hsdp_groups": dict(process_group=strided, replicate_group=rows)}
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case, kwargs in cases.items():
            shard = kwargs["process_group"]
            shard = shard.get_group("shard") if case == "hsdp_mesh" else shard
            # the members whose batches are averaged, as pairs of shard-group members (global ranks)
            if case == "subgroup":
                pairs_global = [members(strided)]
            else:
                pairs_global = [[0, 1], [2, 3]] if case == "hsdp_mesh" else [[0, 2], [1, 3]]
            everyone = [g for pair in pairs_global for g in pair]
            first = everyone[0] if case == "subgroup" else 0  # HSDP: the grid's first rank
            key = first if case == "subgroup" else 7  # each subgroup its own data; HSDP one global batch
            reference = _lm(seed=first)
            initial_head = reference.lm_head.weight.detach().clone()
            model = FSDP(_lm(seed=r), **kwargs)
            started = all(torch.equal(v, dict(reference.named_parameters())[n])
                          for n, v in model.gather_full_params().items())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
            rows_out = []
            for step in range(STEPS):
                batches = {g: _lm_batch(key, step, g) for g in everyone}
                opt.zero_grad()
                _loss(model, *batches[r]).backward()
                grads = model.gather_full_grads()
                opt.step()
                per_member = _per_member_grads(reference, [batches[g] for g in everyone])
                pairs = [(everyone.index(a), everyone.index(b)) for a, b in pairs_global]
                _set_average(reference, per_member, pairs)
                ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
                ref_opt.step()
                full = model.gather_full_params()
                ref_params = dict(reference.named_parameters())
                rows_out.append({"grads": all(torch.equal(grads[n], ref_grads[n]) for n in grads),
                                 "params": all(torch.equal(full[n], ref_params[n]) for n in full),
                                 "moved": not torch.equal(full["lm_head.weight"], initial_head)})
            out[case] = {"started_as_first": started, "steps": rows_out, "shard_size": dist.get_world_size(shard),
                         "local_numel": sum(p.numel() for p in model.parameters()),
                         "replicated": len(model.replicated_parameter_names())}
    out["warnings"] = [str(w.message) for w in caught]
    return out


# ----------------------------------------------------------------------------------------------------------
# tests


def test_ddp_wrappers_on_subgroups_match_each_groups_reference():
    out = distributed.launch(_ddp_worker, WORLD, device="cpu", timeout_s=120)
    for r, res in enumerate(out):
        assert res["warnings"] == []
        for (layout, name), case in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
            # broadcast from the group's first member: global rank 1 for {1, 3}, 2 for the mesh row {2, 3}
            assert case["first"] == (r % 2 if layout == "strided" else 2 * (r // 2))
            assert case["started_as_first"], (r, layout, name)
            assert all(case["equal"]), (r, layout, name, case["equal"])
        errors = res["errors"]
        assert errors["mesh_2d"].startswith("ValueError") and "1-D" in errors["mesh_2d"]
        assert errors["not_member"].startswith("ValueError") and "not a member" in errors["not_member"]
        assert errors["not_a_group"].startswith("TypeError")
        assert errors["fsdp_groups_overlap"].startswith("ValueError") and "common" in errors["fsdp_groups_overlap"]
    assert len([k for k in out[0] if isinstance(k, tuple)]) == 2 * len(DDP_WRAPPERS)


def test_sharded_optimizer_and_zero1_on_subgroups_match_each_groups_reference():
    out = distributed.launch(_optimizer_worker, WORLD, device="cpu", timeout_s=120)
    for r, res in enumerate(out):
        assert res["warnings"] == []
        assert res["first"] == r % 2 and res["group_rank"] == r // 2
        for name in ("sharded", "zero1"):
            assert res[name]["started_as_first"], (r, name)
            assert all(res[name]["equal"]), (r, name, res[name]["equal"])
        # owners are ranks within the group (0 and 1), not global ranks
        assert res["sharded"]["owners"] == [0, 1]
        assert res["zero1_layout"] == (2, r // 2)
    for group in ((0, 2), (1, 3)):  # each group's shares cover its model once (ZeRO-1: up to one pad a bucket)
        total = out[group[0]]["sharded"]["total"]
        assert sum(out[r]["sharded"]["local_numel"] for r in group) == total
        assert total <= sum(out[r]["zero1"]["local_numel"] for r in group) <= total + 16


def test_fsdp_on_a_subgroup_and_hsdp_match_single_process_training():
    out = distributed.launch(_fsdp_worker, WORLD, device="cpu", timeout_s=180)
    for r, res in enumerate(out):
        assert res["warnings"] == []
        for case in ("subgroup", "hsdp_mesh", "hsdp_groups"):
            c = res[case]
            assert c["shard_size"] == 2
            assert c["started_as_first"], (r, case)
            for step, row in enumerate(c["steps"]):
                assert row["grads"], (r, case, step)
                assert row["params"], (r, case, step)
                assert row["moved"]
            # shards over two ranks: half of every matrix (all even-sized here) plus every norm
            vectors = (2 * CFG.num_layers + 1) * CFG.d_model
            full = sum(p.numel() for p in TransformerLM(CFG).parameters())
            assert c["local_numel"] == (full - vectors) // 2 + vectors
            assert c["replicated"] == 2 * CFG.num_layers + 1
