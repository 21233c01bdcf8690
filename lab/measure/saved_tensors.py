"""What autograd keeps for the backward pass ("residuals"), per module and per operation.

:func:`saved_tensor_report` runs a forward pass inside ``torch.autograd.graph.saved_tensors_hooks``. The
pack hook sees every tensor an operation saves for its backward, but not which operation saved it; so the
hook stores a numbered token, and after the forward the autograd graph is walked from the outputs: reading
each node's ``_saved_*`` attributes unpacks its tokens, which names the operation (the ``grad_fn`` class,
e.g. ``MmBackward0``) that saved each tensor. The module is the innermost module running when the tensor
was packed (forward pre/post hooks keep a module stack).

Bytes are counted per *storage*, not per tensor: a tensor saved by several operations (the input of the
q, k and v projections), or a view of a tensor that is saved elsewhere (a transposed weight, a reshaped
activation), costs memory once. Autograd keeps the whole storage alive, so the storage's size is what the
saved tensor costs. Parameters that are saved (the weight of a matmul) are listed but counted apart:
they exist whether or not a backward is coming, so they are not activation memory.

:func:`saved_tensor_bytes` is the same count in one number, for a function of tensors (no module to walk):
the check of the closed forms of attention's memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

from lab.units import MiB


@dataclass
class SavedTensorReport:
    """The tensors saved for backward by one forward pass.

    ``records`` has one row per saved tensor: ``order`` (packing order), ``op`` (the grad_fn that saved it),
    ``module`` (dotted name; ``""`` for the root), ``shape``, ``dtype``, ``tensor_bytes`` (numel x element
    size), ``storage_bytes`` (bytes of the underlying storage), ``storage_id``, ``is_parameter`` and
    ``counted_bytes`` (the storage bytes at the storage's first appearance among non-parameters, else 0).
    """

    records: pd.DataFrame

    @property
    def total_bytes(self) -> int:
        """Activation memory saved for backward: each non-parameter storage counted once (bytes)."""
        return int(self.records["counted_bytes"].sum())

    @property
    def parameter_bytes(self) -> int:
        """Bytes of parameters referenced by saved tensors (each parameter storage once); not extra memory."""
        p = self.records[self.records["is_parameter"]]
        return int(p.drop_duplicates("storage_id")["storage_bytes"].sum())

    def by_op(self) -> pd.DataFrame:
        """Saved activation bytes per operation (``op``), largest first, with ``share`` of the total and the
        number of tensors saved (``tensors``) and of distinct storages counted (``storages``)."""
        return self._group("op")

    def by_module(self, depth: int | None = None) -> pd.DataFrame:
        """Saved activation bytes per module; ``depth`` truncates dotted names (``blocks.0.attn`` at depth 2
        is ``blocks.0``)."""
        df = self.records.copy()
        if depth is not None:
            df["module"] = df["module"].map(lambda m: ".".join(m.split(".")[:depth]))
        return self._group("module", df)

    def _group(self, key: str, df: pd.DataFrame | None = None) -> pd.DataFrame:
        df = self.records if df is None else df
        act = df[~df["is_parameter"]]
        g = act.groupby(key, sort=False).agg(bytes=("counted_bytes", "sum"), tensors=("order", "count"),
                                              storages=("counted_bytes", lambda s: int((s > 0).sum())))
        g = g.sort_values("bytes", ascending=False).reset_index()
        total = g["bytes"].sum()
        g["share"] = g["bytes"] / total if total else 0.0
        g["mib"] = g["bytes"] / MiB
        return g[[key, "bytes", "mib", "share", "tensors", "storages"]]


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def _saved_attributes(node) -> Iterable[Any]:
    """Every value a graph node saved, read through its ``_saved_*`` attributes (which runs unpack hooks);
    Python ``autograd.Function`` nodes expose theirs as ``saved_tensors``."""
    names = [n for n in dir(node) if n.startswith("_saved_")]
    if hasattr(node, "saved_tensors"):
        names.append("saved_tensors")
    for name in names:
        try:
            yield getattr(node, name)
        except RuntimeError:  # freed buffers (backward already ran) or a custom Function with none
            continue


def saved_tensor_report(module: nn.Module, *inputs: Any, forward: Callable[..., Any] | None = None,
                        **kwargs: Any) -> SavedTensorReport:
    """Run ``module(*inputs, **kwargs)`` (or ``forward(*inputs, **kwargs)``, e.g. a compiled module or a loss
    function) with saved-tensor hooks and account for every tensor saved for backward.

    Returns a :class:`SavedTensorReport` (see its ``records`` columns). The output is discarded; parameters
    need ``requires_grad`` (or some input does) for anything to be saved.
    """
    forward = module if forward is None else forward
    counter = itertools.count()
    packed: dict[int, dict] = {}
    stack: list[str] = []
    names = {m: n for n, m in module.named_modules()}
    params = {_storage_key(p) for p in module.parameters()}

    def pack(t: torch.Tensor) -> int:
        token = next(counter)
        packed[token] = dict(tensor=t, module=stack[-1] if stack else "", op="?")
        return token

    unpacking: list[str] = []

    def unpack(token: int) -> torch.Tensor:
        rec = packed[token]
        if unpacking and rec["op"] == "?":
            rec["op"] = unpacking[-1]
        return rec["tensor"]

    def enter(name: str):
        def hook(mod, args) -> None:
            stack.append(name)
        return hook

    def leave(mod, args, out) -> None:  # must return None: a forward hook's result replaces the output
        stack.pop()

    handles = []
    for m, name in names.items():
        handles.append(m.register_forward_pre_hook(enter(name)))
        handles.append(m.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            output = forward(*inputs, **kwargs)
            # walk the graph while the hooks are still installed so that reading saved values runs unpack
            roots = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
            seen: set = set()
            todo = list(roots)
            while todo:
                node = todo.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                unpacking.append(type(node).__name__ if not hasattr(node, "name") else node.name())
                for _ in _saved_attributes(node):
                    pass
                unpacking.pop()
                todo.extend(fn for fn, _ in node.next_functions)
    finally:
        for h in handles:
            h.remove()

    rows, seen_storage = [], set()
    for order, rec in sorted(packed.items()):
        t = rec["tensor"]
        key = _storage_key(t)
        is_param = key in params or isinstance(t, nn.Parameter)
        first = key not in seen_storage
        seen_storage.add(key)
        rows.append(dict(order=order, op=rec["op"], module=rec["module"], shape=tuple(t.shape),
                         dtype=str(t.dtype).replace("torch.", ""), tensor_bytes=t.numel() * t.element_size(),
                         storage_bytes=key[3], storage_id=hash(key) & 0xFFFFFFFF, is_parameter=is_param,
                         counted_bytes=key[3] if (first and not is_param) else 0))
    del output
    columns = ["order", "op", "module", "shape", "dtype", "tensor_bytes", "storage_bytes", "storage_id",
               "is_parameter", "counted_bytes"]
    return SavedTensorReport(pd.DataFrame(rows, columns=columns))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def expected_gradient_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the gradients of ``module``'s trainable parameters (one per parameter, in the parameter's
    dtype unless ``dtype`` is given): what a backward must leave behind."""
    return sum(p.numel() * (torch.empty((), dtype=dtype or p.dtype).element_size())
               for p in module.parameters() if p.requires_grad)


def saved_tensor_bytes(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, exclude_inputs: bool = True) -> int:
    """Bytes of the distinct storages autograd saves for backward while running ``fn(*inputs)``.

    Measured with ``torch.autograd.graph.saved_tensors_hooks`` (so it works on the CPU too); a storage
    saved by several operations counts once, and by default storages of the inputs are left out (they
    exist anyway). Returns bytes.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        # Detached (same storage): returning an op's own output would tie it to its grad_fn in a cycle
        # that runs through C++ and that Python's gc cannot break, leaking the seq x seq tensor.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    if exclude_inputs:
        for t in inputs:
            if isinstance(t, torch.Tensor):
                seen.pop(t.untyped_storage().data_ptr(), None)
    return int(sum(seen.values()))
