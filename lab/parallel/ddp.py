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

from lab.parallel.buckets import BUCKET_ORDERS, Bucket
from lab.parallel.hooks import weak_hook
from lab.parallel.process_groups import GroupLike, broadcast_from_first, global_rank, resolve_group


class _DataParallel(nn.Module):
    """What the four wrappers share: the group, initial broadcast, the parameters to reduce, ``no_sync``."""

    def __init__(self, module: nn.Module, process_group: GroupLike = None):
        super().__init__()
        self.process_group = resolve_group(process_group, type(self).__name__)
        self.module = module
        self.world_size = dist.get_world_size(self.process_group)
        # NCCL averages inside the collective; gloo has no AVG, so the overlapped wrappers divide first
        # (exact for a power of two)
        self._nccl_avg = dist.get_backend(self.process_group) == "nccl"
        self._sync = True
        # module.parameters() yields each Parameter object once even when it is registered under several
        # names (tied weights), which is exactly the set of gradients to reduce.
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        # Frozen parameters and buffers (e.g. RoPE tables) are broadcast too: replicas must be identical.
        broadcast_from_first(list(module.parameters()) + list(module.buffers()), self.process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _start_average(self, tensor: torch.Tensor) -> dist.Work:
        """Start an asynchronous all-reduce that leaves the group's mean in ``tensor``."""
        if self._nccl_avg:
            return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.process_group, async_op=True)
        tensor.div_(self.world_size)
        return dist.all_reduce(tensor, group=self.process_group, async_op=True)

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
        self._pending.append((self._start_average(param.grad), param))

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


class DDPBucketed(_DataParallel):
    """Bucketed, overlapped data parallelism: the scheme ``torch.nn.parallel.DistributedDataParallel`` uses.

    Parameters are grouped into buckets of at most ``bucket_size_mb`` MiB (a parameter larger than that gets
    a bucket of its own). When the last gradient of a bucket is ready, the bucket's flat buffer is all-reduced
    asynchronously while backward continues. One knob trades the two costs: small buckets overlap well but
    pay the per-call latency often; one huge bucket is :class:`FlatDDP` (no overlap).

    **Order** (``bucket_order``). A bucket can leave only once its *last* gradient is ready, so a bucket whose
    parameters the backward reaches at different times holds back the ones that were ready early, and the
    reductions pile up at the end of the backward where nothing hides them. Reverse registration order
    (``"reverse"``) is only a guess at the backward's order (a module registered before it is used, a weight
    shared between layers, a model that applies its layers in another order break it). ``"ready"`` (the
    default, as torch DDP does) starts with the reverse-order buckets, records the order in which the first
    synchronized backward produces the gradients, and after that backward rebuilds the buckets in that order
    (the group's first rank's order, broadcast, so that every rank launches the same collectives in the same
    order), so that each bucket leaves as soon as the backward has passed it.

    **Communication dtype** (``reduce_dtype``, e.g. ``torch.bfloat16``). The gradients travel in that dtype: half
    the bytes of fp32. Each gradient is rounded once, when it is copied into the bucket, and scaled by ``1 / world
    size`` (exact for a power-of-two world, so the bits are those of dividing before rounding); the all-reduce sums
    in that dtype, one rounding per addition (with two ranks one addition: at bf16's unit roundoff ``2**-8``, a
    reduced element then lies within ``(2**-7 + 2**-16)`` times the mean of the two ranks' magnitudes of the fp32
    average); the sum is copied back into the parameters' gradients in their own dtype (fp32), where accumulation
    under :meth:`no_sync` and the optimizer work as before. As torch DDP's ``bf16_compress_hook``.

    Bucket buffers are allocated once. The host's work per gradient and per bucket is what paces a backward
    whose kernels are short (a compiled block hands over all its gradients at once), so a gradient's hook only
    counts it. When a bucket's last gradient is ready, the gradients that are not their slot of the bucket's
    gradients are copied there (one multi-tensor copy; one that already lives there is not copied) and their
    parameters' ``.grad`` pointed at the slots (as torch DDP's ``gradient_as_bucket_view=True``); gradients
    accumulated in place (each ``.grad`` still the tensor that is its slot) cost one identity test each, and
    nothing moves. Then the all-reduce starts (after one cast of the whole bucket, in a compressed dtype),
    averaging inside the collective (NCCL's ``AVG``, a premultiplication by ``1 / world size``; on other
    backends one division of the buffer first). The all-reduce (or the copy back from the compressed buffer)
    leaves the averaged gradient in place, so nothing else is copied and no arithmetic remains after backward.
    ``.grad`` holds the average once its bucket has been waited for: :meth:`finish_gradient_synchronization`
    (queued automatically at the end of every synchronized backward) waits for every outstanding bucket.

    **Streams** (on a GPU). A bucket's copy in (a cast, in a compressed dtype) runs on a side stream that first
    waits for the backward's stream, and its all-reduce is launched from there (from the backward's stream when
    nothing is copied: the collective's own stream waits for it either way); the copy back out of a compressed
    buffer runs on a second one that waits for the all-reduce: neither sits on the backward's stream, where
    the copies would delay the next block's products, and the copies back run as each reduction ends instead
    of all at the end of the backward. The backward's stream waits for a bucket (an event, made once and
    reused) only where its average is needed: in :meth:`wait_for_gradients`, or at the end, where one wait
    for the second stream covers every bucket (their copies back are queued there in order). The buffers are
    marked as used by the side streams once, not at every launch: the allocator holds a freed block back until
    every stream marked has passed the free, so one mark serves until a rebuild frees them. A gradient that is
    copied and then dropped is marked as used on the side stream first, so the allocator does not hand its
    memory out before the copy has read it.

    **Consumers during the backward.** ``on_reduction_started`` holds callables called with a bucket's
    parameters right after its all-reduce is launched; :meth:`wait_for_gradients` then waits for exactly
    those buckets on the caller's current stream (on a GPU the host does not block; a side stream can wait
    while the backward goes on). :class:`lab.parallel.optimizer_in_backward.OptimizerInBackward` updates
    parameters there, as soon as their gradients are reduced.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group: GroupLike = None, *,
                 bucket_order: str = "ready", reduce_dtype: torch.dtype | None = None):
        super().__init__(module, process_group)
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb!r}")
        if bucket_order not in BUCKET_ORDERS:
            raise ValueError(f"bucket_order must be one of {', '.join(BUCKET_ORDERS)}, got {bucket_order!r}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating-point dtype, got {reduce_dtype}")
        self.bucket_size_mb = bucket_size_mb
        self.bucket_order = bucket_order
        self.reduce_dtype = reduce_dtype
        device = self.trainable[0].device if self.trainable else torch.device("cpu")
        on_gpu = device.type == "cuda" and all(p.device == device for p in self.trainable)
        #: the side streams of the buckets' copies in, and of the copies back (None off the GPU)
        self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if on_gpu else None
        self._computed = torch.cuda.Event() if on_gpu else None  # reused: marks the gradients computed so far
        self._index_of = {id(p): i for i, p in enumerate(self.trainable)}
        self.buckets = self._make_buckets(self.trainable[::-1], bucket_size_mb * 2**20, reduce_dtype)
        self._locate()
        #: trainable parameters' indices in the order their gradients became ready, recorded in the first
        #: synchronized backward when the buckets are to follow it (None once they do, or never will)
        self.ready_order: list[int] | None = [] if bucket_order == "ready" else None
        self.on_reduction_started: list = []
        self._any_ready = False
        self._got = [False] * len(self.trainable)  # whose gradient came this backward (to name the missing)
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready, i))
                       for i, p in enumerate(self.trainable)]

    @staticmethod
    def _make_buckets(params: list[torch.Tensor], capacity_bytes: float,
                      comm_dtype: torch.dtype | None = None) -> list[Bucket]:
        """Consecutive runs of ``params`` (in the order given) of at most ``capacity_bytes`` each, one dtype
        and device per bucket."""
        buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            same_kind = not current or (p.dtype == current[0].dtype and p.device == current[0].device)
            if current and (size + nbytes > capacity_bytes or not same_kind):
                buckets.append(Bucket(current, comm_dtype))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(Bucket(current, comm_dtype))
        return buckets

    def _locate(self) -> None:
        """Each trainable parameter's bucket, by index; on a GPU each bucket's event, and its buffers marked as
        used by the side streams once, which covers every backward until a rebuild frees them."""
        self._bucket_at = [None] * len(self.trainable)
        for b in self.buckets:
            for p in b.params:
                self._bucket_at[self._index_of[id(p)]] = b
            if self._streams is not None:
                b.done = torch.cuda.Event()
                for stream in self._streams:
                    b.mark_used(stream)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._any_ready:
            self._any_ready = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        if self.ready_order is not None:
            self.ready_order.append(i)
        self._got[i] = True
        bucket = self._bucket_at[i]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        """Move ``bucket``'s gradients into its buffer, point their ``.grad`` at the bucket and start the
        averaging all-reduce (on a GPU with the copies on the side streams)."""
        grads = [p.grad for p in bucket.params]
        moved = bucket.adopt(grads)
        if self._streams is None:
            bucket.copy_in(grads, moved)
            bucket.work = self._start_average(bucket.buffer)
        else:
            self._launch_on_streams(bucket, grads, moved)
        for callback in self.on_reduction_started:
            callback(bucket.params)

    def _launch_on_streams(self, bucket: Bucket, grads: list, moved: list) -> None:
        """Switches streams directly and back: the ``torch.cuda.stream`` context costs a dozen Python calls."""
        launch, back = self._streams
        compute = torch.cuda.current_stream()
        if compute.device_index != launch.device_index:  # not the autograd thread of the parameters' device
            with torch.cuda.device(launch.device_index):
                return self._launch_on_streams(bucket, grads, moved)
        try:
            if moved or bucket.buffer is not bucket.grads or not self._nccl_avg:  # kernels before the launch
                self._computed.record(compute)
                launch.wait_event(self._computed)  # the gradients are computed
                torch.cuda.set_stream(launch)
                for _, g in moved:  # dropped, still read by the copy on this stream
                    g.record_stream(launch)
                bucket.copy_in(grads, moved)
            bucket.work = self._start_average(bucket.buffer)
            torch.cuda.set_stream(back)
            bucket.work.wait()  # this stream waits for the collective, the host goes on
            bucket.copy_out()
            bucket.done.record(back)
        finally:
            torch.cuda.set_stream(compute)

    def _wait(self, bucket: Bucket) -> None:
        if bucket.reduced:
            return
        if self._streams is not None:  # the current stream waits for the copy back, the host goes on
            torch.cuda.current_stream(bucket.grads.device).wait_event(bucket.done)
        else:
            bucket.work.wait()
            bucket.copy_out()
        if bucket.grads.is_cuda and self.ready_order is not None:  # the rebuild after this backward frees them
            bucket.mark_used(torch.cuda.current_stream(bucket.grads.device))
        bucket.reduced = True

    def wait_for_gradients(self, params) -> None:
        """Wait, on the current stream, for the all-reduce of the buckets that hold ``params`` (each bucket
        once per backward), after which their ``.grad`` hold the average. Call it only for parameters whose
        bucket has started (``on_reduction_started``)."""
        for b in dict.fromkeys(self._bucket_at[self._index_of[id(p)]] for p in params):
            if b.work is None:
                raise RuntimeError("wait_for_gradients: a bucket of these parameters has not been launched")
            self._wait(b)

    def finish_gradient_synchronization(self) -> None:
        if not self._any_ready:
            return
        if any(b.work is None for b in self.buckets):
            # Wait for what was launched so no request is left dangling, then say what is missing.
            missing = [p for p, got in zip(self.trainable, self._got) if not got]
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
            self._reset()
            if self.ready_order is not None:  # record again, in a complete backward
                self.ready_order.clear()
            raise self._missing_grad_error(missing)
        if self._streams is not None:  # every copy back was queued on one stream, in order: one wait for all
            back = self._streams[1]
            torch.cuda.current_stream(back.device).wait_stream(back)
        else:
            for b in self.buckets:
                self._wait(b)
        if self.ready_order:
            self._rebuild_in_ready_order()
        self._reset()

    @torch.no_grad()
    def _rebuild_in_ready_order(self) -> None:
        """Buckets in the order of :attr:`ready_order` (the group's first rank's); the gradients still held
        move into the new buckets, and the old buffers go."""
        device = self.buckets[0].grads.device
        order = torch.tensor(self.ready_order, dtype=torch.int64, device=device)
        dist.broadcast(order, src=global_rank(self.process_group, 0), group=self.process_group)
        self.ready_order = None
        params = [self.trainable[i] for i in order.tolist()]
        buckets = self._make_buckets(params, self.bucket_size_mb * 2**20, self.reduce_dtype)
        for b in buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = view
        for b in self.buckets if device.type == "cuda" else ():  # freed below, once this stream has read them
            b.mark_used(torch.cuda.current_stream(device))
        self.buckets = buckets
        self._locate()

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.work, b.reduced = 0, None, False
        self._any_ready = False
        self._got[:] = [False] * len(self._got)

    def remove_hooks(self) -> None:
        """Detach from the module (the wrapper stops communicating)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def torch_ddp(module: nn.Module, bucket_size_mb: float = 25.0, process_group: GroupLike = None,
              ) -> nn.parallel.DistributedDataParallel:
    """PyTorch's ``DistributedDataParallel`` as the book compares against it, wherever it does: buckets of
    ``bucket_size_mb`` MiB (25 is its default) and gradients as views of its buckets
    (``gradient_as_bucket_view``), as :class:`DDPBucketed` keeps them. Without it torch DDP holds a second copy
    of the gradients and copies every reduced bucket out of it after the all-reduce, work on the step's critical
    path that ours does not do: the comparison would measure that setting, not the scheme."""
    device = next(module.parameters()).device
    return nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                               bucket_cap_mb=bucket_size_mb, gradient_as_bucket_view=True,
                                               process_group=resolve_group(process_group, "torch_ddp"))
