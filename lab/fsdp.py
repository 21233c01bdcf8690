"""Fully sharded data parallelism: each rank stores 1/n of every weight matrix and gathers it only to use it.

Why it exists: ZeRO-1 shards the optimizer state but still keeps full parameters and gradients on every
rank (8 of AdamW's 16 bytes per parameter). FSDP shards those too. Every 2-D parameter (the weight of a
Linear, an Embedding or any module that owns a matrix) is kept as a flat, padded 1/n *shard*; just before
the module runs, the shards are all-gathered into the full weight, which is dropped right after the module
has run. In backward the weight is gathered again where it is needed, and its gradient is reduce-scattered
straight back into shards, so no rank ever holds the full gradient. Small parameters (1-D: norms, biases)
are replicated and their gradients all-reduced, as in DDP.

How it works here (no change to the model):

* the module's 2-D parameter is replaced by its shard (``module.parameters()`` yields the shards, so an
  unmodified ``torch.optim.AdamW`` updates the local shards only);
* a forward pre-hook on the owning module all-gathers the weight (in ``compute_dtype`` when given: the
  cast happens *before* the communication, halving it) and makes it the module's attribute through
  :class:`_GatherWeight`, an autograd function whose backward launches the gradient's reduce-scatter;
  the hook also starts the all-gathers of the next two layers (prefetch), so communication overlaps compute;
* a forward hook drops the gathered weight. Autograd would keep it alive for the backward (a matmul saves its
  weight), so during the forward a ``saved_tensors_hooks`` pair replaces saved gathered weights by a small
  key; in backward the key is unpacked by gathering the weight again (prefetching two layers ahead in
  reverse order), and the gathered copy is dropped as soon as the weight's gradient has been produced;
* reduce-scatters are waited for (at most two stay in flight, each holding one layer's full gradient) and
  their results divided by the world size and accumulated into the shard's ``.grad`` (fp32); at the end of
  backward (an autograd-engine callback) the last ones are finished and replicated gradients are
  all-reduced and averaged. :meth:`FSDP.finish_gradient_synchronization` does the same explicitly and is a
  no-op when the callback already ran.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab.collectives import all_gather_tensor, reduce_scatter_tensor
from lab.sharded_optimizer import record_collective

COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class _ShardedWeight:
    """One 2-D parameter: its fp32 shard, and the gathered full weight while it is in use."""

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
        self.layer: _Layer | None = None
        self.pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (work, output, input) in flight
        self.gathered: torch.Tensor | None = None  # the padded flat full weight, once the gather finished
        self.grad_done = False  # this backward already produced (and reduce-scattered) the gradient


class _Layer:
    """A module that owns sharded weights: the unit that is gathered, prefetched and freed together."""

    def __init__(self, module: nn.Module, name: str, weights: list[_ShardedWeight]):
        self.module, self.name, self.weights = module, name, weights
        for w in weights:
            w.layer = self


class _Packed:
    """What autograd stores instead of a gathered weight it saved for backward."""

    __slots__ = ("offset", "size", "stride", "weight")

    def __init__(self, weight: _ShardedWeight, t: torch.Tensor):
        self.weight, self.size, self.stride, self.offset = weight, t.size(), t.stride(), t.storage_offset()


class _GatherWeight(torch.autograd.Function):
    """Connects the gathered full weight to its shard in the autograd graph.

    Forward returns the already-gathered flat weight; backward hands its gradient to :class:`FSDP`, which
    reduce-scatters it asynchronously. The shard's gradient is set by FSDP when the reduce-scatter is
    waited for, not returned here, so that the collective overlaps the rest of the backward.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, fsdp: FSDP, weight: _ShardedWeight) -> torch.Tensor:
        ctx.fsdp, ctx.weight = fsdp, weight
        return fsdp._take_gathered(weight)

    @staticmethod
    def backward(ctx, grad_flat: torch.Tensor):
        ctx.fsdp._gradient_ready(ctx.weight, grad_flat)
        return None, None, None


class FSDP(nn.Module):
    """Wrap ``module`` for fully sharded data parallel training (see the module docstring).

    ``compute_dtype`` (None, torch.float32, torch.bfloat16 or torch.float16): the dtype weights are gathered
    and computed in. With a 16-bit dtype, shards are cast *before* the all-gather, the wrapped module runs
    under ``torch.autocast(compute_dtype)`` (so activations meet the weights in that dtype; norms stay fp32
    as autocast decides), and master weights, gradients and the optimizer's update stay fp32.
    ``reduce_dtype``: the dtype gradients are reduce-scattered in (None: that of the master
    weights, fp32; bf16 halves the traffic, as FSDP2 does by default with a bf16 ``param_dtype``; the
    shards' ``.grad`` are fp32 either way). ``prefetch``: how many layers ahead to gather (at most 2).

    Every rank starts from rank 0's parameters and buffers (broadcast at construction). Build the optimizer
    over ``fsdp.parameters()`` *after* wrapping: it sees the local shards and replicated small parameters.
    Forward and backward are collective calls (all ranks, same model, same order of layers). Tied 2-D
    parameters (one matrix used by two modules) and modules that read another module's weight are not
    supported. With ``compute_dtype=None`` under an outer autocast the cast weight copies are saved by
    autograd outside FSDP's control; pass ``compute_dtype`` instead.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, prefetch: int = 2):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        if reduce_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {COMPUTE_DTYPES}, got {reduce_dtype!r}")
        if not 0 <= prefetch <= 2:
            raise ValueError(f"prefetch must be 0, 1 or 2 layers, got {prefetch}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("FSDP needs a torch.distributed process group; run inside lab.distributed.launch")
        self.module = module
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.prefetch = prefetch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)
        self._layers: list[_Layer] = []
        self._weights: dict[str, _ShardedWeight] = {}
        self._replicated: list[tuple[str, nn.Parameter]] = []
        self._shard_layout(module)
        for layer in self._layers:
            layer.module.register_forward_pre_hook(self._make_pre_hook(layer))
            layer.module.register_forward_hook(self._make_post_hook(layer))
        # forward bookkeeping
        self._calls: list[_Layer] = []  # layers in the order this forward ran them
        self._packed_layers: set[_Layer] = set()  # layers whose weights autograd saved (needed in backward)
        self._predicted: list[_Layer] = list(self._layers)  # order of the last forward (registration at first)
        self._live_storage: dict[int, _ShardedWeight] = {}  # storage pointer of weights in use -> weight
        # backward bookkeeping
        self._backward_order: list[_Layer] = []
        self._backward_position: dict[_Layer, int] = {}
        self._backward_started: set[_Layer] = set()
        self._pending_grads: list[tuple[_ShardedWeight, Any, torch.Tensor, torch.Tensor]] = []
        self._callback_queued = False
        self._needs_sync = False
        # memory probes: weak references to every gathered buffer, and the most alive at once
        self._gathered_refs: list[weakref.ref] = []
        self.max_live_gathered = 0
        for _, p in self._replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _p: self._mark_backward())

    # ---- construction --------------------------------------------------------------------------------

    def _shard_layout(self, module: nn.Module) -> None:
        owner: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):  # check before changing anything
            if id(p) in owner:
                raise ValueError(f"parameter {name} is the same tensor as {owner[id(p)]}: tied parameters are "
                                 "not supported by lab.FSDP")
            owner[id(p)] = name
        for mod_name, mod in module.named_modules():
            weights = []
            for attr, p in list(mod._parameters.items()):
                if p is None:
                    continue
                name = f"{mod_name}.{attr}" if mod_name else attr
                if p.ndim == 2:
                    w = _ShardedWeight(mod, attr, name, p, self.rank, self.world)
                    mod._parameters[attr] = w.shard  # module.parameters() now yields the shard
                    self._weights[name] = w
                    weights.append(w)
                else:
                    self._replicated.append((name, p))
            if weights:
                self._layers.append(_Layer(mod, mod_name, weights))

    # ---- gathering -----------------------------------------------------------------------------------

    def _gather_dtype(self, w: _ShardedWeight) -> torch.dtype:
        return self.compute_dtype or w.shard.dtype

    def _start_gather(self, layer: _Layer) -> None:
        """Launch the all-gathers of ``layer``'s weights (no-op for weights already gathered or in flight)."""
        for w in layer.weights:
            if w.pending is not None or w.gathered is not None:
                continue
            send = w.shard.detach().to(self._gather_dtype(w))  # cast before communicating
            out = torch.empty(w.padded, dtype=send.dtype, device=send.device)
            record_collective("all_gather", out)
            w.pending = (all_gather_tensor(out, send, async_op=True), out, send)
            self._gathered_refs.append(weakref.ref(out))
            live = sum(r() is not None for r in self._gathered_refs)
            self._gathered_refs = [r for r in self._gathered_refs if r() is not None]
            self.max_live_gathered = max(self.max_live_gathered, live)

    def _wait_gather(self, w: _ShardedWeight) -> torch.Tensor:
        if w.gathered is None:
            if w.pending is None:
                self._start_gather(w.layer)
            work, out, _ = w.pending
            work.wait()
            w.pending, w.gathered = None, out
        return w.gathered

    def _take_gathered(self, w: _ShardedWeight) -> torch.Tensor:
        return self._wait_gather(w)

    def live_gathered(self) -> int:
        """Number of gathered full-weight buffers still alive (anywhere: FSDP, autograd, the caller)."""
        return sum(r() is not None for r in self._gathered_refs)

    def _release(self, w: _ShardedWeight) -> None:
        w.gathered = None
        if w.pending is not None:  # a prefetch that was not used: let it finish before dropping its buffers
            w.pending[0].wait()
            w.pending = None

    # ---- forward ---------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """Run the wrapped module; 2-D weights are gathered layer by layer and dropped after use."""
        self._calls = []
        self._packed_layers = set()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                if self.compute_dtype not in (None, torch.float32):
                    device_type = next(iter(self._weights.values())).shard.device.type if self._weights else "cpu"
                    with torch.autocast(device_type=device_type, dtype=self.compute_dtype):
                        out = self.module(*args, **kwargs)
                else:
                    out = self.module(*args, **kwargs)
        finally:
            for layer in self._layers:  # prefetched for a layer that did not run
                for w in layer.weights:
                    self._release(w)
        if self._calls:
            self._predicted = list(self._calls)
            # Backward needs the weights again in reverse order, but only those autograd saved (an
            # embedding's backward, for one, needs only the indices).
            self._backward_order = [la for la in reversed(self._calls) if la in self._packed_layers]
            self._backward_position = {}
            for i, layer in enumerate(self._backward_order):
                self._backward_position.setdefault(layer, i)
            self._backward_started = set()
        return out

    def _prefetch_after(self, order: list[_Layer], position: int) -> None:
        for layer in order[position + 1:position + 1 + self.prefetch]:
            self._start_gather(layer)

    def _make_pre_hook(self, layer: _Layer):
        def pre_hook(module, args):
            self._calls.append(layer)
            self._start_gather(layer)
            pos = len(self._calls) - 1
            if pos < len(self._predicted) and self._predicted[pos] is layer:
                self._prefetch_after(self._predicted, pos)
            track = torch.is_grad_enabled()
            for w in layer.weights:
                if track and w.shard.requires_grad:
                    flat = _GatherWeight.apply(w.shard, self, w)
                else:
                    flat = self._take_gathered(w)
                full = flat[:w.numel].view(w.shape)
                module.__dict__[w.attr] = full  # shadows the shard in module._parameters during forward
                self._live_storage[full.untyped_storage().data_ptr()] = w
        return pre_hook

    def _make_post_hook(self, layer: _Layer):
        def post_hook(module, args, output):
            for w in layer.weights:
                full = module.__dict__.pop(w.attr, None)
                if full is not None:
                    self._live_storage.pop(full.untyped_storage().data_ptr(), None)
                w.gathered = None  # the only references left are autograd's, which _pack replaced by keys
        return post_hook

    def _pack(self, t: torch.Tensor):
        if self._live_storage and t.layout == torch.strided:
            w = self._live_storage.get(t.untyped_storage().data_ptr())
            if w is not None:
                self._packed_layers.add(w.layer)
                return _Packed(w, t)
        return t

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        w = packed.weight
        layer = w.layer
        if layer not in self._backward_started:
            self._backward_started.add(layer)
            self._start_gather(layer)
            pos = self._backward_position.get(layer)
            if pos is not None:
                self._prefetch_after(self._backward_order, pos)
        flat = self._wait_gather(w)
        return flat.as_strided(packed.size, packed.stride, packed.offset)

    # ---- backward --------------------------------------------------------------------------------------

    def _mark_backward(self) -> None:
        self._needs_sync = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._backward_started = set()
        self._synchronize()

    def _gradient_ready(self, w: _ShardedWeight, grad_flat: torch.Tensor) -> None:
        """The full weight's gradient exists: drop the gathered copy, start the gradient's reduce-scatter."""
        self._mark_backward()
        self._release(w)
        grad = grad_flat.to(self.reduce_dtype or w.shard.dtype).contiguous()
        if grad.numel() != w.padded:
            raise RuntimeError(f"gradient of {w.name} has {grad.numel()} elements, expected {w.padded}")
        out = torch.empty(w.shard_numel, dtype=grad.dtype, device=grad.device)
        record_collective("reduce_scatter", grad)
        work = reduce_scatter_tensor(out, grad, async_op=True)
        self._pending_grads.append((w, work, out, grad))
        # Keep at most two reduce-scatters in flight: a pending one holds its full-size gradient buffer, and
        # letting them pile up until the end of backward would hold the whole model's gradient at once.
        while len(self._pending_grads) > 2:
            self._finish_reduce_scatter(*self._pending_grads.pop(0))

    def _finish_reduce_scatter(self, w: _ShardedWeight, work, out: torch.Tensor, grad: torch.Tensor) -> None:
        work.wait()
        with torch.no_grad():
            out = out.to(w.shard.dtype)
            out.div_(self.world)
            if w.shard.grad is None:
                w.shard.grad = out
            else:
                w.shard.grad.add_(out)

    def _synchronize(self) -> None:
        if not self._needs_sync:
            return
        self._needs_sync = False
        for pending in self._pending_grads:
            self._finish_reduce_scatter(*pending)
        self._pending_grads = []
        with torch.no_grad():
            # Replicated parameters: one all-reduce of their flattened gradients (missing ones count as 0).
            params = [p for _, p in self._replicated if p.requires_grad]
            if params:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                flat = torch.cat([g.reshape(-1) for g in grads])
                record_collective("all_reduce", flat)
                dist.all_reduce(flat)
                flat.div_(self.world)
                offset = 0
                for p in params:
                    g = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
        for layer in self._layers:  # gathered for backward but never needed (e.g. a frozen branch)
            for w in layer.weights:
                self._release(w)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient collective of the last backward and average (idempotent).

        Called automatically at the end of each backward; after it, sharded weights' ``.grad`` are fp32
        shards of the averaged gradient and replicated parameters' ``.grad`` are averaged in place.
        """
        self._synchronize()

    # ---- inspection ----------------------------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module at full size and fp32: name -> tensor (a collective call)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            w = self._weights.get(name)
            if w is None:
                out[name] = p.detach().clone()
                continue
            flat = torch.empty(w.padded, dtype=w.shard.dtype, device=w.shard.device)
            all_gather_tensor(flat, w.shard.detach())
            out[name] = flat[:w.numel].view(w.shape).clone()
        return out

    def sharded_parameter_names(self) -> list[str]:
        """Names of the parameters stored as shards (the 2-D ones)."""
        return list(self._weights)

    def replicated_parameter_names(self) -> list[str]:
        """Names of the parameters kept whole on every rank (norms, biases, other non-2-D ones)."""
        return [n for n, _ in self._replicated]

    def shard_of(self, name: str) -> nn.Parameter:
        """The local shard parameter of the 2-D parameter ``name`` (flat, padded, 1/world_size of it)."""
        return self._weights[name].shard
