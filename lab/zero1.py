"""ZeRO stage 1: reduce-scatter the gradients, update the local flat shard, all-gather the parameters.

Why it exists beside :class:`lab.sharded_optimizer.ShardedOptimizer`: the simple sharded optimizer keeps
the data-parallel all-reduce and adds a broadcast of the parameters, so it communicates 1.5x what DDP does.
ZeRO-1 notices that an all-reduce *is* a reduce-scatter followed by an all-gather, and puts the optimizer
step in between: after the reduce-scatter each rank holds the averaged gradient of exactly the slice it
updates, and the all-gather that would have finished the all-reduce distributes the updated parameters
instead. Same memory saving for the optimizer state, the same traffic as DDP.

To make both collectives zero-copy, the parameters of each group become views into one flat buffer
(padded to a multiple of the world size) and their gradients views into a second one; rank ``r`` owns
slice ``r`` of each buffer. The caller must **not** all-reduce the gradients (no DDP wrapper): this
optimizer's :meth:`ZeRO1Optimizer.step` is the data-parallel gradient synchronization.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from lab.collectives import all_gather_tensor, reduce_scatter_tensor
from lab.sharded_optimizer import _check_optimizer_cls, _hyperparameters, _require_process_group, record_collective


class _FlatGroup:
    """One parameter group's parameters and gradients as views into two padded flat buffers."""

    def __init__(self, params: list[torch.Tensor], rank: int, world: int):
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO-1 flattens each parameter group into one buffer, so a group's parameters must "
                             f"share dtype and device; got {sorted(map(str, dtypes))}. Put them in separate groups.")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(self.numel / world) * world
        self.shard_numel = self.padded // world
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        dtype, device = (params[0].dtype, params[0].device) if params else (torch.float32, torch.device("cpu"))
        if params and not dtype.is_floating_point:
            raise ValueError(f"ZeRO-1 optimizes floating-point parameters, got {dtype}")
        self.flat_param = torch.zeros(self.padded, dtype=dtype, device=device)
        self.flat_grad = torch.zeros(self.padded, dtype=dtype, device=device)
        self.offsets = []
        offset = 0
        with torch.no_grad():
            for p in params:
                view = self.flat_param[offset:offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                self.offsets.append(offset)
                offset += p.numel()
            # Every rank starts from rank 0's parameters (as DDP does at construction).
            if self.padded:
                record_collective("broadcast", self.flat_param)
                dist.broadcast(self.flat_param, src=0)
            for p, off in zip(params, self.offsets):
                p.data = self.flat_param[off:off + p.numel()].view_as(p)
                if p.grad is not None:
                    self.flat_grad[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = self.grad_view(p, off)
        # The inner optimizer's parameter: this rank's slice of the flat buffer (shares its storage, so the
        # update lands in the model's parameters directly and the all-gather can run in place).
        self.shard = nn.Parameter(self.flat_param[self.lo:self.hi], requires_grad=True)

    def grad_view(self, p: torch.Tensor, offset: int) -> torch.Tensor:
        return self.flat_grad[offset:offset + p.numel()].view_as(p)

    def adopt_gradients(self) -> None:
        """Make every ``p.grad`` a view of the flat buffer again (it may have been set to None or replaced)."""
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                view = self.grad_view(p, off)
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr() or p.grad.stride() != view.stride():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view


class ZeRO1Optimizer(torch.optim.Optimizer):
    """ZeRO-1: optimizer state sharded over ranks with DDP's communication volume (see the module docstring).

    ``ZeRO1Optimizer(params, torch.optim.AdamW, lr=1e-3)``; parameter groups and :meth:`add_param_group` as
    for any optimizer (each group must share one dtype and device). Construction moves each group's
    parameters into a flat buffer (their ``.data`` become views of it) and broadcasts rank 0's values.

    Use it *instead of* a DDP wrapper: run forward and backward on the local batch, then call
    :meth:`step` on every rank; it reduce-scatters (sums) the local gradients, divides by the world size,
    updates this rank's slice with the inner optimizer and all-gathers the parameters. After ``step``
    only this rank's slice of the gradients holds averaged values (the rest keeps local gradients, overwritten
    by the next backward after :meth:`zero_grad`). Parameters without a gradient count as zero gradient,
    because the slice is updated as one tensor. :meth:`zero_grad` always zeroes the flat gradient buffer in
    place (``set_to_none`` is ignored: freeing it would make autograd allocate a second set of gradients).

    Checkpoints are per rank: :meth:`state_dict` returns this rank's slice of the state plus the layout
    (``world_size``, ``rank``, element count of each group); :meth:`load_state_dict` needs the same layout.
    """

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        _check_optimizer_cls(optimizer_cls)
        self._rank, self._world = _require_process_group()
        self._optimizer_cls = optimizer_cls
        self._inner_kwargs = kwargs
        self._flat: list[_FlatGroup] = []
        self.inner: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=dict(kwargs))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group: its parameters get their own flat buffers and the inner optimizer one more shard."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        flat = _FlatGroup(group["params"], self._rank, self._world)
        self._flat.append(flat)
        local = {**_hyperparameters(group), "params": [flat.shard]}
        if self.inner is None:
            self.inner = self._optimizer_cls([local], **self._inner_kwargs)
        else:
            self.inner.add_param_group(local)
        for k, v in _hyperparameters(self.inner.param_groups[-1]).items():
            group.setdefault(k, v)

    def local_numel(self) -> int:
        """Number of parameter elements whose optimizer state this rank holds (its slices, padding included)."""
        return sum(f.shard_numel for f in self._flat)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - see the class docstring
        """Zero the flat gradient buffers in place (every ``p.grad`` stays a view of them)."""
        for flat in self._flat:
            flat.flat_grad.zero_()
            flat.adopt_gradients()

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Reduce-scatter gradients, update the local slice, all-gather parameters; a collective call."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = [f for f in self._flat if f.padded]
        handles = []
        for flat in active:
            flat.adopt_gradients()
            record_collective("reduce_scatter", flat.flat_grad)
            # In place: this rank's slice of the buffer receives the sum of everyone's slice.
            handles.append(reduce_scatter_tensor(flat.flat_grad[flat.lo:flat.hi], flat.flat_grad, async_op=True))
        for flat, h in zip(active, handles):
            h.wait()
            grad = flat.flat_grad[flat.lo:flat.hi]
            grad.div_(self._world)
            flat.shard.grad = grad
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_hyperparameters(outer))
        self.inner.step(**kwargs)
        handles = []
        for flat in active:
            record_collective("all_gather", flat.flat_param)
            handles.append(all_gather_tensor(flat.flat_param, flat.flat_param[flat.lo:flat.hi], async_op=True))
        for h in handles:
            h.wait()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This rank's slice of the optimizer state and the layout it belongs to (save one file per rank)."""
        inner = self.inner.state_dict()
        index = 0
        groups = []
        for g in self.param_groups:
            groups.append({**_hyperparameters(g), "params": list(range(index, index + len(g["params"])))})
            index += len(g["params"])
        return {"format": "zero1-shard", "world_size": self._world, "rank": self._rank,
                "group_numels": [f.numel for f in self._flat], "state": inner["state"], "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's slice saved by :meth:`state_dict` (same world size, rank and groups)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != "zero1-shard":
            raise ValueError("expected a ZeRO1Optimizer.state_dict() (format 'zero1-shard')")
        layout = (state_dict["world_size"], state_dict["rank"], list(state_dict["group_numels"]))
        mine = (self._world, self._rank, [f.numel for f in self._flat])
        if layout != mine:
            raise ValueError(f"state_dict was saved with (world_size, rank, group sizes) = {layout}, this optimizer "
                             f"has {mine}")
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update(_hyperparameters(saved))
        inner_groups = [{**_hyperparameters(saved), "params": [i]}
                        for i, saved in enumerate(state_dict["param_groups"])]
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": inner_groups})
