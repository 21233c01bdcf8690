"""ZeRO stage 1: reduce-scatter the gradients, update the local flat shard, all-gather the parameters.

Why it exists beside :class:`lab.parallel.sharded_optimizer.ShardedOptimizer`: the simple sharded optimizer keeps
the data-parallel all-reduce and adds a broadcast of the parameters, so it communicates 1.5x what DDP does.
ZeRO-1 notices that an all-reduce *is* a reduce-scatter followed by an all-gather, and puts the optimizer
step in between: after the reduce-scatter each rank holds the averaged gradient of exactly the slice it
updates, and the all-gather that would have finished the all-reduce distributes the updated parameters
instead. Same memory saving for the optimizer state, the same traffic as DDP.

Layout: the parameters of each group become views into one flat buffer, their gradients views into a
second one. Both are cut into *buckets* (consecutive parameters, about ``bucket_size_mb`` each, padded to
a multiple of the world size); rank ``r`` owns chunk ``r`` of every bucket, and the inner optimizer holds
those chunks (views of the flat parameter buffer). As soon as backward has produced every gradient of a
bucket (post-accumulate-grad hooks), its reduce-scatter is launched *in place*, overlapping the rest of the
backward pass as DDP's bucketed all-reduce does; buckets are numbered from the last parameters, which get
their gradients first. The caller must **not** all-reduce the gradients (no DDP wrapper): this optimizer
is the data-parallel gradient synchronization.

``process_group`` (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None for the default group) is the set of
data-parallel ranks this synchronization runs over; on a 2-D mesh, the data-parallel slice. Ranks, chunk
counts, the initial broadcast and every collective are the group's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab.parallel.collectives import all_gather_tensor, record_collective, reduce_scatter_tensor
from lab.parallel.hooks import weak_hook
from lab.parallel.process_groups import GroupLike, broadcast_from_first, rank_and_size, resolve_group
from lab.parallel.sharded_optimizer import check_optimizer_cls, hyperparameters


class _Bucket:
    """Consecutive parameters of a group: ``[start, start + padded)`` of the flat buffers."""

    def __init__(self, start: int, params: list[torch.Tensor], offsets: list[int], numel: int, world: int,
                 rank: int):
        self.start, self.params, self.offsets, self.numel = start, params, offsets, numel
        self.padded = math.ceil(numel / world) * world
        self.chunk = self.padded // world
        self.lo = start + rank * self.chunk  # this rank's chunk, in flat-buffer coordinates
        self.hi = self.lo + self.chunk
        self.ready = 0  # gradients accumulated in the current backward
        self.handle = None  # the in-flight reduce-scatter
        self.shard: nn.Parameter | None = None


class _FlatGroup:
    """One parameter group's parameters and gradients as views into two bucketed flat buffers."""

    def __init__(self, params: list[torch.Tensor], rank: int, world: int, bucket_bytes: int,
                 group: dist.ProcessGroup | None):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"ZeRO-1 flattens each parameter group into one buffer, so a group's parameters must "
                             f"share dtype and device; got {sorted(map(str, kinds))}. Put them in separate groups.")
        dtype, device = (params[0].dtype, params[0].device) if params else (torch.float32, torch.device("cpu"))
        if params and not dtype.is_floating_point:
            raise ValueError(f"ZeRO-1 optimizes floating-point parameters, got {dtype}")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        # Buckets from the last parameter backwards: backward produces those gradients first.
        self.buckets: list[_Bucket] = []
        element = torch.empty((), dtype=dtype).element_size()
        groups: list[list[torch.Tensor]] = []
        current: list[torch.Tensor] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * element
            if size >= bucket_bytes:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        start = 0
        self.offset: dict[torch.Tensor, int] = {}
        for members in groups:
            offsets, numel = [], 0
            for p in members:
                offsets.append(start + numel)
                numel += p.numel()
            bucket = _Bucket(start, members, offsets, numel, world, rank)
            self.buckets.append(bucket)
            for p, off in zip(members, offsets):
                self.offset[p] = off
            start += bucket.padded
        self.padded = start
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.flat_param = torch.zeros(self.padded, dtype=dtype, device=device)
        self.flat_grad = torch.zeros(self.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p in params:
                self.param_view(p).copy_(p.detach().reshape(-1))
            # Every rank starts from the group's first rank's parameters (as DDP does at construction).
            if self.padded:
                record_collective("broadcast", self.flat_param)
                broadcast_from_first([self.flat_param], group)
            for p in params:
                p.data = self.param_view(p).view_as(p)
                if p.grad is not None:
                    self.grad_view(p).copy_(p.grad.reshape(-1))
                p.grad = self.grad_view(p).view_as(p)
        for b in self.buckets:
            # The inner optimizer's parameters: this rank's chunk of each bucket. They share the flat
            # buffer's storage, so the update lands in the model's parameters and the all-gather runs in place.
            b.shard = nn.Parameter(self.flat_param[b.lo:b.hi], requires_grad=True)

    def param_view(self, p: torch.Tensor) -> torch.Tensor:
        return self.flat_param[self.offset[p]:self.offset[p] + p.numel()]

    def grad_view(self, p: torch.Tensor) -> torch.Tensor:
        return self.flat_grad[self.offset[p]:self.offset[p] + p.numel()]

    def adopt_gradient(self, p: torch.Tensor) -> None:
        """Make ``p.grad`` a view of the flat buffer again (it may have been set to None or replaced)."""
        view = self.grad_view(p).view_as(p)
        with torch.no_grad():
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.stride() != view.stride():
                view.copy_(p.grad)
            else:
                return
        p.grad = view


class ZeRO1Optimizer(torch.optim.Optimizer):
    """ZeRO-1: optimizer state sharded over ranks with DDP's communication volume (see the module docstring).

    ``ZeRO1Optimizer(params, torch.optim.AdamW, lr=1e-3)``; parameter groups and :meth:`add_param_group` as
    for any optimizer (each group must share one dtype and device). ``bucket_size_mb`` (keyword, default 100)
    sets the reduce-scatter granularity; ``overlap=False`` waits for :meth:`step` to reduce-scatter
    everything. Construction moves each group's parameters into a flat buffer (their ``.data`` become
    views of it) and broadcasts the values of the process group's first rank. ``process_group`` (keyword):
    the data-parallel ranks (see the module docstring).

    Use it *instead of* a DDP wrapper: run forward and backward on the local batch, then call :meth:`step`
    on every rank (it waits for the reduce-scatters, divides by the world size, updates this rank's chunks
    with the inner optimizer one bucket at a time and all-gathers each bucket as soon as it is updated).
    The inner optimizer must update each parameter independently (torch.optim's SGD, Adam, AdamW, ...).
    For gradient accumulation, run all but the last backward of a step inside :meth:`no_sync`. After ``step`` only
    this rank's chunks of the gradients hold averaged values (the rest keeps local gradients until
    :meth:`zero_grad`). Parameters without a gradient count as zero gradient, because chunks are updated as whole
    tensors. :meth:`zero_grad` always zeroes the flat gradient buffer in place (``set_to_none`` is ignored: freeing
    it would make autograd allocate a second set of gradients).

    Checkpoints are per rank: :meth:`state_dict` returns this rank's chunks of the state plus the layout
    (``world_size``, ``rank``, bucket sizes); :meth:`load_state_dict` needs the same layout.
    """

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], *, bucket_size_mb: float = 100,
                 overlap: bool = True, process_group: GroupLike = None, **kwargs):
        check_optimizer_cls(optimizer_cls)
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self._group = resolve_group(process_group, type(self).__name__)
        self._rank, self._world = rank_and_size(self._group)
        self._optimizer_cls = optimizer_cls
        self._inner_kwargs = kwargs
        self._bucket_bytes = int(bucket_size_mb * 2**20)
        self._overlap = overlap
        self._sync = True
        self._flat: list[_FlatGroup] = []
        self._order: list[_Bucket] = []  # every bucket, in launch order (same on every rank)
        self._next_launch = 0
        self.inner: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=dict(kwargs))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group: its parameters get their own flat buffers and the inner optimizer one more group."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        flat = _FlatGroup(group["params"], self._rank, self._world, self._bucket_bytes, self._group)
        self._flat.append(flat)
        self._order.extend(flat.buckets)
        for p in flat.params:
            # weakly held, with the group's index rather than the group (which holds the parameters): see
            # lab.parallel.hooks
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready, len(self._flat) - 1))
        local = {**hyperparameters(group), "params": [b.shard for b in flat.buckets]}
        if self.inner is None:
            self.inner = self._optimizer_cls([local], **self._inner_kwargs)
        else:
            self.inner.add_param_group(local)
        for k, v in hyperparameters(self.inner.param_groups[-1]).items():
            group.setdefault(k, v)

    def local_numel(self) -> int:
        """Number of parameter elements whose optimizer state this rank holds (its chunks, padding included)."""
        return sum(b.chunk for f in self._flat for b in f.buckets)

    # ---- gradient synchronization during backward ------------------------------------------------------

    def _on_grad_ready(self, group: int, p: torch.Tensor) -> None:
        if not (self._overlap and self._sync):
            return
        flat = self._flat[group]
        if p.data_ptr() != flat.param_view(p).data_ptr():
            return  # another ZeRO1Optimizer has since taken this parameter into its own buffer
        flat.adopt_gradient(p)
        bucket = flat.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch(self, bucket: _Bucket, flat: _FlatGroup) -> None:
        full = flat.flat_grad[bucket.start:bucket.start + bucket.padded]
        record_collective("reduce_scatter", full)
        # In place: this rank's chunk of the bucket receives the sum of everyone's chunk.
        bucket.handle = reduce_scatter_tensor(flat.flat_grad[bucket.lo:bucket.hi], full, group=self._group,
                                              async_op=True)

    def _launch_ready(self) -> None:
        # Strictly in bucket order, so every rank issues the same sequence of collectives.
        while self._next_launch < len(self._order):
            bucket = self._order[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket, self._flat_of(bucket))
            self._next_launch += 1

    def _flat_of(self, bucket: _Bucket) -> _FlatGroup:
        for flat in self._flat:
            if bucket in flat.buckets:
                return flat
        raise KeyError("bucket does not belong to this optimizer")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate local gradients (no reduce-scatter is launched)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (every ``p.grad`` stays a view of them)."""
        for flat in self._flat:
            flat.flat_grad.zero_()
            for p in flat.params:
                flat.adopt_gradient(p)

    # ---- the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Finish the reduce-scatters, update the local chunks, all-gather parameters; a collective call."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Buckets whose reduce-scatter did not start during backward (overlap off, no_sync, unused
        # parameters): make sure they hold the gradients and launch them, in order.
        for bucket in self._order[self._next_launch:]:
            flat = self._flat_of(bucket)
            for p in bucket.params:
                flat.adopt_gradient(p)
            bucket.ready = len(bucket.params)
        self._launch_ready()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(hyperparameters(outer))
        # Bucket by bucket: wait for its reduce-scatter, update its chunk (the inner optimizer sees only this
        # chunk's gradient, so a foreach optimizer's temporaries are one chunk large), then launch its
        # all-gather, which runs while the next bucket is updated.
        for bucket in self._order:
            bucket.shard.grad = None
        handles = []
        for flat in self._flat:
            for bucket in flat.buckets:
                if bucket.handle is None:  # an empty bucket (zero elements)
                    continue
                bucket.handle.wait()
                grad = flat.flat_grad[bucket.lo:bucket.hi]
                grad.div_(self._world)
                bucket.shard.grad = grad
                self.inner.step(**kwargs)
                bucket.shard.grad = None
                full = flat.flat_param[bucket.start:bucket.start + bucket.padded]
                record_collective("all_gather", full)
                handles.append(all_gather_tensor(full, flat.flat_param[bucket.lo:bucket.hi], group=self._group,
                                                 async_op=True))
        for h in handles:
            h.wait()
        for bucket in self._order:
            bucket.ready, bucket.handle = 0, None
        self._next_launch = 0
        return loss

    # ---- checkpoints -------------------------------------------------------------------------------------

    def _layout(self) -> list[list[int]]:
        return [[b.numel for b in f.buckets] for f in self._flat]

    def state_dict(self) -> dict[str, Any]:
        """This rank's chunks of the optimizer state and the layout they belong to (save one file per rank)."""
        inner = self.inner.state_dict()
        index = 0
        groups = []
        for g in self.param_groups:
            groups.append({**hyperparameters(g), "params": list(range(index, index + len(g["params"])))})
            index += len(g["params"])
        return {"format": "zero1-shard", "world_size": self._world, "rank": self._rank,
                "bucket_numels": self._layout(), "state": inner["state"], "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's chunks saved by :meth:`state_dict` (same world size, rank and buckets)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != "zero1-shard":
            raise ValueError("expected a ZeRO1Optimizer.state_dict() (format 'zero1-shard')")
        layout = (state_dict["world_size"], state_dict["rank"], [list(b) for b in state_dict["bucket_numels"]])
        mine = (self._world, self._rank, self._layout())
        if layout != mine:
            raise ValueError(f"state_dict was saved with (world_size, rank, bucket sizes) = {layout}, this "
                             f"optimizer has {mine}")
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            group.update(hyperparameters(saved))
        inner_groups, index = [], 0
        for saved, inner in zip(state_dict["param_groups"], self.inner.param_groups):
            ids = list(range(index, index + len(inner["params"])))
            inner_groups.append({**hyperparameters(saved), "params": ids})
            index += len(inner["params"])
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": inner_groups})
