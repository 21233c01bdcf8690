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
* weights are communicated by *layer*: by default every child of an ``nn.ModuleList`` (a transformer
  block, seven matrices) is one layer, and a matrix outside them (embedding, LM head) is a layer of its
  own. A layer's shards are concatenated (and cast to ``compute_dtype`` on the way: the cast happens
  *before* the communication, halving it) and all-gathered in one collective; one copy kernel then splits
  the result into each weight's full matrix. One collective per layer instead of per matrix matters:
  each costs tens of microseconds of host time and a fixed latency, and a step is often host-bound;
* a forward pre-hook on each weight-owning module makes the gathered weight the module's attribute through
  :class:`GatherWeight`, an autograd function whose backward hands the gradient back to FSDP; the first
  module of a layer also starts the all-gathers of the next two layers (prefetch), so communication
  overlaps compute;
* a forward hook drops the gathered weight. Autograd would keep it alive for the backward (a matmul saves its
  weight), so during the forward a ``saved_tensors_hooks`` pair replaces saved gathered weights by a small
  key; in backward the key is unpacked by gathering the layer again (prefetching two layers ahead in
  reverse order), and each gathered copy is dropped as soon as its weight's gradient has been produced;
* once every weight of a layer has its gradient, the layer's gradients are reduce-scattered in one
  collective (rank r receives its slice of each); these are waited for (at most two stay in flight, each
  holding one layer's full gradients) and their results divided by the number of ranks and accumulated into
  the shards' ``.grad`` (fp32); at the end of backward (an autograd-engine callback) the last ones are
  finished and replicated gradients are all-reduced and averaged (:mod:`lab.parallel.fsdp_grads`).
  :meth:`FSDP.finish_gradient_synchronization` does the same explicitly and is a no-op when the callback
  already ran;
* each time some parameters' gradients become final (a layer's reduce-scatter accumulated into its shards,
  or the replicated parameters' all-reduce), the callables in ``FSDP.on_shard_grad_ready`` are called with
  those parameters: the hook point for an optimizer that updates during the backward
  (:mod:`lab.parallel.optimizer_in_backward`).

Which ranks: ``process_group`` (None: the default group) is the *shard* group, over which weights are cut,
gathered and reduce-scattered; on a 2-D mesh (data x tensor parallel) it is the data-parallel slice. With
``replicate_group`` (or a 2-D ``DeviceMesh`` with dims ("replicate", "shard")) FSDP becomes hybrid sharding,
HSDP: one sharded copy per shard group, and each shard's gradient is then all-reduced across the replicate
group, so training matches data parallelism over every rank of both.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from lab.parallel.collectives import all_gather_tensor, record_collective
from lab.parallel.fsdp_grads import GradientReducer
from lab.parallel.fsdp_layout import Layer, Packed, ShardedWeight, full_grads, full_params, shard_layout, unit_names
from lab.parallel.hooks import weak_hook
from lab.parallel.process_groups import GroupLike, broadcast_from_first, shard_and_replicate_groups

COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class GatherWeight(torch.autograd.Function):
    """Connects the gathered full weight to its shard in the autograd graph.

    Forward returns the already-gathered flat weight; backward hands its gradient to :class:`FSDP`, which
    reduce-scatters it (with the rest of its layer's) asynchronously. The shard's gradient is set by FSDP
    when the reduce-scatter is waited for, not returned here, so that the collective overlaps the rest of
    the backward.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, fsdp: FSDP, weight: ShardedWeight) -> torch.Tensor:
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
    ``unit_modules``: the modules whose 2-D weights are gathered and reduced together as one *layer*
    (None: every child of an ``nn.ModuleList``, i.e. each transformer block; a weight outside them, such as
    the embedding, is a layer on its own; an empty list: every weight-owning module is its own layer).

    ``process_group``: the shard group (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None for the default
    group); ``replicate_group``: for HSDP, the ranks holding the same shard (see the module docstring).
    ``process_group`` may instead be a 2-D ``DeviceMesh`` with dims ("replicate", "shard") (unnamed: dim 0
    replicates, dim 1 shards).

    ``rank`` and ``world`` are this rank's position in, and the size of, the shard group.

    Every rank starts from the parameters and buffers of the shard group's first rank, and under HSDP those
    of the replicate group's first rank (broadcast at construction: with groups cut from one rank grid, as a
    mesh's are, every rank ends with the grid's first rank's values). Build the optimizer
    over ``fsdp.parameters()`` *after* wrapping: it sees the local shards and replicated small parameters.
    Forward and backward are collective calls (all ranks, same model, same order of layers). Tied 2-D
    parameters (one matrix used by two modules) and modules that read another module's weight are not
    supported. With ``compute_dtype=None`` under an outer autocast the cast weight copies are saved by
    autograd outside FSDP's control; pass ``compute_dtype`` instead.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, prefetch: int = 2, unit_modules=None,
                 process_group: GroupLike = None, replicate_group: GroupLike = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
        if reduce_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {COMPUTE_DTYPES}, got {reduce_dtype!r}")
        if not 0 <= prefetch <= 2:
            raise ValueError(f"prefetch must be 0, 1 or 2 layers, got {prefetch}")
        self.shard_group, self.replicate_group = shard_and_replicate_groups(process_group, replicate_group, "FSDP")
        self.module = module
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.prefetch = prefetch
        self.rank, self.world = dist.get_rank(self.shard_group), dist.get_world_size(self.shard_group)
        state = list(module.parameters()) + list(module.buffers())
        broadcast_from_first(state, self.shard_group)
        if self.replicate_group is not None:
            broadcast_from_first(state, self.replicate_group)
        self._reducer = GradientReducer(self.shard_group, self.replicate_group, reduce_dtype)
        #: callables ``f(params)`` run when ``params``' ``.grad`` became final for this backward (see above)
        self.on_shard_grad_ready = self._reducer.on_grad_ready
        self._layers: list[Layer] = []
        self._weights: dict[str, ShardedWeight] = {}
        self._replicated: list[tuple[str, nn.Parameter]] = []
        owners = self._shard_layout(module, unit_names(module, unit_modules))
        # each parameter's name now: wrappers added around the blocks later do not rename them in gather_full_*
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._hook_handles: list = []
        for mod, weights in owners:
            self._hook_handles += [mod.register_forward_pre_hook(self._make_pre_hook(weights)),
                                   mod.register_forward_hook(self._make_post_hook(weights))]
        # forward bookkeeping
        self._in_forward = False
        self._recompute_order: list[Layer] = []  # reverse forward order: what a checkpointed backward recomputes
        self._calls: list[Layer] = []  # layers in the order this forward first entered them
        self._entered: set[Layer] = set()
        self._packed_layers: set[Layer] = set()  # layers whose weights autograd saved (needed in backward)
        self._predicted: list[Layer] = list(self._layers)  # order of the last forward (registration at first)
        # storage pointer of gathered weights in use -> (weight, the full tensor). Holding the tensor keeps
        # its memory from being reused while the entry exists, so an activation can never be taken for a
        # weight, even when a module's post-hook never ran (a recomputation stopped early).
        self._live_storage: dict[int, tuple[ShardedWeight, torch.Tensor]] = {}
        # backward bookkeeping
        self._backward_order: list[Layer] = []
        self._backward_position: dict[Layer, int] = {}
        self._backward_started: set[Layer] = set()
        self._callback_queued = False
        self._needs_sync = False
        # memory probes: weak references to every gathered full weight (with its layer), and the most layers
        # with a gathered weight alive at once
        self._gathered_refs: list[tuple[Layer, weakref.ref]] = []
        self.max_live_gathered = 0
        for _, p in self._replicated:  # weakly held: see lab.parallel.hooks
            if p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(weak_hook(self._mark_backward)))

    def remove_hooks(self) -> None:
        """Remove this wrapper's module and gradient hooks: the module computes with its shards again (no
        gathering), and nothing outside Python keeps the wrapper alive."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # ---- construction --------------------------------------------------------------------------------

    def _shard_layout(self, module: nn.Module, unit_names: list[str]):
        """Shard every 2-D parameter, group the shards into layers; returns [(owner module, its weights)]."""
        self._layers, owners = shard_layout(module, unit_names, self.rank, self.world, self._weights,
                                            self._replicated)
        return owners

    # ---- gathering -----------------------------------------------------------------------------------

    def _gather_dtype(self, layer: Layer) -> torch.dtype:
        return self.compute_dtype or layer.weights[0].shard.dtype

    def _start_gather(self, layer: Layer) -> None:
        """Launch the all-gather of ``layer``'s weights (no-op if in flight or every weight is gathered)."""
        if layer.pending is not None or all(w.gathered is not None for w in layer.weights):
            return
        dtype = self._gather_dtype(layer)
        shards = [w.shard.detach() for w in layer.weights]
        if len(shards) == 1:
            send = shards[0].to(dtype)  # cast before communicating
        else:
            send = torch.empty(layer.shard_numel, dtype=dtype, device=shards[0].device)
            torch.cat(shards, out=send)  # this rank's slice of every weight, cast on the way
        out = torch.empty(self.world * layer.shard_numel, dtype=dtype, device=send.device)
        record_collective("all_gather", out)
        layer.pending = (all_gather_tensor(out, send, group=self.shard_group, async_op=True), out, send)

    def _complete_gather(self, layer: Layer) -> None:
        """Wait for ``layer``'s all-gather and unpack it into one padded flat buffer per weight."""
        work, out, _ = layer.pending
        layer.pending = None
        work.wait()
        if len(layer.weights) == 1:  # rank-major order is already the weight's flat layout
            # A new tensor on the same memory: the finished collective may still hold ``out`` for a moment
            # (its worker thread lets go of it after wait() returns), which the liveness probe must not count.
            bufs = [out.detach()]
        else:  # out is (rank, concatenated slices): one copy per weight. split_with_sizes_copy's pointer table goes
            # host-to-device on the compute stream, behind any large copy back in flight (offloaded activations)
            bufs = [torch.empty(w.padded, dtype=out.dtype, device=out.device) for w in layer.weights]
            for b, src in zip(bufs, out.view(self.world, layer.shard_numel).split(layer.sizes, dim=1)):
                b.view(self.world, -1).copy_(src)
        for w, b in zip(layer.weights, bufs):
            if w.gathered is None:
                w.gathered = b
                self._gathered_refs.append((layer, weakref.ref(b)))
        self._gathered_refs = [(la, r) for la, r in self._gathered_refs if r() is not None]
        self.max_live_gathered = max(self.max_live_gathered, len({la for la, _ in self._gathered_refs}))

    def _wait_gather(self, w: ShardedWeight) -> torch.Tensor:
        if w.gathered is None:
            if w.layer.pending is None:
                self._start_gather(w.layer)
            self._complete_gather(w.layer)
        return w.gathered

    def _prefetch_after(self, order: list[Layer], position: int) -> None:
        for layer in order[position + 1:position + 1 + self.prefetch]:
            self._start_gather(layer)

    def _take_gathered(self, w: ShardedWeight) -> torch.Tensor:
        return self._wait_gather(w)

    def live_gathered(self) -> int:
        """Number of gathered full-weight buffers still alive (anywhere: FSDP, autograd, the caller)."""
        return sum(r() is not None for _, r in self._gathered_refs)

    def _release_layer(self, layer: Layer) -> None:
        if layer.pending is not None:  # a prefetch that was not used: let it finish before dropping its buffers
            layer.pending[0].wait()
            layer.pending = None
        for w in layer.weights:
            w.gathered = None

    # ---- forward ---------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        """Run the wrapped module; 2-D weights are gathered layer by layer and dropped after use."""
        self._calls = []
        self._entered = set()
        self._packed_layers = set()
        self._release_live_weights()
        self._in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                if self.compute_dtype not in (None, torch.float32):
                    device_type = next(iter(self._weights.values())).shard.device.type if self._weights else "cpu"
                    with torch.autocast(device_type=device_type, dtype=self.compute_dtype):
                        out = self.module(*args, **kwargs)
                else:
                    out = self.module(*args, **kwargs)
        finally:
            self._in_forward = False
            for layer in self._layers:  # prefetched for a layer that did not run
                self._release_layer(layer)
        if self._calls:
            self._predicted = list(self._calls)
            # Backward needs the weights again in reverse order, but only those autograd saved (an
            # embedding's backward, for one, needs only the indices).
            self._backward_order = [la for la in reversed(self._calls) if la in self._packed_layers]
            self._backward_position = {}
            for i, layer in enumerate(self._backward_order):
                self._backward_position.setdefault(layer, i)
            self._backward_started = set()
            self._recompute_order = list(reversed(self._calls))
        return out

    def _enter(self, layer: Layer) -> None:
        """First use of ``layer`` in this forward: gather it and prefetch the next ones."""
        self._entered.add(layer)
        self._calls.append(layer)
        self._start_gather(layer)
        pos = len(self._calls) - 1
        if pos < len(self._predicted) and self._predicted[pos] is layer:
            self._prefetch_after(self._predicted, pos)

    def _gather_for(self, weights: list[ShardedWeight]) -> None:
        """Have every weight of ``weights`` gathered (and the next layers prefetched) before a module runs."""
        layers = list(dict.fromkeys(w.layer for w in weights))
        for layer in layers:
            if self._in_forward:
                if layer not in self._entered:
                    self._enter(layer)
            elif layer in self._recompute_order:
                # activation checkpointing recomputes this module during backward: prefetch the ones before it
                self._prefetch_after(self._recompute_order, self._recompute_order.index(layer))
        for w in weights:
            self._wait_gather(w)

    def _make_pre_hook(self, weights: list[ShardedWeight]):
        def pre_hook(module, args):
            # Gathers are FSDP's business, not the module's computation: they run outside any dispatch mode
            # (selective activation checkpointing replays a region's ops one for one in the recomputation,
            # and the prefetching pattern differs between the forward and the recomputation).
            with _disable_current_modes():
                self._gather_for(weights)
            # Only the forward's uses send gradients back: a recomputation's graph is thrown away once its
            # saved tensors are taken, so counting its uses would wait for gradients that never come.
            track = torch.is_grad_enabled() and self._in_forward
            for w in weights:
                if track and w.shard.requires_grad:
                    flat = GatherWeight.apply(w.shard, self, w)
                    w.layer.expected += 1  # this use will send a gradient back
                else:
                    with _disable_current_modes():
                        flat = self._take_gathered(w)
                        if torch.is_grad_enabled() and w.shard.requires_grad:
                            # a recomputation: autograd must save what the forward saved, where the weight
                            # required grad (a matmul then also saves its input); this graph is thrown away
                            flat = flat.detach().requires_grad_()
                full = flat[:w.numel].view(w.shape)
                module.__dict__[w.attr] = full  # shadows the shard in module._parameters during forward
                self._live_storage[full.untyped_storage().data_ptr()] = (w, full)
        return pre_hook

    def _make_post_hook(self, weights: list[ShardedWeight]):
        def post_hook(module, args, output):
            for w in weights:
                full = module.__dict__.pop(w.attr, None)
                if full is not None:
                    self._live_storage.pop(full.untyped_storage().data_ptr(), None)
                w.gathered = None  # the only references left are autograd's, which _pack replaced by keys
        return post_hook

    def _release_live_weights(self) -> None:
        """Undo what a pre-hook did for modules whose post-hook never ran (a recomputation that stopped
        early): the full weight no longer shadows the shard, and its storage leaves the table."""
        for w, full in self._live_storage.values():
            if w.module.__dict__.get(w.attr) is full:
                del w.module.__dict__[w.attr]
        self._live_storage.clear()

    def saved_tensor_hooks(self) -> tuple:
        """FSDP's (pack, unpack) pair, for inner saved-tensor hooks that must let FSDP see each saved tensor
        first (autograd calls only the innermost pair): ``lab.model.offload``'s ``delegate``."""
        return self._pack, self._unpack

    def _pack(self, t: torch.Tensor):
        if self._live_storage and t.layout == torch.strided:
            entry = self._live_storage.get(t.untyped_storage().data_ptr())
            if entry is not None:
                w = entry[0]
                self._packed_layers.add(w.layer)
                return Packed(w, t)
        return t

    def _unpack(self, packed):
        if not isinstance(packed, Packed):
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

    def _mark_backward(self, *_param) -> None:  # also a replicated parameter's gradient hook
        self._needs_sync = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._backward_started = set()
        self._release_live_weights()
        self._synchronize()

    def _gradient_ready(self, w: ShardedWeight, grad_flat: torch.Tensor) -> None:
        """A full weight's gradient exists: drop the gathered copy; once every weight of its layer has its
        gradient, start the layer's reduce-scatter."""
        self._mark_backward()
        w.gathered = None
        grad = grad_flat.to(self._reducer.grad_dtype(w))
        if grad.numel() != w.padded:
            raise RuntimeError(f"gradient of {w.name} has {grad.numel()} elements, expected {w.padded}")
        layer = w.layer
        previous = layer.grads.get(w.index)
        layer.grads[w.index] = grad if previous is None else previous + grad  # a weight used twice
        layer.received += 1
        if layer.received >= layer.expected:
            self._reducer.reduce_layer(layer)

    def _synchronize(self) -> None:
        if not self._needs_sync:
            return
        self._needs_sync = False
        for layer in self._layers:  # gradients still owed by a layer whose other weights got none (or were unused)
            if layer.grads:
                self._reducer.reduce_layer(layer)
            layer.expected = layer.received = 0
        self._reducer.finish()
        # Replicated parameters: one all-reduce (per group) of their flattened gradients.
        self._reducer.reduce_replicated([p for _, p in self._replicated if p.requires_grad])
        for layer in self._layers:  # gathered for backward but never needed (e.g. a frozen branch)
            self._release_layer(layer)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient collective of the last backward and average (idempotent).

        Called automatically at the end of each backward; after it, sharded weights' ``.grad`` are fp32
        shards of the averaged gradient and replicated parameters' ``.grad`` are averaged in place.
        """
        self._synchronize()

    # ---- inspection ----------------------------------------------------------------------------------

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module at full size and fp32: name -> tensor (a collective call)."""
        return full_params(self.module, self._weights, self.shard_group, self._names)

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient at full size: name -> tensor (None where there is none; a
        collective call). For checking against a single-process step."""
        return full_grads(self.module, self._weights, self.shard_group, self._names)

    def gradient_groups(self) -> list[list[nn.Parameter]]:
        """The trainable parameters whose gradients become final together: each layer's shards (one
        reduce-scatter), then the replicated parameters (one all-reduce); empty groups left out."""
        groups = [[w.shard for w in layer.weights if w.shard.requires_grad] for layer in self._layers]
        groups.append([p for _, p in self._replicated if p.requires_grad])
        return [g for g in groups if g]

    def sharded_parameter_names(self) -> list[str]:
        """Names of the parameters stored as shards (the 2-D ones)."""
        return list(self._weights)

    def replicated_parameter_names(self) -> list[str]:
        """Names of the parameters kept whole on every rank (norms, biases, other non-2-D ones)."""
        return [n for n, _ in self._replicated]
