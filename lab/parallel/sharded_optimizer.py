"""Optimizer state sharding: each rank keeps AdamW's state for only its share of the parameters.

Why it exists: in data-parallel training every rank holds a full copy of the optimizer state (8 bytes per
parameter for AdamW's two moments), although each rank computes the same update. Sharding that state
divides its memory by the number of ranks at the price of one extra collective per step.

Two schedules live in the lab book:

* :class:`ShardedOptimizer` (this file): gradients are still averaged by the data-parallel all-reduce
  (e.g. ``DistributedDataParallel``); each *parameter* is owned by one rank (balanced by size), the owner
  updates it, and the owners then **broadcast** the updated parameters. Traffic: all-reduce + broadcast,
  i.e. 1.5x plain DDP's.
* :class:`lab.parallel.zero1.ZeRO1Optimizer`: the ZeRO stage-1 schedule, which *replaces* the all-reduce by a
  **reduce-scatter** of the flattened gradients, updates the local flat shard and **all-gathers** the
  parameters. Traffic: exactly plain DDP's (an all-reduce *is* a reduce-scatter plus an all-gather).

:func:`optimizer_traffic` gives the bytes per rank per step of each schedule in closed form, and
:class:`TrafficLog` records what the implementations actually send, so tests can check one against the other.

Both take ``process_group`` (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None for the default group): the
data-parallel ranks that share the state. On a 2-D mesh that is the data-parallel slice; owners, chunks,
world sizes and every collective are the group's. :func:`check_optimizer_cls` and :func:`hyperparameters`
are the helpers both optimizers use to build their inner optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from lab.accounting.collectives import ring_bytes_per_rank
from lab.parallel.collectives import TrafficLog, record_collective  # noqa: F401 - re-exported
from lab.parallel.process_groups import GroupLike, global_rank, rank_and_size, resolve_group


def optimizer_traffic(num_elements: int | Sequence[int], world_size: int, element_bytes: int = 4) -> pd.DataFrame:
    """Bytes each rank sends per optimizer step for DDP, :class:`ShardedOptimizer` and ZeRO-1 (closed form).

    ``num_elements``: number of parameters (or one count per parameter group: ZeRO-1 pads each group's
    flat buffer to a multiple of ``world_size``). ``element_bytes``: bytes of a gradient/parameter element.
    Returns one row per schedule with columns impl, gradient_collective, gradient_bytes,
    parameter_collective, parameter_bytes, total_bytes (per rank per step, ring algorithms) and
    ratio_to_ddp. DDP: all-reduce of the gradients; sharded optimizer: the same all-reduce plus a broadcast
    of every parameter from its owner; ZeRO-1: reduce-scatter of the gradients plus all-gather of the
    parameters, which together move exactly what one all-reduce moves.
    """
    counts = [int(num_elements)] if isinstance(num_elements, (int, float)) else [int(c) for c in num_elements]
    if any(c < 0 for c in counts) or world_size < 1 or element_bytes < 1:
        raise ValueError("num_elements, world_size and element_bytes must be positive")
    n = world_size
    full = sum(counts) * element_bytes
    padded = sum(math.ceil(c / n) * n for c in counts) * element_bytes
    rows = [
        ("ddp", "all_reduce", ring_bytes_per_rank("all_reduce", full, n), "none", 0.0),
        ("sharded_optimizer", "all_reduce", ring_bytes_per_rank("all_reduce", full, n), "broadcast",
         ring_bytes_per_rank("broadcast", full, n)),
        ("zero1", "reduce_scatter", ring_bytes_per_rank("reduce_scatter", padded, n), "all_gather",
         ring_bytes_per_rank("all_gather", padded, n)),
    ]
    df = pd.DataFrame(rows, columns=["impl", "gradient_collective", "gradient_bytes", "parameter_collective",
                                     "parameter_bytes"])
    df["total_bytes"] = df["gradient_bytes"] + df["parameter_bytes"]
    ddp = df.loc[df["impl"] == "ddp", "total_bytes"].iloc[0]
    df["ratio_to_ddp"] = df["total_bytes"] / ddp if ddp else math.nan
    return df


def check_optimizer_cls(optimizer_cls: Any) -> None:
    """Raise a one-line ``TypeError`` unless ``optimizer_cls`` is a ``torch.optim.Optimizer`` subclass (the
    class a sharded optimizer instantiates over its share of the parameters)."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                        f"got {optimizer_cls!r}")


def hyperparameters(group: dict) -> dict:
    """A parameter group's hyperparameters: the group without its ``params`` (and ``param_names``), i.e. what
    an outer sharded optimizer copies into its inner optimizer's matching group at every step."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def assign_balanced(sizes: Sequence[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank of each item: greedy largest-first onto the least-loaded rank (ties: lowest rank).

    ``loads`` (per-rank element counts so far) is updated in place, so groups added later keep the
    balance. Deterministic, so every rank computes the same assignment without communicating.
    """
    loads = loads if loads is not None else [0] * world_size
    owners = [0] * len(sizes)
    # sorted() is stable: equal sizes keep their order, so the assignment is the same on every rank
    for i in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        owners[i] = r
        loads[r] += sizes[i]
    return owners


# --------------------------------------------------------------------------------------------------------
# the sharded optimizer


class ShardedOptimizer(torch.optim.Optimizer):
    """Wrap any ``torch.optim`` optimizer so that each rank keeps state for only its share of the parameters.

    ``ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)``: ``params`` and the keyword
    arguments are what ``optimizer_cls`` takes (parameter groups with their own hyperparameters included).
    Every parameter is owned by one rank; owners are chosen greedily, largest parameter first, onto the
    rank with the fewest elements so far, so each rank's share is about ``1/world_size`` of the elements.
    Each rank builds an inner ``optimizer_cls`` over the parameters it owns, so its state (AdamW: two fp32
    moments) exists only there.

    :meth:`step` expects gradients that are *already averaged* over ranks (wrap the model in DDP as
    usual), updates the local share and broadcasts each parameter from its owner, so every rank ends the
    step with identical parameters. Every rank must call it (it communicates). Hyperparameters changed
    in ``param_groups`` (e.g. by an LR scheduler) are passed to the inner optimizer at every step.

    The step walks the parameters in chunks of about ``chunk_size_mb`` (keyword, default 200): it updates
    the chunk's owned parameters (the inner optimizer sees only their gradients), then launches the
    chunk's broadcasts, which run while the next chunk is updated; and a foreach optimizer's temporaries
    are one chunk large instead of the whole share. This assumes, as sharding itself does, that the inner
    optimizer updates each parameter independently (true for torch.optim's SGD, Adam, AdamW, ...).

    ``process_group`` (keyword): the ranks sharing the state (see the module docstring); owners are ranks
    within it, and each broadcast's source is converted to the owner's global rank.

    Checkpoints: :meth:`state_dict` gathers every rank's state and returns the *unsharded* optimizer's
    ``state_dict`` (the format ``optimizer_cls`` itself uses: state by global parameter index in
    ``param_groups`` order), identical on all ranks, with state tensors on the CPU. Save it from one rank.
    :meth:`load_state_dict` takes that format (from this class or from a plain ``optimizer_cls``) and keeps
    each rank's share, so a checkpoint can be restored on another world size. ``state_dict`` is a
    collective call (every rank must call it); ``load_state_dict`` does not communicate.
    """

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], *, chunk_size_mb: float = 200,
                 process_group: GroupLike = None, **kwargs):
        check_optimizer_cls(optimizer_cls)
        if chunk_size_mb <= 0:
            raise ValueError(f"chunk_size_mb must be positive, got {chunk_size_mb}")
        self._group = resolve_group(process_group, type(self).__name__)
        self._rank, self._world = rank_and_size(self._group)
        self._optimizer_cls = optimizer_cls
        self._inner_kwargs = kwargs
        self._chunk_bytes = int(chunk_size_mb * 2**20)
        self._loads = [0] * self._world  # elements owned by each rank so far
        self._owner: dict[torch.Tensor, int] = {}  # parameter -> owning rank in the group (tensors hash by identity)
        self.inner: torch.optim.Optimizer | None = None
        # The base constructor validates ``params`` and calls self.add_param_group for every group.
        super().__init__(params, defaults=dict(kwargs))

    # ---- parameter groups ----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (usable at any time, like ``torch.optim.Optimizer.add_param_group``).

        Its parameters are assigned to ranks continuing the size balance of the groups before it; this
        rank's inner optimizer gets a group (possibly empty) with the same hyperparameters, so group
        ``i`` here is group ``i`` of the inner optimizer.
        """
        super().add_param_group(param_group)  # validation, defaults, duplicate checks
        group = self.param_groups[-1]
        params = group["params"]
        owners = assign_balanced([p.numel() for p in params], self._world, self._loads)
        mine = [i for i, r in enumerate(owners) if r == self._rank]
        for p, r in zip(params, owners):
            self._owner[p] = r
        local = {**hyperparameters(group), "params": [params[i] for i in mine]}
        if "param_names" in group:
            local["param_names"] = [group["param_names"][i] for i in mine]
        if self.inner is None:
            self.inner = self._optimizer_cls([local], **self._inner_kwargs)
        else:
            self.inner.add_param_group(local)
        # The inner optimizer filled in its own defaults (betas, eps, ...): show them in the outer group too.
        for k, v in hyperparameters(self.inner.param_groups[-1]).items():
            group.setdefault(k, v)

    def owner(self, param: torch.Tensor) -> int:
        """The rank (within the process group) that updates ``param`` and broadcasts it."""
        return self._owner[param]

    def local_numel(self) -> int:
        """Number of parameter elements this rank owns (its share of the optimizer state)."""
        return sum(p.numel() for g in self.inner.param_groups for p in g["params"])

    # ---- the step --------------------------------------------------------------------------------------

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in hyperparameters(outer).items():
                inner[k] = v

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Update this rank's share of the parameters, then broadcast every parameter from its owner.

        ``closure`` (re-evaluates the loss, as for any optimizer) runs once on every rank; ``kwargs`` go to
        the inner optimizer's ``step``. Returns the closure's loss (or None).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        mine = [p for g in self.inner.param_groups for p in g["params"]]
        grads = {p: p.grad for p in mine}
        handles = []
        try:
            for p in mine:  # hidden, then shown chunk by chunk: an optimizer skips parameters without gradient
                p.grad = None
            for chunk in self._chunks():
                owned = [p for p in chunk if self._owner[p] == self._rank and grads[p] is not None]
                if owned:
                    for p in owned:
                        p.grad = grads[p]
                    self.inner.step(**kwargs)
                    for p in owned:
                        p.grad = None
                # Same order on every rank; each runs while the next chunk is being updated.
                for p in chunk:
                    record_collective("broadcast", p)
                    src = global_rank(self._group, self._owner[p])  # broadcast's src is a global rank
                    handles.append(dist.broadcast(p.detach(), src=src, group=self._group, async_op=True))
        finally:
            for p, g in grads.items():
                p.grad = g
        for h in handles:
            h.wait()
        return loss

    def _chunks(self) -> list[list[torch.Tensor]]:
        """Consecutive parameters (all groups, in order) of about ``chunk_size_mb`` each."""
        chunks, current, size = [], [], 0
        for g in self.param_groups:
            for p in g["params"]:
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= self._chunk_bytes:
                    chunks.append(current)
                    current, size = [], 0
        if current:
            chunks.append(current)
        return chunks

    # ---- checkpoints -----------------------------------------------------------------------------------

    def _global_index(self) -> dict[torch.Tensor, int]:
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's ``state_dict`` (see the class docstring); a collective call."""
        index = self._global_index()
        local = {index[p]: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                 for p, s in self.inner.state.items()}
        parts: list[Any] = [None] * self._world
        dist.all_gather_object(parts, local, group=self._group)
        state: dict[int, Any] = {}
        for part in parts:
            state.update(part)
        groups = [{**hyperparameters(g), "params": [index[p] for p in g["params"]],
                   **({"param_names": list(g["param_names"])} if "param_names" in g else {})}
                  for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s format (or a plain ``optimizer_cls`` state_dict).

        Keeps this rank's share of the state; no communication (every rank reads the same dict).
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must have 'state' and 'param_groups' (the unsharded optimizer format)")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"parameter group {i} has {len(saved['params'])} parameters in the state_dict "
                                 f"but {len(group['params'])} here")
        # saved index of each of our parameters (same order, as torch.optim does it)
        saved_id = {p: sid for saved, group in zip(saved_groups, self.param_groups)
                    for p, sid in zip(group["params"], saved["params"])}
        for saved, group in zip(saved_groups, self.param_groups):
            group.update(hyperparameters(saved))
        inner_groups, inner_state, local_index = [], {}, 0
        for saved, inner_group in zip(saved_groups, self.inner.param_groups):
            ids = []
            for p in inner_group["params"]:
                if saved_id[p] in state_dict["state"]:
                    inner_state[local_index] = state_dict["state"][saved_id[p]]
                ids.append(local_index)
                local_index += 1
            g = {**hyperparameters(saved), "params": ids}
            if "param_names" in inner_group:
                g["param_names"] = list(inner_group["param_names"])
            inner_groups.append(g)
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
