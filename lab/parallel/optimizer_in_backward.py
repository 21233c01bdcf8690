"""The optimizer step inside the backward: each parameter is updated as soon as its gradient is final.

Why: a plain step runs the whole backward, holding every gradient at once (4 bytes a parameter in fp32),
and then the whole optimizer step, which the GPU runs after the backward, not during it. Updating a
parameter from a post-accumulate-grad hook the moment its gradient is complete, and freeing that gradient
right after (``p.grad = None``), does the same arithmetic, and only the gradients still waiting for their
update exist at any time, instead of all of them. On one CUDA stream the updates only move: they are queued
between the backward's kernels and the GPU runs them one after the other, so the step takes as long as
before (notebook 10 measured it slower). On CUDA the updates therefore run on a side stream
(``side_stream``), where the GPU can run them beside the rest of the backward: memory-bound elementwise
work next to compute-bound matmuls. The side stream waits for the compute stream at each update (the
gradients and the parameters' last uses in the backward come first), each gradient is marked as used on it
(``record_stream``) before it is dropped, and :meth:`OptimizerInBackward.step` makes the compute stream
wait for every update, so the next forward reads the new parameters.

How: parameters are split into *buckets* (one per parameter by default; :func:`block_buckets`: one per
transformer block); each bucket has its own inner optimizer (``torch.optim.AdamW``; ``fused=True`` when the
parameters are on CUDA, which updates a bucket in one kernel; the default for-loop on the CPU). A bucket is
stepped when all its parameters have their gradients; an autograd-engine callback at the end of the
backward steps the buckets some of whose parameters got no gradient (as a plain step skips parameters
whose ``.grad`` is None). Every update is the update a plain ``AdamW.step()`` would make: each parameter's
arithmetic is independent of the others', so results are bit for bit those of the plain step.

With :class:`lab.parallel.fsdp.FSDP` (``fsdp=``), a shard's gradient is final only after its layer's
reduce-scatter (and, for replicated parameters, the all-reduce at the end of the backward), so the buckets
are FSDP's :meth:`~lab.parallel.fsdp.FSDP.gradient_groups` and the updates run from its
``on_shard_grad_ready`` callbacks: right after each reduce-scatter is waited for, while later layers'
backward and collectives continue.

What it gives up: anything that needs every gradient before any update, i.e. clipping by the global
gradient norm, and gradient accumulation over several backwards per step. Accumulation is refused: a second
gradient for a parameter already updated since the last :meth:`OptimizerInBackward.step` raises. The loop
is the usual one: ``loss.backward(); opt.step()`` (``step`` only marks the end of the step; ``zero_grad``
has nothing left to do). Learning-rate schedules work as with any optimizer: hyperparameters set in
``param_groups`` (by a ``torch.optim.lr_scheduler``, or by hand) reach every inner optimizer before its
next update. :meth:`~OptimizerInBackward.state_dict` is in the plain optimizer's format (state by parameter
index), so checkpoints move between this and a plain ``AdamW`` over the same parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

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


class OptimizerInBackward(torch.optim.Optimizer):
    """``optimizer_cls`` (default ``torch.optim.AdamW``) over ``params``, stepped inside the backward (see
    the module docstring).

    ``OptimizerInBackward(model.parameters(), lr=1e-3, weight_decay=0.1)``: ``params`` is one group of
    tensors; keyword arguments go to each inner optimizer. ``buckets``: lists of parameters that are updated
    together (None: one per parameter; see :func:`block_buckets`), covering ``params`` exactly. ``fsdp``:
    the :class:`~lab.parallel.fsdp.FSDP` whose shards ``params`` are (``fsdp.parameters()``); updates then
    follow its gradient collectives and ``buckets`` must be None. ``side_stream``: run the updates on a CUDA
    side stream beside the backward (None: when the parameters are on CUDA; True elsewhere is an error).

    The gradient hooks hold the optimizer weakly (:mod:`lab.parallel.hooks`): keep a reference to it, as to
    any optimizer, or the updates stop (and gradients accumulate as without it).
    """

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 buckets: Sequence[Sequence[nn.Parameter]] | None = None, fsdp: FSDP | None = None,
                 side_stream: bool | None = None, **kwargs):
        check_optimizer_cls(optimizer_cls)
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise ValueError("OptimizerInBackward takes one group of parameters (tensors), not parameter groups")
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
            buckets = [[p] for p in params]
        buckets = [list(b) for b in buckets if len(b)]
        bucketed = [id(p) for b in buckets for p in b]
        wanted = {id(p) for p in params if p.requires_grad}
        if len(bucketed) != len(set(bucketed)) or set(bucketed) != wanted:
            raise ValueError("buckets must hold every trainable parameter of params exactly once")
        if all(p.is_cuda for p in params) and not {"fused", "foreach"} & set(kwargs):
            kwargs = {**kwargs, "fused": True}
        self.buckets = buckets
        self.inner = [optimizer_cls(b, **kwargs) for b in buckets]
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self._index = {id(p): i for i, p in enumerate(params)}
        for k, v in hyperparameters(self.inner[0].param_groups[0]).items():  # show the inner defaults
            self.param_groups[0].setdefault(k, v)
        self._ready = [0] * len(buckets)  # parameters of each bucket with a final gradient, this backward
        self._updated: set[int] = set()  # parameters updated since the last step()
        self._flush_queued = False
        self._handles = []
        if fsdp is not None:
            callback = weak_hook(self._grads_final)
            fsdp.on_shard_grad_ready.append(callback)
            self._fsdp_callback = (fsdp.on_shard_grad_ready, callback)
        else:
            self._fsdp_callback = None
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(weak_hook(self._param_ready)))

    def remove_hooks(self) -> None:
        """Stop updating in the backward (the gradient hooks or the FSDP callback are removed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._fsdp_callback is not None:
            callbacks, callback = self._fsdp_callback
            callbacks.remove(callback)
            self._fsdp_callback = None

    # ---- during the backward ---------------------------------------------------------------------------

    def _check_once(self, p: torch.Tensor) -> None:
        if id(p) in self._updated:
            raise RuntimeError("OptimizerInBackward updates each parameter during its backward: a second "
                               "backward before step() (gradient accumulation) is not supported")

    def _param_ready(self, p: torch.Tensor) -> None:
        self._check_once(p)
        if not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._step_bucket(b)

    def _grads_final(self, params: list[torch.Tensor]) -> None:
        for p in params:
            self._check_once(p)
        for b in dict.fromkeys(self._bucket_of[id(p)] for p in params):
            self._step_bucket(b)  # the bucket's other parameters have no gradient now: skipped

    def _flush(self) -> None:
        self._flush_queued = False
        for b, ready in enumerate(self._ready):
            if ready:
                self._step_bucket(b)

    def _step_bucket(self, b: int) -> None:
        inner = self.inner[b]
        group = inner.param_groups[0]
        for k, v in hyperparameters(self.param_groups[0]).items():  # e.g. an LR scheduler's new lr
            if k not in _IMPLEMENTATION_KEYS:
                group[k] = v
        stream = self._stream
        if stream is None:
            inner.step()
        else:  # beside the backward: after what the compute stream queued so far (these gradients included)
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                inner.step()
        for p in self.buckets[b]:
            if p.grad is not None:
                self._updated.add(id(p))
                if stream is not None:  # not reused by the allocator before the update has read it
                    p.grad.record_stream(stream)
                p.grad = None  # updated: the gradient is not needed any more
        self._ready[b] = 0

    def _join(self) -> None:
        """The compute stream waits for every update queued on the side stream."""
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    # ---- the optimizer interface -----------------------------------------------------------------------

    def step(self, closure=None):
        """Mark the end of a training step: every update already ran in the backward. Returns None."""
        if closure is not None:
            raise ValueError("OptimizerInBackward.step takes no closure: the updates ran in the backward")
        if any(self._ready):
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
