"""Activation offloading, applied from outside the model: what a block saves for backward waits in host
memory instead of on the GPU, and comes back just before the block's backward needs it.

Why: activation memory grows with the tokens of a step; checkpointing frees it by recomputing the block in
backward (about one more forward of the block). Offloading frees it by copying: the saved tensors travel to
pinned host memory during the forward and back during the backward, over the host link, on a side stream,
while the GPU computes. Where the link can move a block's activations in less time than the block computes,
the copies are hidden and the memory is freed for nothing but host memory and link traffic; where it cannot,
the excess shows as waiting. The two compose by block: offload the blocks whose copies hide, checkpoint
(recompute) the rest, so less is recomputed within the same memory budget.

How it works (the model knows nothing of it): :func:`activation_offloading` replaces ``model.blocks`` with
:class:`OffloadedBlock` wrappers around the same blocks. An offloaded block runs inside a
``torch.autograd.graph.saved_tensors_hooks`` pair from one :class:`ActivationOffloader`:

* **pack** (forward, as an operation saves a tensor): parameters, buffers, storages smaller than
  ``min_bytes`` and tensors on another device than the block computes on stay where they are (offloading
  frees the block's *device* memory: a host tensor the block saves, such as the CPU seed and offset that
  SDPA's efficient and flash kernels keep for their backward, is in host memory already, and a record's
  copies back all go to its block's device). Otherwise the tensor's whole *storage* is copied once per block (the
  input of q, k and v projections is saved three times but travels once; a view keeps its size, stride and
  offset, so the backward sees exactly the tensor that was saved): on CUDA a ``non_blocking`` copy into a
  pinned host buffer on a side stream that first waits for the compute stream. The device tensor is held
  until the block's forward ends (so its address cannot be reused and mistaken for another saved tensor
  within the block) and ``record_stream`` tells the caching allocator not to hand its memory out again
  before the copy is done. Autograd keeps only a small handle.
* **prefetch** (backward): a gradient hook on each block's output fires when the backward reaches the
  block, i.e. when the block after it has finished its backward. It brings that block's tensors back if
  they are not yet on their way (on demand: exposed) and starts the copies of the next ``prefetch``
  blocks of the backward (the ones before it in the forward) on the side stream, so they travel while
  this block's backward computes.
* **unpack**: the compute stream waits for the block's copy event (once per block), and the handle becomes
  a view of the fetched storage. The fetched device buffer is dropped by the offloader once every handle
  of it has been unpacked (autograd holds it while it needs it); the host copy lives as long as the graph, then
  waits in the offloader's pool for a later step's copy of its size.

On the CPU (no CUDA) the same path runs with "host" being a separate CPU tensor and no streams, so the
exactness of the round trip (gradients equal bit for bit) and the byte counters are testable anywhere.

Cost model (:func:`offload_cost_model`): a block that saves ``B`` bytes needs ``B / bandwidth`` seconds
each way over the host link. The device-to-host copy overlaps the following blocks' forward, the
host-to-device copy the backward of the block after it (which runs first); what is not covered is exposed:
``max(0, B / bandwidth - compute)``. The bandwidth is a parameter (measure the link: a PCIe Gen5 x16 link
moves tens of GB/s each way, far below HBM), and the copies also compete with the GPU's own memory traffic
and, under data parallelism, with the network's use of the same PCIe switch. Memory: the device holds
one block's saved tensors while that block runs (until its copies are queued and its forward ends) and the
blocks being brought back; pinned host memory holds every offloaded byte of the step
(:meth:`ActivationOffloader.host_bytes`).

Composition: blocks not chosen for offloading are still wrapped (their output's gradient hook drives the
prefetch) but their saved tensors are untouched, so a block that is itself a checkpoint wrapper keeps its
checkpointing. Offloading a checkpointed block moves only its input (the one tensor non-reentrant
checkpointing saves outside): checkpointing installs its own saved-tensor hooks inside, and autograd uses the
innermost pair; selective checkpointing keeps its saved outputs in a dispatch-mode cache that no saved-tensor
hook sees, so those stay on the device. Under ``lab.FSDP`` the gathered weights are not parameters, and
FSDP's own saved-tensor hooks (which replace a saved gathered weight by a key and gather it again in
backward) are outside ours, so autograd would call only ours: pass ``delegate=fsdp.saved_tensor_hooks()``
and every saved tensor goes to FSDP's pack first; what FSDP replaces is FSDP's, the rest is offloaded.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class OffloadStats:
    """Counters since the last :meth:`ActivationOffloader.reset_stats`: ``bytes_offloaded`` and ``copies``
    (storages copied to the host), ``bytes_pinned`` (of those, the bytes copied into page-locked host
    buffers: all of them on CUDA, none on the CPU), ``bytes_fetched`` and ``fetches`` (copied back),
    ``bytes_kept`` (storages an offloaded block saved but left in place: under ``min_bytes`` or on another
    device than the block's; parameters and buffers are not counted), ``prefetched`` / ``on_demand`` (blocks
    whose copies back started ahead of their backward / when it began), ``reused`` (copies to the host into a
    buffer an earlier step's copy left, rather than a newly allocated one), ``wait_s`` (seconds the computation
    waited for copies back: on CUDA the compute stream's stall, timed by events around each wait; on the CPU
    the host time of the copies back)."""

    bytes_offloaded: int = 0
    copies: int = 0
    bytes_fetched: int = 0
    fetches: int = 0
    bytes_kept: int = 0
    bytes_pinned: int = 0
    prefetched: int = 0
    on_demand: int = 0
    reused: int = 0
    wait_s: float = 0.0
    _wait_events: list = field(default_factory=list, repr=False)


def _recycle(pool: dict[int, list[torch.Tensor]], host: torch.Tensor) -> None:
    """A dead slot's host buffer, back to its offloader's pool (called by ``weakref.finalize``)."""
    pool.setdefault(host.numel(), []).append(host)


class _Slot:
    """One saved storage of a block's device: its host copy, and its device copy while the backward needs it."""

    __slots__ = ("__weakref__", "fetched", "host", "nbytes", "remaining", "uses")

    def __init__(self, host: torch.Tensor, nbytes: int):
        self.host, self.nbytes = host, nbytes
        self.fetched: torch.Tensor | None = None
        self.uses = self.remaining = 0


class _Record:
    """One forward call of one block on ``device`` (the one whose memory offloading frees): its slots, all
    storages of that device, and where their copies back stand."""

    def __init__(self, index: int, device: torch.device, offload: bool, prev: _Record | None):
        self.index, self.device, self.offload, self.prev = index, torch.device(device), offload, prev
        self.slots: list[_Slot] = []
        self.by_storage: dict[tuple, object] = {}  # storage -> its slot or _KEPT, during the block's forward
        self.alive: list[torch.Tensor] = []  # device tensors held until the block's forward ends
        self.event = None  # the copies back (CUDA)
        self.fetching = False
        self.waited = False


class _Handle:
    """What autograd keeps instead of an offloaded tensor."""

    __slots__ = ("dtype", "offset", "record", "size", "slot", "stride")

    def __init__(self, record: _Record, slot: _Slot, t: torch.Tensor):
        self.record, self.slot, self.dtype = record, slot, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class _Delegated:
    """What autograd keeps for a tensor the delegate's pack replaced."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


_KEPT = object()  # a storage left in place (under ``min_bytes``, or not on the block's device), already seen


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class ActivationOffloader:
    """Saved-tensor hooks that move a block's saved activations to host memory and back (module docstring).

    ``min_bytes``: storages smaller than this stay on the device (their copies cost more in launches than
    they free). ``prefetch``: how many blocks ahead of the backward to bring back (0: only on demand).
    ``exclude``: tensors never offloaded (parameters and buffers of the model, added by
    :func:`activation_offloading`); a storage is excluded if any excluded tensor shares it. ``time_waits``:
    on CUDA, time the compute stream's waits with events (read, with a synchronization, by :meth:`stats`).
    ``delegate``: an outer (pack, unpack) pair that sees every saved tensor first; a tensor its pack
    replaces (returns something else than the tensor) is its business, not offloaded (see the module
    docstring: FSDP's).
    """

    def __init__(self, min_bytes: int = 1 << 16, prefetch: int = 1, exclude: Iterable[torch.Tensor] = (),
                 time_waits: bool = True, delegate: tuple[Callable, Callable] | None = None):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 blocks, got {prefetch}")
        self.min_bytes, self.prefetch, self.time_waits = min_bytes, prefetch, time_waits
        self.delegate = delegate
        self._excluded: set[tuple] = set()
        self.exclude(exclude)
        self._stats = OffloadStats()
        self._slots: weakref.WeakSet[_Slot] = weakref.WeakSet()  # host copies alive (their graphs are)
        # host buffers of dead slots, by size, for later steps: all their copies run on the one side stream in
        # host order, so reuse needs no event. (The caching host allocator lends a freed pinned block only once
        # its copies' events completed; with the host a step ahead of the GPU it pins new memory, slowly.)
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._stream = None  # the side stream, made on first CUDA use
        # the last block's record, weakly: the autograd graph holds records (through their handles and the
        # output hooks); holding them here would keep a finished step's host copies alive into the next
        self._last: weakref.ref | None = None
        self._current: _Record | None = None

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never offload the storages of ``tensors`` (e.g. parameters, buffers, gathered weights)."""
        self._excluded.update(self._key(t) for t in tensors)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        s = t.untyped_storage()
        return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())

    # ---- counters ------------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """The counters (a copy); on CUDA with ``time_waits`` this synchronizes to read the wait events."""
        s = self._stats
        if s._wait_events:
            torch.cuda.synchronize()
            s.wait_s += sum(a.elapsed_time(b) for a, b in s._wait_events) / 1e3
            s._wait_events.clear()
        return OffloadStats(**{k: v for k, v in vars(s).items() if k != "_wait_events"})

    def host_bytes(self) -> int:
        """Bytes of host memory holding saved activations now (freed with the graph that saved them)."""
        return sum(s.nbytes for s in list(self._slots))

    def pooled_bytes(self) -> int:
        """Bytes of host buffers kept for reuse (their slots died), freed by :meth:`release_host_buffers`."""
        return sum(b.numel() for bufs in self._pool.values() for b in bufs)

    def release_host_buffers(self) -> None:
        """Drop the host buffers kept for reuse (e.g. after the last step, or before a step of other shapes)."""
        self._pool.clear()

    def reset_stats(self) -> None:
        """Zero the counters (e.g. at the start of each measured step)."""
        self._stats = OffloadStats()

    # ---- forward -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self, index: int, device: torch.device, offload: bool = True) -> Iterator[_Record]:
        """The forward of block ``index``, computing on ``device`` (its input's): with ``offload``, the saved
        tensors of that device go through the hooks. Yields the block's record (for :meth:`backward_reached`)."""
        last = self._last() if self._last is not None else None
        record = _Record(index, device, offload, last if last is not None and last.index < index else None)
        self._last, self._current = weakref.ref(record), record
        try:
            if offload:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield record
            else:
                yield record
        finally:
            self._current = None
            record.by_storage.clear()
            record.alive.clear()  # on CUDA, record_stream keeps the memory from reuse until the copies finish

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, t: torch.Tensor):
        if self.delegate is not None:
            packed = self.delegate[0](t)
            if packed is not t:
                return _Delegated(packed)
        record = self._current
        if record is None or t.layout != torch.strided or t.is_neg() or t.is_conj():
            return t
        key = self._key(t)
        if key in self._excluded or (t.is_leaf and t.requires_grad):
            return t
        slot = record.by_storage.get(key)
        if slot is _KEPT:
            return t
        if slot is None:
            nbytes = key[3]
            if nbytes < max(self.min_bytes, 1) or t.device != record.device:  # nothing to move, or not ours
                self._stats.bytes_kept += nbytes
                record.by_storage[key] = _KEPT
                return t
            slot = self._offload(t, nbytes)
            record.slots.append(slot)
            record.by_storage[key] = slot
            record.alive.append(t)
        slot.uses += 1
        slot.remaining += 1
        return _Handle(record, slot, t)

    @torch.no_grad()
    def _offload(self, t: torch.Tensor, nbytes: int) -> _Slot:
        src = _bytes_view(t.untyped_storage(), t.device)
        free = self._pool.get(nbytes)
        host = free.pop() if free else None
        self._stats.reused += host is not None
        if t.device.type == "cuda":
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # the tensor's producer first
            with torch.cuda.stream(stream):
                if host is None:
                    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                host.copy_(src, non_blocking=True)
            t.record_stream(stream)
            self._stats.bytes_pinned += nbytes if host.is_pinned() else 0
        elif host is None:
            host = src.clone()
        else:
            host.copy_(src)
        self._stats.bytes_offloaded += nbytes
        self._stats.copies += 1
        slot = _Slot(host, nbytes)
        self._slots.add(slot)
        weakref.finalize(slot, _recycle, self._pool, host)
        return slot

    # ---- backward ------------------------------------------------------------------------------------

    def backward_reached(self, record: _Record) -> None:
        """The backward has reached ``record``'s block (its output's gradient exists): make sure its tensors
        are on their way back, and start bringing back the next ``prefetch`` blocks of the backward."""
        if record.offload and not record.fetching:
            self._stats.on_demand += 1
            self._fetch(record)
        ahead, depth = record.prev, 0
        while ahead is not None and depth < self.prefetch:
            if ahead.offload and not ahead.fetching:
                self._stats.prefetched += 1
                self._fetch(ahead)
            ahead, depth = ahead.prev, depth + 1

    @torch.no_grad()
    def _fetch(self, record: _Record) -> None:
        record.fetching, record.waited = True, False
        slots = [s for s in record.slots if s.fetched is None]
        if not slots:
            return
        device = record.device
        if device.type == "cuda":
            # Allocated on the compute stream, which will use and free them: a side-stream allocation would
            # come from the caching allocator's separate pool for that stream, which the compute stream's
            # freed memory cannot serve. The copies wait for the compute work queued so far (the previous
            # block's backward), so they overlap this block's.
            compute = torch.cuda.current_stream(device)
            for s in slots:
                s.fetched = torch.empty(s.nbytes, dtype=torch.uint8, device=device)
            stream = self._side_stream(device)
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                for s in slots:
                    s.fetched.copy_(s.host, non_blocking=True)
                    s.fetched.record_stream(stream)
                record.event = stream.record_event()
        else:
            start = time.perf_counter()
            for s in slots:
                s.fetched = s.host.clone()
            self._stats.wait_s += time.perf_counter() - start
        self._stats.bytes_fetched += sum(s.nbytes for s in slots)
        self._stats.fetches += len(slots)

    def _unpack(self, handle):
        if isinstance(handle, _Delegated):
            return self.delegate[1](handle.packed)
        if not isinstance(handle, _Handle):
            return handle
        record, slot = handle.record, handle.slot
        if slot.fetched is None:  # not reached through its block's output (or a second backward)
            self._stats.on_demand += 1
            record.fetching = False
            self._fetch(record)
        if not record.waited:
            record.waited = True
            if record.event is not None:
                self._wait(record)
        with torch.no_grad():
            out = torch.empty(0, dtype=handle.dtype, device=record.device).set_(
                slot.fetched.untyped_storage(), handle.offset, handle.size, handle.stride)
        slot.remaining -= 1
        if slot.remaining == 0:  # every saved use has its tensor: autograd holds it from here
            slot.fetched = None
            slot.remaining = slot.uses
            if all(s.fetched is None for s in record.slots):
                record.fetching = False
        return out

    def _wait(self, record: _Record) -> None:
        compute = torch.cuda.current_stream(record.device)
        if self.time_waits:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(compute)
            compute.wait_event(record.event)
            after.record(compute)
            self._stats._wait_events.append((before, after))
        else:
            compute.wait_event(record.event)
        record.event = None


class OffloadedBlock(nn.Module):
    """Run ``block`` (block ``index`` of the list) with ``offloader``'s hooks when ``offload``; either way,
    tell the offloader when the backward reaches the block (a gradient hook on its output)."""

    def __init__(self, block: nn.Module, offloader: ActivationOffloader, index: int, offload: bool = True):
        super().__init__()
        self.block, self.offloader, self.index, self.offload = block, offloader, index, offload

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        with self.offloader.saving(self.index, x.device, self.offload) as record:
            out = self.block(x)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            offloader = self.offloader
            out.register_hook(lambda grad: offloader.backward_reached(record))
        return out


@contextlib.contextmanager
def activation_offloading(model: nn.Module, offload_blocks: Sequence[int] | None = None, attr: str = "blocks",
                          offloader: ActivationOffloader | None = None, exclude: Callable[[], Iterable] | None = None,
                          **kwargs) -> Iterator[ActivationOffloader]:
    """Within the ``with`` block, ``model.<attr>`` (an ``nn.ModuleList`` of blocks called in sequence) runs
    with activation offloading; the original list is restored on exit.

    ``offload_blocks``: indices of the blocks whose saved tensors go to the host (None: every block but the
    last, whose backward starts as soon as the forward ends, so its copies could not be hidden). The other
    blocks run as they are (e.g. checkpointed). The model's parameters and buffers are never offloaded;
    ``exclude`` adds tensors (called once here). ``offloader``: reuse one; otherwise one is made from
    ``kwargs`` (see :class:`ActivationOffloader`). Yields the offloader (its :meth:`~ActivationOffloader.stats`
    give the bytes moved and the time waited).
    """
    original = getattr(model, attr, None)
    if not isinstance(original, nn.ModuleList):
        raise TypeError(f"model.{attr} must be an nn.ModuleList of blocks, got {type(original).__name__}")
    n = len(original)
    chosen = set(range(n - 1) if offload_blocks is None else offload_blocks)
    if not chosen <= set(range(n)):
        raise ValueError(f"offload_blocks must be indices of the {n} blocks, got {sorted(chosen)}")
    if offloader is None:
        offloader = ActivationOffloader(**kwargs)
    elif kwargs:
        raise ValueError(f"pass either an offloader or its settings, not both: {sorted(kwargs)}")
    offloader.exclude(list(model.parameters()) + list(model.buffers()))
    if exclude is not None:
        offloader.exclude(exclude())
    setattr(model, attr, nn.ModuleList(OffloadedBlock(b, offloader, i, i in chosen) for i, b in enumerate(original)))
    try:
        yield offloader
    finally:
        setattr(model, attr, original)


def offload_cost_model(block_bytes: float, block_forward_s: float, block_backward_s: float,
                       bandwidth_bytes_per_s: float, blocks: int = 1) -> dict[str, float]:
    """Modelled cost of offloading ``blocks`` blocks that each save ``block_bytes`` bytes, over a host link
    of ``bandwidth_bytes_per_s`` each way (a parameter: measure your link).

    Each block's copy out overlaps the next block's forward (``block_forward_s``), each copy back the
    backward of the block after it (``block_backward_s``). Returns seconds per step: ``transfer_s`` (one
    way, all blocks), ``exposed_forward_s`` and ``exposed_backward_s`` (the copies' excess over the
    compute covering them), ``hidden_s`` (both directions' transfer time minus the exposed), and
    ``bytes_moved`` (both directions) and ``freed_bytes`` (device memory no longer held by the blocks).
    """
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    one = block_bytes / bandwidth_bytes_per_s
    exposed_fwd = blocks * max(0.0, one - block_forward_s)
    exposed_bwd = blocks * max(0.0, one - block_backward_s)
    return dict(transfer_s=blocks * one, exposed_forward_s=exposed_fwd, exposed_backward_s=exposed_bwd,
                hidden_s=2 * blocks * one - exposed_fwd - exposed_bwd, bytes_moved=2 * blocks * block_bytes,
                freed_bytes=blocks * block_bytes)
