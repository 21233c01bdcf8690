"""The flat gradient buckets of :class:`lab.parallel.ddp.DDPBucketed`: a group of parameters whose gradients
live as views of one flat buffer, reduced together with one collective, and the orders the buckets are
filled in."""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

#: Orders in which :class:`lab.parallel.ddp.DDPBucketed` fills its buckets: ``ready``, the order the first
#: backward produced the gradients in (recorded then, and the buckets rebuilt after it), or ``reverse``
#: registration order.
BUCKET_ORDERS = ("ready", "reverse")


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory seen the same way (a gradient already in its bucket)."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape


class Bucket:
    """A group of parameters whose gradients are reduced together through one flat buffer.

    ``grads`` holds the averaged gradients (each parameter's ``.grad`` is a view of it); ``buffer`` is what
    travels: ``grads`` itself, or a copy in the communication dtype, copied back into ``grads`` once reduced."""

    def __init__(self, params: list[torch.Tensor], comm_dtype: torch.dtype | None = None):
        self.params = params
        numel, like = sum(p.numel() for p in params), params[0]
        self.grads = torch.empty(numel, dtype=like.dtype, device=like.device)
        compressed = comm_dtype is not None and comm_dtype != like.dtype
        self.buffer = torch.empty(numel, dtype=comm_dtype, device=like.device) if compressed else self.grads
        # views, one per parameter, created once
        self.views = self._views(self.grads)
        self.sends = self._views(self.buffer) if compressed else self.views
        self.ready = 0
        self.work: dist.Work | None = None
        self.done: torch.cuda.Event | None = None  # on a GPU: recorded once the average is in ``grads``
        self.reduced = False  # waited for, and its average in ``grads``, this backward

    def adopt(self, grads: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Point each parameter's ``.grad`` that is not its slot of the bucket at it; the gradients to copy there,
        with their slots (the others already are that memory). Accumulated in place, every gradient still is its
        slot, the same tensor: one identity test each, and nothing moves."""
        if all(map(operator.is_, grads, self.views)):
            return []
        moved = []
        for p, view, g in zip(self.params, self.views, grads):
            if g is not view:
                if not same_memory(view, g):
                    moved.append((view, g))
                p.grad = view  # the gradient now lives in the bucket: the reduced average lands in .grad
        return moved

    def copy_in(self, grads: list[torch.Tensor], moved: list) -> None:
        """Fill ``buffer``: the cast of the whole bucket in a compressed dtype, else the ``moved`` gradients."""
        if self.buffer is not self.grads:
            if moved:
                torch._foreach_copy_(self.sends, grads)
            else:
                self.buffer.copy_(self.grads)
        elif moved:
            torch._foreach_copy_([view for view, _ in moved], [g for _, g in moved])

    def copy_out(self) -> None:
        """Once reduced: the average from a compressed ``buffer`` back into ``grads`` (nothing where they are one)."""
        if self.buffer is not self.grads:
            self.grads.copy_(self.buffer)

    def mark_used(self, stream: torch.cuda.Stream) -> None:
        """The caching allocator holds the buffers back, once freed, until ``stream`` has passed the free."""
        self.grads.record_stream(stream)
        self.buffer.record_stream(stream)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in self.params]), self.params)]
