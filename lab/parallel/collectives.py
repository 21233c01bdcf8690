"""The collective primitives the parallel wrappers are built from, and a log of what they send.

* :func:`all_gather_tensor` and :func:`reduce_scatter_tensor`: version-independent single-tensor
  collectives (torch renamed them in 2.13);
* :class:`TrafficLog` / :func:`record_collective`: the sharding code tells the active logs which collective
  it issues on which full tensor, so tests and notebooks can check the bytes against the closed forms of
  :mod:`lab.accounting.collectives`.

How fast these collectives run is measured by :mod:`lab.bench.collectives`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lab.accounting.collectives import ring_bytes_per_rank

# torch >= 2.13 renamed the single-tensor collectives; older versions (the GPU machines) have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """All-gather ``input`` (same shape on every rank) into ``output`` (``n`` times larger, rank order).

    A thin version-independent wrapper: ``all_gather_single`` on new torch, ``all_gather_into_tensor``
    on old. Returns a work handle when ``async_op``.
    """
    return _all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Reduce ``input`` over ranks and keep this rank's ``1/n`` slice in ``output`` (version-independent)."""
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)



# --------------------------------------------------------------------------------------------------------
# communication accounting


class TrafficLog:
    """Context manager recording every collective the sharding code issues while it is active.

    ``calls`` is a list of ``(op, full_bytes)``; :meth:`bytes_per_rank` converts them with
    :func:`ring_bytes_per_rank`. Used by tests and the notebook to check :func:`optimizer_traffic`.
    """

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __enter__(self) -> TrafficLog:
        _ACTIVE_LOGS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE_LOGS.remove(self)

    def bytes_per_rank(self, world_size: int, op: str | None = None) -> float:
        """Total ring bytes sent per rank by the recorded calls (only those of ``op`` if given)."""
        return sum(ring_bytes_per_rank(o, b, world_size) for o, b in self.calls if op is None or o == op)

    def summary(self) -> dict[str, int]:
        """Full-tensor bytes per collective kind."""
        out: dict[str, int] = {}
        for o, b in self.calls:
            out[o] = out.get(o, 0) + b
        return out


_ACTIVE_LOGS: list[TrafficLog] = []


def record_collective(op: str, tensor: torch.Tensor) -> None:
    """Tell the active :class:`TrafficLog` s that ``op`` runs on ``tensor`` (the full tensor, see above)."""
    for log in _ACTIVE_LOGS:
        log.calls.append((op, tensor.numel() * tensor.element_size()))


