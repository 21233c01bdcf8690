"""How :class:`lab.parallel.fsdp.FSDP`'s gradients travel back: reduce-scatter within the shard group, then,
under hybrid sharding (HSDP), all-reduce across the replicate group, and average.

Why two groups: FSDP's all-gathers and reduce-scatters cost more the more ranks they span, and across nodes
they run at the slower inter-node bandwidth. HSDP therefore shards each weight over a small group (e.g. the
GPUs of one node) and keeps one such sharded copy, a *replica*, per group; a rank's shard gradient is then
only summed with the matching shards of the other replicas, which is one all-reduce of ``1/shard_size`` of
the gradient across the replicate group. Without a replicate group this is plain FSDP.

Averaging: the sums are taken first and divided once by ``shard_size * replicas`` (the number of ranks whose
batches were summed). Replicated (small, non-2-D) parameters are all-reduced within the shard group and then
across the replicate group: the same sum as one all-reduce over every rank, using only the two groups FSDP
was given (which need not span the default group, e.g. beside tensor parallelism), and in a fixed order
(pairs first), so fp32 results are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lab.parallel.collectives import record_collective, reduce_scatter_tensor
from lab.parallel.fsdp_layout import Layer, ShardedWeight

# How many layers' gradient collectives stay in flight: a reduce-scatter holds its layer's full-size
# gradients, so letting them pile up until the end of backward would hold the whole model's gradient at once.
IN_FLIGHT = 2


class GradientReducer:
    """The gradient collectives of one :class:`FSDP`: per layer, one reduce-scatter (and one replicate
    all-reduce under HSDP), at most :data:`IN_FLIGHT` of each outstanding; the results are averaged and
    accumulated into the shards' ``.grad`` (in the shards' dtype)."""

    def __init__(self, shard_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None,
                 reduce_dtype: torch.dtype | None):
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_world = dist.get_world_size(shard_group)
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.reduce_dtype = reduce_dtype
        # (weights, work, this rank's slice of the sum, the full input kept alive until the work is done)
        self._scattering: list[tuple[list[ShardedWeight], object, torch.Tensor, torch.Tensor]] = []
        self._replicating: list[tuple[list[ShardedWeight], object, torch.Tensor]] = []
        # called with the parameters (shards, or replicated parameters) whose ``.grad`` just became final
        # for this backward: where an optimizer can update them while the rest of the backward runs
        self.on_grad_ready: list[Callable[[list[torch.Tensor]], None]] = []

    def grad_dtype(self, w: ShardedWeight) -> torch.dtype:
        """The dtype ``w``'s gradient is communicated in."""
        return self.reduce_dtype or w.shard.dtype

    def reduce_layer(self, layer: Layer) -> None:
        """Start one reduce-scatter of the gradients ``layer`` has collected (rank r receives its slice of
        each) and clear the layer's gradient bookkeeping."""
        order = sorted(layer.grads)
        weights = [layer.weights[i] for i in order]
        grads = [layer.grads[i] for i in order]
        layer.grads, layer.expected, layer.received = {}, 0, 0
        if len(grads) == 1:
            send = grads[0].contiguous()
        else:  # (rank, concatenated slices): rank r's slice of every gradient side by side
            send = torch.cat([g.view(self.shard_world, -1) for g in grads], dim=1).view(-1)
        out = torch.empty(send.numel() // self.shard_world, dtype=send.dtype, device=send.device)
        record_collective("reduce_scatter", send)
        work = reduce_scatter_tensor(out, send, group=self.shard_group, async_op=True)
        self._scattering.append((weights, work, out, send))
        while len(self._scattering) > IN_FLIGHT:
            self._finish_scatter(*self._scattering.pop(0))

    def _finish_scatter(self, weights: list[ShardedWeight], work, out: torch.Tensor, _send: torch.Tensor) -> None:
        work.wait()
        if self.replicate_group is None:
            self._accumulate(weights, out)
            return
        record_collective("all_reduce", out)
        self._replicating.append((weights, dist.all_reduce(out, group=self.replicate_group, async_op=True), out))
        while len(self._replicating) > IN_FLIGHT:
            self._finish_replicate(*self._replicating.pop(0))

    def _finish_replicate(self, weights: list[ShardedWeight], work, out: torch.Tensor) -> None:
        work.wait()
        self._accumulate(weights, out)

    @torch.no_grad()
    def _accumulate(self, weights: list[ShardedWeight], total: torch.Tensor) -> None:
        out = total.to(weights[0].shard.dtype)
        out.div_(self.shard_world * self.replicas)
        for w, part in zip(weights, out.split([w.shard_numel for w in weights])):
            if w.shard.grad is None:
                w.shard.grad = part
            else:
                w.shard.grad.add_(part)
        self._grads_ready([w.shard for w in weights])

    def _grads_ready(self, params: list[torch.Tensor]) -> None:
        for callback in self.on_grad_ready:
            callback(params)

    def finish(self) -> None:
        """Wait for every outstanding gradient collective and accumulate its result."""
        while self._scattering:
            self._finish_scatter(*self._scattering.pop(0))
        while self._replicating:
            self._finish_replicate(*self._replicating.pop(0))

    @torch.no_grad()
    def reduce_replicated(self, params: list[torch.Tensor]) -> None:
        """Average the gradients of replicated parameters over every rank (shard group, then replicate
        group), flattened into one buffer; a missing gradient counts as zero."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        record_collective("all_reduce", flat)
        dist.all_reduce(flat, group=self.shard_group)
        if self.replicate_group is not None:
            record_collective("all_reduce", flat)
            dist.all_reduce(flat, group=self.replicate_group)
        flat.div_(self.shard_world * self.replicas)
        offset = 0
        for p in params:
            g = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        self._grads_ready(params)
