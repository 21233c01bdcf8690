"""Data parallelism: every rank holds the whole model, sees its own shard of the batch, and gradients are
averaged over ranks before the optimizer step, so all replicas take the same step.

Four wrappers, from the most obvious to the one that is used in practice. All of them

* take ``process_group`` (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None for the default group): the ranks
  that hold the same model and average their gradients. On a 2-D mesh (data x tensor parallel) that is the
  data-parallel slice, not every rank; every collective, rank and world size below is the group's,
* broadcast the group's first rank's parameters and buffers at construction (replicas start identical),
* reduce only parameters that need a gradient, and each ``nn.Parameter`` object once (tied weights that
  are registered under two names are one tensor with one gradient),
* average: sum over the group's ranks and divide by its size (the overlapped wrappers divide *before* the sum,
  so no arithmetic is left after backward; for two ranks, or any power of two, both orders give the same
  bits, so all four match single-process training exactly in fp32),
* expose ``finish_gradient_synchronization()`` (call it after ``backward()``, before ``optimizer.step()``;
  it returns once every gradient holds the average) and ``no_sync()`` for gradient accumulation,
* delegate ``forward`` to the wrapped module (``.module``).

Usage, identical for all four::

    model = DDPBucketed(TransformerLM(cfg).to(device), bucket_size_mb=25)  # process_group=mesh["dp"] on a mesh
    loss = loss_fn(model(x_local), y_local)
    loss.backward()
    model.finish_gradient_synchronization()
    optimizer.step()

Every trainable parameter must receive a gradient on every rank in every synchronized backward (as with
``torch.nn.parallel.DistributedDataParallel`` without ``find_unused_parameters``); the wrappers raise a
clear error naming the parameters otherwise, instead of hanging.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lab.parallel.hooks import weak_hook
from lab.parallel.process_groups import GroupLike, broadcast_from_first, resolve_group


class _DataParallel(nn.Module):
    """What the four wrappers share: the group, initial broadcast, the parameters to reduce, ``no_sync``."""

    def __init__(self, module: nn.Module, process_group: GroupLike = None):
        super().__init__()
        self.process_group = resolve_group(process_group, type(self).__name__)
        self.module = module
        self.world_size = dist.get_world_size(self.process_group)
        self._sync = True
        # module.parameters() yields each Parameter object once even when it is registered under several
        # names (tied weights), which is exactly the set of gradients to reduce.
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        # Frozen parameters and buffers (e.g. RoPE tables) are broadcast too: replicas must be identical.
        broadcast_from_first(list(module.parameters()) + list(module.buffers()), self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating; the first backward
        after the block reduces the accumulated sum (so accumulation costs one all-reduce per step)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_gradient_synchronization(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _missing_grad_error(self, params) -> RuntimeError:
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = [names.get(id(p), "?") for p in params]
        return RuntimeError(f"{type(self).__name__}: parameter(s) {missing[:5]} got no gradient in this backward; "
                            "every trainable parameter must be used on every rank (freeze unused ones with "
                            "requires_grad_(False))")


class NaiveDDP(_DataParallel):
    """Naive data parallelism: after backward, one blocking all-reduce per parameter gradient.

    Not used in practice, but the starting point to understand data parallelism: it is obviously correct,
    and it shows the two costs the other wrappers remove. Communication starts only after the whole backward
    has finished (no overlap with compute), and a model with hundreds of parameter tensors pays the fixed
    per-call latency of a collective hundreds of times.
    """

    def finish_gradient_synchronization(self) -> None:
        if not self._sync:
            return
        for p in self.trainable:
            if p.grad is None:
                raise self._missing_grad_error([p])
            dist.all_reduce(p.grad, group=self.process_group)
            p.grad.div_(self.world_size)


class FlatDDP(_DataParallel):
    """Flat data parallelism: copy all gradients into one flat buffer and all-reduce it with a single call.

    Exists to separate the two costs of :class:`NaiveDDP`: it pays the per-call latency once instead of
    once per parameter, but still communicates only after backward has finished, so nothing overlaps.
    The flat buffer (one extra copy of the gradients) is allocated once and reused every step.
    """

    def __init__(self, module: nn.Module, process_group: GroupLike = None):
        super().__init__(module, process_group)
        self._flat: torch.Tensor | None = None

    def finish_gradient_synchronization(self) -> None:
        if not self._sync or not self.trainable:
            return
        missing = [p for p in self.trainable if p.grad is None]
        if missing:
            raise self._missing_grad_error(missing)
        grads = [p.grad for p in self.trainable]
        if self._flat is None:
            dtypes = {g.dtype for g in grads}
            if len(dtypes) > 1:
                raise TypeError(f"FlatDDP needs gradients of one dtype, got {sorted(map(str, dtypes))}")
            self._flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        views = self._views(grads)
        torch._foreach_copy_(views, [g.reshape(-1) for g in grads])
        dist.all_reduce(self._flat, group=self.process_group)
        self._flat.div_(self.world_size)
        torch._foreach_copy_([g.view(-1) for g in grads], views)

    def _views(self, grads) -> list[torch.Tensor]:
        return list(self._flat.split([g.numel() for g in grads]))


class DDPIndividualParameters(_DataParallel):
    """Overlapped data parallelism: each gradient is all-reduced asynchronously the moment it is ready.

    A post-accumulate-grad hook fires as soon as backward has produced a parameter's final gradient; the
    hook starts a non-blocking all-reduce, so the last layers' gradients travel while backward is still
    computing the first layers'. The averaging happens before the sum (NCCL's ``AVG`` reduction, or a
    division inside the hook on gloo), so nothing is left to compute after the last request.
    ``finish_gradient_synchronization`` (also queued automatically at the end of every synchronized
    backward) waits for the outstanding requests. Still one collective per parameter tensor: the
    per-call latency of :class:`NaiveDDP` remains.
    """

    def __init__(self, module: nn.Module, process_group: GroupLike = None):
        super().__init__(module, process_group)
        # NCCL averages inside the collective; gloo has no AVG, so divide first (exact for a power of two).
        self._nccl_avg = dist.get_backend(self.process_group) == "nccl"
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._launched = 0
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready)) for p in self.trainable]

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if self._launched == 0:
            # wait at the end of this backward, so callers cannot forget to
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        self._launched += 1
        if self._nccl_avg:
            work = dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)
        else:
            param.grad.div_(self.world_size)
            work = dist.all_reduce(param.grad, group=self.process_group, async_op=True)
        self._pending.append((work, param))

    def finish_gradient_synchronization(self) -> None:
        if self._launched == 0:
            return  # nothing in flight (already finished, or the backward ran under no_sync)
        if self._launched != len(self.trainable):
            launched = {id(p) for _, p in self._pending}
            self._reset()
            raise self._missing_grad_error([p for p in self.trainable if id(p) not in launched])
        for work, _ in self._pending:
            work.wait()
        self._reset()

    def _reset(self) -> None:
        self._pending.clear()
        self._launched = 0

    def remove_hooks(self) -> None:
        """Detach from the module (the wrapper stops communicating)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _Bucket:
    """A group of parameters whose gradients are reduced together through one flat buffer."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        # views into the buffer, one per parameter, created once
        self.views = [v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in params]), params)]
        self.ready = 0
        self.work: dist.Work | None = None


class DDPBucketed(_DataParallel):
    """Bucketed, overlapped data parallelism: the scheme ``torch.nn.parallel.DistributedDataParallel`` uses.

    Parameters are grouped, in reverse registration order (roughly the order backward produces their
    gradients), into buckets of at most ``bucket_size_mb`` MiB (a parameter larger than that gets a bucket
    of its own). When the last gradient of a bucket is ready, the bucket's flat buffer is all-reduced
    asynchronously while backward continues. One knob trades the two costs: small buckets overlap well but
    pay the per-call latency often; one huge bucket is :class:`FlatDDP` (no overlap).

    Bucket buffers are allocated once. When a gradient is ready it is divided by the world size *while*
    being copied into its slot of the bucket (one kernel), and the parameter's ``.grad`` is then pointed at
    that slot (as torch DDP's ``gradient_as_bucket_view=True``): the all-reduce leaves the averaged
    gradient in place, so nothing is copied back and no arithmetic remains after backward.
    ``finish_gradient_synchronization`` (queued automatically at the end of every synchronized backward)
    only waits for the outstanding requests.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group: GroupLike = None):
        super().__init__(module, process_group)
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        self.bucket_size_mb = bucket_size_mb
        self.buckets = self._make_buckets(self.trainable, bucket_size_mb * 2**20)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._launched = 0
        self._any_ready = False
        self._seen: set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready)) for p in self.trainable]

    @staticmethod
    def _make_buckets(params: list[torch.Tensor], capacity_bytes: float) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (p.dtype == current[0].dtype and p.device == current[0].device)
            if current and (size + nbytes > capacity_bytes or not same_kind):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._any_ready:
            self._any_ready = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        bucket, i = self._where[id(param)]
        view = bucket.views[i]
        torch.div(param.grad, self.world_size, out=view)  # average while copying into the bucket
        param.grad = view  # the gradient now lives in the bucket: the all-reduce result lands in .grad
        bucket.ready += 1
        self._seen.add(id(param))
        if bucket.ready == len(bucket.params):
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            self._launched += 1

    def finish_gradient_synchronization(self) -> None:
        if not self._any_ready:
            return
        if self._launched != len(self.buckets):
            # Wait for what was launched so no request is left dangling, then say what is missing.
            missing = [p for p in self.trainable if id(p) not in self._seen]
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
            self._reset()
            raise self._missing_grad_error(missing)
        for b in self.buckets:
            b.work.wait()
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.work = 0, None
        self._launched = 0
        self._any_ready = False
        self._seen.clear()

    def remove_hooks(self) -> None:
        """Detach from the module (the wrapper stops communicating)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
