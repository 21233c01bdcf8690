"""The optimizer step inside the backward: each group of parameters is updated as soon as its gradients are final.

Why: a plain step runs the whole backward, holding every gradient at once (4 bytes a parameter in fp32),
and then the whole optimizer step, which the GPU runs after the backward, not during it: on a one-GPU step
whose matrix products already run at the card's ceiling, the update (memory-bound, every parameter, gradient
and moment read and written once) is the largest share left. Updating a group of parameters from the
backward the moment its gradients are complete, and freeing those gradients right after (``p.grad =
None``), does the same arithmetic, and only the gradients still waiting for their update exist at any time.
On one CUDA stream the updates only move: they are queued between the backward's kernels and the GPU runs
them one after the other, so the step takes as long as before. On CUDA the updates therefore run on a side
stream (``side_stream``), where the GPU can run them beside the rest of the backward: memory-bound
elementwise work next to compute-bound matmuls. Stream order: before each update the side stream waits for
what the compute stream has queued so far (the gradients and the parameters' last uses in the backward come
first), each gradient is marked as used on it (``record_stream``) before it is dropped, and
:meth:`OptimizerInBackward.step` makes the compute stream wait for every update, so the next forward reads
the new parameters. On the CPU the same code runs the updates in order, synchronously.

How: parameters are split into *groups* (``buckets``: one per parameter by default; :func:`block_buckets`:
one per transformer block); each group has its own inner optimizer (``torch.optim.AdamW``; ``fused=True``
when the parameters are on CUDA, which updates a group in one multi-tensor kernel; the default for-loop on
the CPU), so the host launches a bounded number of kernels per group and per step (the fused update and its
step counter), and one Python ``step`` call per group. A group is updated when all its parameters have their
gradients; an autograd-engine callback at the end of the backward updates the groups some of whose
parameters got no gradient (as a plain step skips parameters whose ``.grad`` is None). Every update is the
update a plain ``AdamW.step()`` would make: each parameter's arithmetic is independent of the others', so
results are bit for bit those of the plain step.

Where the gradients come from decides when they are final:

* alone, a parameter's gradient is final when autograd has accumulated it (a post-accumulate-grad hook);
* with :class:`lab.parallel.ddp.DDPBucketed` (``ddp=``), when the all-reduce of its bucket has finished: the
  wrapper calls back as each bucket's all-reduce starts, and once every parameter of a group is in a started
  bucket, the side stream waits for those all-reduces (:meth:`~lab.parallel.ddp.DDPBucketed.wait_for_gradients`,
  without blocking the host or the backward) and updates the group; groups default to the model's blocks;
* with :class:`lab.parallel.fsdp.FSDP` (``fsdp=``), after its layer's reduce-scatter (and, for replicated
  parameters, the all-reduce at the end of the backward): the groups are FSDP's
  :meth:`~lab.parallel.fsdp.FSDP.gradient_groups` and the updates run from its ``on_shard_grad_ready`` callbacks.

Where it cannot overlap: a model compiled as one graph (``torch.compile`` of the whole model) has one backward
node, which hands every gradient over at its end; the updates then all run after the backward's last kernel.
Compile block by block (each block's backward its own node) for the updates to run beside the backward.

Clipping by the global gradient norm (``max_grad_norm``) needs every gradient before any update: no update can
run before the backward has ended. With it, each group's gradient norms are computed on the side stream as the
group's gradients become final (that pass over the gradients runs beside the backward), the gradients are
kept, and at the end of the backward the global norm is formed from them exactly as
``torch.nn.utils.clip_grad_norm_`` forms it, and each group is scaled (one multi-tensor multiply) and updated:
the same bits as ``clip_grad_norm_`` followed by the plain step, with the updates no longer hidden. Under FSDP
(shards of the gradients) it is refused.

What else it gives up: gradient accumulation over several backwards per step outside ``DDPBucketed.no_sync``
(a second gradient for a parameter already updated since the last :meth:`OptimizerInBackward.step` raises).
The loop is the usual one: ``loss.backward(); opt.step()`` (``step`` only marks the end of the step;
``zero_grad`` has nothing left to do). Learning-rate schedules work as with any optimizer: hyperparameters set
in ``param_groups`` reach every inner optimizer before its next update. :meth:`~OptimizerInBackward.state_dict`
is in the plain optimizer's format (state by parameter index), so checkpoints move between this and a plain
``AdamW`` over the same parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lab.parallel.ddp import DDPBucketed
from lab.parallel.fsdp import FSDP
from lab.parallel.hooks import weak_hook
from lab.parallel.sharded_optimizer import check_optimizer_cls, hyperparameters

# group keys an inner optimizer keeps as built: how it computes, not what it computes
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def block_buckets(model: nn.Module) -> list[list[nn.Parameter]]:
    """One bucket per child of each ``nn.ModuleList`` of ``model`` (a transformer block: its parameters are
    final together, and one fused kernel updates them all), and one per other trainable parameter; in
    reverse registration order (the order the backward finishes them)."""
    buckets, seen = [], set()
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList):
            for child in mod:
                params = [p for p in child.parameters() if p.requires_grad and id(p) not in seen]
                seen.update(id(p) for p in params)
                if params:
                    buckets.append(params)
    buckets += [[p] for p in model.parameters() if p.requires_grad and id(p) not in seen]
    return buckets[::-1]


def gradient_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, computed as ``torch.nn.utils.clip_grad_norm_`` computes it on their device (a
    multi-tensor norm on CUDA, one norm per tensor elsewhere), so a global norm formed from them has its bits."""
    if grads and grads[0].is_cuda:
        return list(torch._foreach_norm(grads, 2.0))
    return [torch.linalg.vector_norm(g, 2.0) for g in grads]


def global_norm(norms: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients from their own ``norms`` (in the order of ``grads``), stacked in the order
    ``clip_grad_norm_`` stacks them (by device and dtype, first seen first)."""
    kinds = list(dict.fromkeys((g.device, g.dtype) for g in grads))
    ordered = [n.to(grads[0].device) for kind in kinds for n, g in zip(norms, grads) if (g.device, g.dtype) == kind]
    return torch.linalg.vector_norm(torch.stack(ordered), 2.0)


class OptimizerInBackward(torch.optim.Optimizer):
    """``optimizer_cls`` (default ``torch.optim.AdamW``) over ``params``, stepped inside the backward (see
    the module docstring).

    ``OptimizerInBackward(model.parameters(), lr=1e-3, weight_decay=0.1)``: ``params`` is one group of
    tensors; keyword arguments go to each inner optimizer. ``buckets``: lists of parameters that are updated
    together (None: one per parameter, or the blocks under ``ddp``; see :func:`block_buckets`), covering
    ``params`` exactly. ``fsdp``: the :class:`~lab.parallel.fsdp.FSDP` whose shards ``params`` are
    (``fsdp.parameters()``); updates then follow its gradient collectives and ``buckets`` must be None.
    ``ddp``: the :class:`~lab.parallel.ddp.DDPBucketed` whose module's parameters ``params`` are; updates then
    follow its all-reduces. ``side_stream``: run the updates on a CUDA side stream beside the backward (None:
    when the parameters are on CUDA; True elsewhere is an error). ``max_grad_norm``: clip by the global
    gradient norm first (the norm of the last step is then :attr:`grad_norm`).

    The gradient hooks hold the optimizer weakly (:mod:`lab.parallel.hooks`): keep a reference to it, as to
    any optimizer, or the updates stop (and gradients accumulate as without it).
    """

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 buckets: Sequence[Sequence[nn.Parameter]] | None = None, fsdp: FSDP | None = None,
                 ddp: DDPBucketed | None = None, side_stream: bool | None = None,
                 max_grad_norm: float | None = None, **kwargs):
        check_optimizer_cls(optimizer_cls)
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise ValueError("OptimizerInBackward takes one group of parameters (tensors), not parameter groups")
        if fsdp is not None and ddp is not None:
            raise ValueError("pass fsdp or ddp, not both: the gradients come from one wrapper")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        if max_grad_norm is not None and fsdp is not None:
            raise ValueError("clipping by the global norm is not supported with fsdp: each rank holds shards of "
                             "the gradients, and their norm is not formed across ranks here")
        on_cuda = bool(params) and all(isinstance(p, torch.Tensor) and p.is_cuda for p in params)
        if side_stream and not on_cuda:
            raise ValueError("side_stream runs the updates on a CUDA stream: the parameters must all be on CUDA")
        devices = {p.device for p in params} if on_cuda else set()
        if side_stream and len(devices) > 1:
            raise ValueError(f"side_stream needs the parameters on one GPU, got {sorted(map(str, devices))}")
        use_stream = on_cuda and len(devices) == 1 if side_stream is None else side_stream
        self._stream = torch.cuda.Stream(next(iter(devices))) if use_stream else None
        super().__init__(params, defaults=dict(kwargs))
        params = self.param_groups[0]["params"]
        if fsdp is not None:
            if buckets is not None:
                raise ValueError("with fsdp, the buckets are FSDP's gradient groups: pass buckets=None")
            buckets = fsdp.gradient_groups()
        elif buckets is None:
            buckets = block_buckets(ddp.module) if ddp is not None else [[p] for p in params]
        buckets = [list(b) for b in buckets if len(b)]
        bucketed = [id(p) for b in buckets for p in b]
        wanted = {id(p) for p in params if p.requires_grad}
        if len(bucketed) != len(set(bucketed)) or set(bucketed) != wanted:
            raise ValueError("buckets must hold every trainable parameter of params exactly once")
        if ddp is not None and not wanted <= {id(p) for p in ddp.trainable}:
            raise ValueError("with ddp, params must be the wrapped module's trainable parameters")
        if all(p.is_cuda for p in params) and not {"fused", "foreach"} & set(kwargs):
            kwargs = {**kwargs, "fused": True}
        self.buckets = buckets
        self.inner = [optimizer_cls(b, **kwargs) for b in buckets]
        self.max_grad_norm = max_grad_norm
        #: the global gradient norm of the last step (clipping only; a tensor, as clip_grad_norm_ returns)
        self.grad_norm: torch.Tensor | None = None
        self._ddp = ddp
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self._index = {id(p): i for i, p in enumerate(params)}
        for k, v in hyperparameters(self.inner[0].param_groups[0]).items():  # show the inner defaults
            self.param_groups[0].setdefault(k, v)
        self._ready = [0] * len(buckets)  # parameters of each bucket with a final gradient, this backward
        self._norms: dict[int, list[torch.Tensor]] = {}  # clipping: each final bucket's gradient norms
        self._updated: set[int] = set()  # parameters updated since the last step()
        self._flush_queued = False
        self._handles = []
        self._callback = None  # (the wrapper's callback list, our callback)
        if fsdp is not None:
            self._callback = (fsdp.on_shard_grad_ready, weak_hook(self._grads_final))
        elif ddp is not None:
            self._callback = (ddp.on_reduction_started, weak_hook(self._params_ready))
        else:
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(weak_hook(self._param_ready)))
        if self._callback is not None:
            self._callback[0].append(self._callback[1])

    def remove_hooks(self) -> None:
        """Stop updating in the backward (the gradient hooks or the wrapper's callback are removed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._callback is not None:
            callbacks, callback = self._callback
            callbacks.remove(callback)
            self._callback = None

    # ---- during the backward ---------------------------------------------------------------------------

    def _check_once(self, p: torch.Tensor) -> None:
        if id(p) in self._updated:
            raise RuntimeError("OptimizerInBackward updates each parameter during its backward: a second "
                               "backward before step() (gradient accumulation) is not supported")

    def _param_ready(self, p: torch.Tensor) -> None:
        self._params_ready([p])

    def _params_ready(self, params: list[torch.Tensor]) -> None:
        """These parameters' gradients are final (alone), or their reduction has started (ddp)."""
        for p in params:
            self._check_once(p)
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        for p in params:
            b = self._bucket_of.get(id(p))
            if b is None:  # a parameter of the wrapped module that this optimizer does not own
                continue
            self._ready[b] += 1
            if self._ready[b] == len(self.buckets[b]):
                self._bucket_final(b)

    def _grads_final(self, params: list[torch.Tensor]) -> None:
        for p in params:
            self._check_once(p)
        for b in dict.fromkeys(self._bucket_of[id(p)] for p in params):
            self._bucket_final(b)  # the bucket's other parameters have no gradient now: skipped

    def _flush(self) -> None:
        self._flush_queued = False
        for b, ready in enumerate(self._ready):
            if ready:
                self._bucket_final(b)
        if self._norms:
            self._clip_and_update()

    @contextlib.contextmanager
    def _beside_the_backward(self):
        """The side stream, after what the compute stream queued so far (these gradients included); or, without
        one, the current stream."""
        stream = self._stream
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            yield

    def _bucket_final(self, b: int) -> None:
        with self._beside_the_backward():
            if self._ddp is not None:  # the side stream waits for the all-reduces, not the backward
                self._ddp.wait_for_gradients(self.buckets[b])
            if self.max_grad_norm is None:
                self._update(b)
            else:  # this bucket's share of the global norm, while the gradients are at hand
                self._norms[b] = gradient_norms([p.grad for p in self.buckets[b] if p.grad is not None])
        self._ready[b] = 0

    def _clip_and_update(self) -> None:
        """Every gradient is final: the global norm, then each bucket scaled and updated (clipping)."""
        params = self.param_groups[0]["params"]
        norm_of = {id(p): n for b, norms in self._norms.items()
                   for p, n in zip([p for p in self.buckets[b] if p.grad is not None], norms)}
        grads = [p.grad for p in params if id(p) in norm_of]
        with self._beside_the_backward():
            total = global_norm([norm_of[id(p)] for p in params if id(p) in norm_of], grads)
            coefficient = torch.clamp(float(self.max_grad_norm) / (total + 1e-6), max=1.0)  # clip_grad_norm_'s
            for b in sorted(self._norms):
                torch._foreach_mul_([p.grad for p in self.buckets[b] if p.grad is not None], coefficient)
                self._update(b)
        self._norms.clear()
        self.grad_norm = total

    def _update(self, b: int) -> None:
        """Step bucket ``b``'s inner optimizer (on the current stream), then drop its gradients."""
        inner = self.inner[b]
        group = inner.param_groups[0]
        for k, v in hyperparameters(self.param_groups[0]).items():  # e.g. an LR scheduler's new lr
            if k not in _IMPLEMENTATION_KEYS:
                group[k] = v
        inner.step()
        for p in self.buckets[b]:
            if p.grad is not None:
                self._updated.add(id(p))
                if self._stream is not None:  # not reused by the allocator before the update has read it
                    p.grad.record_stream(self._stream)
                p.grad = None  # updated: the gradient is not needed any more

    def _join(self) -> None:
        """The compute stream waits for every update queued on the side stream."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    # ---- the optimizer interface -----------------------------------------------------------------------

    def step(self, closure=None):
        """Mark the end of a training step: every update already ran in the backward. Returns None."""
        if closure is not None:
            raise ValueError("OptimizerInBackward.step takes no closure: the updates ran in the backward")
        if any(self._ready) or self._norms:
            raise RuntimeError("some buckets have gradients but were not updated: call step() after the "
                               "backward has finished")
        self._join()  # the next forward reads the updated parameters
        self._updated.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: each gradient was freed after its update."""

    def state_dict(self) -> dict:
        """The plain optimizer's ``state_dict``: ``state`` by index in ``params``, one ``param_groups`` entry."""
        self._join()
        state = {}
        for inner, bucket in zip(self.inner, self.buckets):
            for p in bucket:
                if p in inner.state and inner.state[p]:
                    state[self._index[id(p)]] = dict(inner.state[p])
        group = {**hyperparameters(self.param_groups[0]), "params": list(range(len(self._index)))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict` or from a plain optimizer's over the same parameters."""
        self._join()
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self._index):
            raise ValueError(f"state_dict has {[len(g['params']) for g in groups]} parameters in its groups, "
                             f"expected one group of {len(self._index)}")
        saved = hyperparameters(groups[0])
        for k, v in saved.items():
            if k not in _IMPLEMENTATION_KEYS:
                self.param_groups[0][k] = v
        for inner, bucket in zip(self.inner, self.buckets):
            state = {j: state_dict["state"][i] for j, p in enumerate(bucket)
                     if (i := self._index[id(p)]) in state_dict["state"]}
            group = {**hyperparameters(inner.param_groups[0]), "params": list(range(len(bucket)))}
            group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS})
            inner.load_state_dict({"state": state, "param_groups": [group]})
