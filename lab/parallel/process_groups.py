"""Which ranks a parallel wrapper talks to: a process group, a ``DeviceMesh``, or the default group.

Why the wrappers take a group: data parallelism averages gradients over the ranks that hold the *same*
model and see different data. With only data parallelism that is every rank (the default group), but on a
2-D mesh it is not: under data x tensor parallelism a rank averages with the ranks holding the same tensor
slice, and under hybrid sharding (HSDP) FSDP shards within one group of ranks and replicates across
another. So every wrapper in ``lab.parallel`` accepts ``process_group`` (a ``torch.distributed``
``ProcessGroup``, or a ``DeviceMesh`` as picotron and torchtitan pass them; ``None``: the default group),
and every collective, rank and world-size lookup inside it uses that group.

The one trap this module exists for: ``torch.distributed.broadcast(src=...)`` (and the ``src``/``dst`` of
every collective) takes a *global* rank, while a wrapper thinks in ranks *within its group*.
:func:`global_rank` converts, and :func:`broadcast_from_first` broadcasts from the group's first member.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# What a wrapper's ``process_group`` argument may be.
GroupLike = Union[dist.ProcessGroup, DeviceMesh, None]


def require_process_group(who: str) -> None:
    """Raise a one-line error naming ``who`` if ``torch.distributed`` has no default process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who} needs a torch.distributed process group; run it under "
                           "lab.parallel.launcher.launch or torchrun (or call torch.distributed.init_process_group)")


def resolve_group(group: GroupLike, who: str) -> dist.ProcessGroup | None:
    """The ``ProcessGroup`` that ``group`` names, for use as the ``group=`` of collectives.

    ``None`` stays ``None`` (the default group); a 1-D ``DeviceMesh`` gives its group; a ``ProcessGroup``
    is returned as is. Raises if there is no default process group, if a mesh is not 1-D (pass the slice,
    e.g. ``mesh["dp"]``), or if this rank is not a member of the group. ``who`` names the caller in errors.
    """
    require_process_group(who)
    if group is None:
        return None
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{who} takes a 1-D DeviceMesh (e.g. mesh['dp']), got a {group.ndim}-D one "
                             f"with dims {group.mesh_dim_names}")
        group = group.get_group()
    # dist.new_group hands non-members a sentinel integer instead of a group
    not_member = (group == dist.GroupMember.NON_GROUP_MEMBER if isinstance(group, int)
                  else isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0)
    if not_member:
        raise ValueError(f"{who}: rank {dist.get_rank()} is not a member of the process group it was given")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}: process_group must be a ProcessGroup, a DeviceMesh or None, got "
                        f"{type(group).__name__}")
    return group


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank within ``group`` and the group's size (``None``: the default group)."""
    return dist.get_rank(group), dist.get_world_size(group)


def members(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order (``None``: every rank)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of the member with rank ``group_rank`` within ``group`` (what ``src=`` takes)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@torch.no_grad()
def broadcast_from_first(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` (in place, same order on every member) with those of ``group``'s first member.

    The first member is group rank 0, i.e. the lowest global rank of the group, not global rank 0.
    """
    src = global_rank(group, 0)
    for t in tensors:
        dist.broadcast(t.detach(), src=src, group=group)


def shard_and_replicate_groups(process_group: GroupLike, replicate_group: GroupLike,
                               who: str) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """Resolve hybrid sharding's two groups: ``(shard group, replicate group or None)``.

    ``process_group`` is the shard group (a group, a 1-D mesh or None) and ``replicate_group`` the group of
    ranks holding the same shard (None: no replication); or ``process_group`` is a 2-D ``DeviceMesh`` whose
    dims are named "replicate" and "shard" (unnamed: dim 0 replicates and dim 1 shards, the layout of
    torch's own HSDP meshes). A replicate group of one rank is returned as None. Raises unless the two
    groups meet in exactly this rank (each rank holds one shard of one replica).
    """
    if isinstance(process_group, DeviceMesh) and process_group.ndim == 2:
        if replicate_group is not None:
            raise ValueError(f"{who}: pass a 2-D mesh or a replicate_group, not both")
        mesh = process_group
        names = mesh.mesh_dim_names
        if names is not None and set(names) == {"replicate", "shard"}:
            rep_dim, shard_dim = "replicate", "shard"
        elif names is None:
            rep_dim, shard_dim = 0, 1
        else:
            raise ValueError(f"{who}: a 2-D mesh must have dims named ('replicate', 'shard') or no names, got "
                             f"{names}")
        require_process_group(who)
        shard, rep = mesh.get_group(shard_dim), mesh.get_group(rep_dim)
    else:
        shard = resolve_group(process_group, who)
        rep = resolve_group(replicate_group, who) if replicate_group is not None else None
    if rep is not None:
        if dist.get_world_size(rep) == 1:
            return shard, None
        common = set(members(shard)) & set(members(rep))
        if common != {dist.get_rank()}:
            raise ValueError(f"{who}: the shard group {members(shard)} and the replicate group {members(rep)} "
                             "must have only this rank in common")
    return shard, rep
