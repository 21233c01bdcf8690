"""The data :class:`lab.parallel.fsdp.FSDP` is built from: one sharded weight, the layer that is gathered
and reduce-scattered as a unit, the key autograd stores instead of a gathered weight, how a module's
weights are cut into shards and layers, and full tensors gathered back from the shards.

Nothing here knows the FSDP wrapper (its autograd function lives with it, in :mod:`lab.parallel.fsdp`), so
imports run one way: ``fsdp`` -> ``fsdp_grads`` -> ``fsdp_layout``. Ranks and world sizes here are those of
the *shard* group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab.parallel.collectives import all_gather_tensor


class ShardedWeight:
    """One 2-D parameter: its fp32 shard (slice ``rank`` of ``world``: the shard group's), and the gathered full
    weight while it is in use."""

    def __init__(self, module: nn.Module, attr: str, name: str, param: nn.Parameter, rank: int, world: int):
        self.module, self.attr, self.name = module, attr, name
        self.shape = param.shape
        self.numel = param.numel()
        self.padded = math.ceil(self.numel / world) * world
        self.shard_numel = self.padded // world
        flat = torch.zeros(self.padded, dtype=param.dtype, device=param.device)
        flat[:self.numel] = param.detach().reshape(-1)
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(flat[lo:lo + self.shard_numel].clone(), requires_grad=param.requires_grad)
        self.layer: Layer | None = None
        self.index = 0  # position in its layer
        self.gathered: torch.Tensor | None = None  # the padded flat full weight, once the gather finished


class Layer:
    """The unit that is gathered, prefetched and reduce-scattered together: by default one transformer block.

    All its weights travel in one all-gather (of the concatenated shards, each rank's slice of every weight
    side by side) and their gradients in one reduce-scatter, so a block costs two collectives per pass
    instead of two per matrix: each collective has a fixed host and latency cost, which at small sizes
    outweighs the bytes.
    """

    def __init__(self, name: str, weights: list[ShardedWeight]):
        self.name, self.weights = name, weights
        for i, w in enumerate(weights):
            w.layer, w.index = self, i
        self.sizes = [w.shard_numel for w in weights]
        self.shard_numel = sum(self.sizes)
        self.pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (work, output, input) in flight
        # this backward's gradients: index -> padded flat full gradient (reduce dtype), and how many
        # tracked uses (forward applications of GatherWeight) are still owed a gradient
        self.grads: dict[int, torch.Tensor] = {}
        self.expected = 0
        self.received = 0


class Packed:
    """What autograd stores instead of a gathered weight it saved for backward."""

    __slots__ = ("offset", "size", "stride", "weight")

    def __init__(self, weight: ShardedWeight, t: torch.Tensor):
        self.weight, self.size, self.stride, self.offset = weight, t.size(), t.stride(), t.storage_offset()


def unit_names(module: nn.Module, unit_modules) -> list[str]:
    """Names of the modules whose 2-D weights form one layer (see :class:`FSDP`'s ``unit_modules``)."""
    if unit_modules is None:  # every child of a ModuleList: the blocks of a transformer
        return [f"{name}.{child}" if name else child for name, mod in module.named_modules()
                if isinstance(mod, nn.ModuleList) for child, _ in mod.named_children()]
    names = {id(mod): name for name, mod in module.named_modules()}
    missing = [type(m).__name__ for m in unit_modules if id(m) not in names]
    if missing:
        raise ValueError(f"unit_modules must be submodules of the wrapped module; not found: {missing}")
    return [names[id(m)] for m in unit_modules]


def shard_layout(module: nn.Module, unit_names: list[str], rank: int, world: int, weights: dict,
                 replicated: list) -> tuple[list[Layer], list]:
    """Replace every 2-D parameter of ``module`` by its shard (recorded in ``weights``; the others are appended
    to ``replicated``), group the shards into layers (one per unit of ``unit_names``, split by dtype and
    device). Returns ``(layers, [(owner module, its weights)])``."""
    owner: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):  # check before changing anything
        if id(p) in owner:
            raise ValueError(f"parameter {name} is the same tensor as {owner[id(p)]}: tied parameters are "
                             "not supported by lab.FSDP")
        owner[id(p)] = name
    # innermost unit containing a module name, else the module itself
    by_length = sorted(unit_names, key=len, reverse=True)

    def unit_of(mod_name: str) -> str:
        return next((u for u in by_length if mod_name == u or mod_name.startswith(u + ".")), mod_name)

    groups: dict[tuple, list[ShardedWeight]] = {}
    owners = []
    for mod_name, mod in module.named_modules():
        owned = []
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if p.ndim == 2:
                w = ShardedWeight(mod, attr, name, p, rank, world)
                mod._parameters[attr] = w.shard  # module.parameters() now yields the shard
                weights[name] = w
                owned.append(w)
                # one collective carries one dtype: a layer splits by dtype and device if it must
                groups.setdefault((unit_of(mod_name), p.dtype, p.device), []).append(w)
            else:
                replicated.append((name, p))
        if owned:
            owners.append((mod, owned))
    return [Layer(key[0], ws) for key, ws in groups.items()], owners


# ---- inspection: full tensors from the shards ------------------------------------------------------------


def unshard(w: ShardedWeight, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``shard`` (this rank's part of ``w``, or of its gradient) all-gathered over the shard ``group`` to
    ``w``'s full shape."""
    flat = torch.empty(w.padded, dtype=shard.dtype, device=shard.device)
    all_gather_tensor(flat, shard.detach().contiguous(), group=group)
    return flat[:w.numel].view(w.shape).clone()


def _canonical(module: nn.Module, weights: dict[str, ShardedWeight], names: dict[int, str] | None):
    """``module``'s parameters as (name at wrapping time, parameter, its ShardedWeight or None): a wrapper
    added around its blocks later (activation offloading's) changes ``named_parameters()``'s names, not these."""
    for name, p in module.named_parameters():
        name = names.get(id(p), name) if names else name
        yield name, p, weights.get(name)


@torch.no_grad()
def full_params(module: nn.Module, weights: dict[str, ShardedWeight], group: dist.ProcessGroup | None = None,
                names: dict[int, str] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` at full size (sharded ones gathered over the shard ``group``): name ->
    tensor (a collective call). ``names``: parameter id -> its name when ``weights`` were made."""
    return {name: p.detach().clone() if w is None else unshard(w, w.shard, group)
            for name, p, w in _canonical(module, weights, names)}


@torch.no_grad()
def full_grads(module: nn.Module, weights: dict[str, ShardedWeight], group: dist.ProcessGroup | None = None,
               names: dict[int, str] | None = None) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient at full size (sharded ones gathered over the shard ``group``; None where a
    replicated one has none). ``names`` as in :func:`full_params`."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p, w in _canonical(module, weights, names):
        if w is None:
            out[name] = None if p.grad is None else p.grad.detach().clone()
        else:
            out[name] = unshard(w, w.shard.grad if w.shard.grad is not None else torch.zeros_like(w.shard), group)
    return out
