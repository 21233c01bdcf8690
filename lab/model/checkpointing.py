"""Activation checkpointing applied from outside the model.

The model knows nothing of it: :func:`activation_checkpointing` temporarily replaces a model's block list
(``model.blocks``, an ``nn.ModuleList``) with groups of ``k`` consecutive blocks, each group run under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. A checkpointed group keeps only its input for
the backward pass and recomputes its forward when the backward reaches it. The same block objects are
used, so parameters, optimizer state and gradients are unchanged.

Memory of N blocks, with r the size of one block's input (the residual stream) and A one block's saved
activations (A >> r, about 30 x r in this model):

* no checkpointing: N * A;
* single level, groups of k: N/k boundaries kept, plus one group's activations while it is recomputed:
  (N/k) * r + k * A, minimised at k = sqrt(N * r / A), i.e. O(sqrt N) memory for one extra forward;
* nested (:func:`nested_checkpoint_forward`): split the blocks in halves recursively and checkpoint each
  half; at any time only the boundaries on one root-to-leaf path are kept, O(log N) * r + A, for
  O(log N) extra forwards of each block (each level of the recursion recomputes part of its subtree).
  PyTorch's non-reentrant checkpoint stops a recomputation as soon as every tensor it must restore exists
  ("early stop"), so recomputing a segment runs only its first half: the second half is a checkpoint
  whose only saved tensor is its input. Over N = 2^L blocks that is N/2 for each of the L - 1 inner
  levels plus N for the leaves: (L + 1) * N / 2 extra block forwards (instead of L * N without early stop).

The memory models here are closed forms; the measured sweep (peak memory and time of a training step for
each strategy) is :func:`lab.bench.memory.checkpoint_sweep`, since ``lab.model`` does not import the
measuring code.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import pandas as pd
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lab.units import MiB


class CheckpointedGroup(nn.Module):
    """Run ``blocks`` in sequence under one non-reentrant checkpoint (only the group's input is saved)."""

    def __init__(self, blocks: Sequence[nn.Module]):
        super().__init__()
        if not blocks:
            raise ValueError("a checkpointed group needs at least one block")
        self.blocks = nn.ModuleList(blocks)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # nothing would be saved anyway
            return self._run(x)
        return checkpoint(self._run, x, use_reentrant=False)


def group_blocks(blocks: Sequence[nn.Module], group_size: int) -> nn.ModuleList:
    """``blocks`` as consecutive :class:`CheckpointedGroup` s of ``group_size`` (the last may be shorter)."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    blocks = list(blocks)
    return nn.ModuleList(CheckpointedGroup(blocks[i:i + group_size]) for i in range(0, len(blocks), group_size))


class NestedCheckpoint(nn.Module):
    """All ``blocks`` under the recursive (nested) checkpoint strategy of :func:`nested_checkpoint_forward`."""

    def __init__(self, blocks: Sequence[nn.Module], leaf_size: int = 1):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.leaf_size = leaf_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nested_checkpoint_forward(list(self.blocks), x, self.leaf_size)


def nested_checkpoint_forward(blocks: Sequence[nn.Module], x: torch.Tensor, leaf_size: int = 1) -> torch.Tensor:
    """Run ``blocks`` with nested checkpoints: split in two halves, checkpoint each half, recurse.

    During the backward of a half, its forward is recomputed, which again only keeps the boundary of its
    own two halves, and so on down to ``leaf_size`` blocks that run plainly. The live boundaries at any
    time lie on one path of the recursion tree, ceil(log2(N / leaf_size)) of them: O(log N) memory for
    O(log N) recomputations of each block. Returns the output of the last block.
    """
    if leaf_size < 1:
        raise ValueError(f"leaf_size must be at least 1, got {leaf_size}")
    blocks = list(blocks)
    if len(blocks) <= leaf_size or not torch.is_grad_enabled():
        for block in blocks:
            x = block(x)
        return x
    mid = len(blocks) // 2
    x = checkpoint(nested_checkpoint_forward, blocks[:mid], x, leaf_size, use_reentrant=False)
    return checkpoint(nested_checkpoint_forward, blocks[mid:], x, leaf_size, use_reentrant=False)


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, group_size: int | None = 1, strategy: str = "single",
                             attr: str = "blocks", leaf_size: int = 1) -> Iterator[nn.Module]:
    """Within the ``with`` block, ``model.<attr>`` (a ``ModuleList`` of blocks called in sequence) runs with
    activation checkpointing; the original list is restored on exit.

    ``strategy="single"`` checkpoints groups of ``group_size`` consecutive blocks (``group_size=None``
    disables checkpointing: the baseline); ``"nested"`` uses :func:`nested_checkpoint_forward` over all
    blocks. The model's own forward is untouched: it iterates over ``model.<attr>`` as before, now finding
    groups. Yields the model.
    """
    original = getattr(model, attr, None)
    if not isinstance(original, nn.ModuleList):
        raise TypeError(f"model.{attr} must be an nn.ModuleList of blocks, got {type(original).__name__}")
    if strategy == "single":
        replacement = original if group_size is None else group_blocks(original, group_size)
    elif strategy == "nested":
        replacement = nn.ModuleList([NestedCheckpoint(original, leaf_size)])
    else:
        raise ValueError(f"strategy must be 'single' or 'nested', got {strategy!r}")
    setattr(model, attr, replacement)
    try:
        yield model
    finally:
        setattr(model, attr, original)


def single_level_memory_model(num_blocks: int, group_size: int, boundary_bytes: float,
                              block_activation_bytes: float) -> float:
    """Modelled activation memory (bytes) of single-level checkpointing with groups of ``group_size``:
    the ``ceil(N / k)`` saved group inputs plus one group's activations while it is recomputed."""
    return math.ceil(num_blocks / group_size) * boundary_bytes + group_size * block_activation_bytes


def nested_memory_model(num_blocks: int, boundary_bytes: float, block_activation_bytes: float,
                        leaf_size: int = 1) -> float:
    """Modelled activation memory (bytes) of :func:`nested_checkpoint_forward`: the boundaries on one path
    of the recursion (two per level: the checkpoint inputs of both halves are alive while the second half
    runs) plus one leaf's activations."""
    levels = max(0, math.ceil(math.log2(max(num_blocks / leaf_size, 1))))
    return 2 * levels * boundary_bytes + leaf_size * block_activation_bytes


def best_group_size(num_blocks: int, boundary_bytes: float, block_activation_bytes: float) -> int:
    """The group size minimising :func:`single_level_memory_model` among the divisors of ``num_blocks``
    (analytically near ``sqrt(N * r / A)``)."""
    divisors = [k for k in range(1, num_blocks + 1) if num_blocks % k == 0]
    return min(divisors, key=lambda k: single_level_memory_model(num_blocks, k, boundary_bytes,
                                                                 block_activation_bytes))


def checkpoint_memory_table(num_blocks: int, boundary_bytes: float, block_activation_bytes: float) -> pd.DataFrame:
    """The memory models side by side: no checkpointing, single-level for every divisor k of N, nested.

    Returns columns ``strategy``, ``group_size``, ``modelled_bytes``, ``modelled_mib``,
    ``extra_forwards`` (recomputations of each block in the backward, averaged over blocks; for nested with
    non-reentrant early stop).
    """
    rows = [dict(strategy="none", group_size=math.nan, modelled_bytes=num_blocks * block_activation_bytes,
                 extra_forwards=0)]
    for k in (k for k in range(1, num_blocks + 1) if num_blocks % k == 0):
        rows.append(dict(strategy="single", group_size=k,
                         modelled_bytes=single_level_memory_model(num_blocks, k, boundary_bytes,
                                                                  block_activation_bytes),
                         extra_forwards=1))
    rows.append(dict(strategy="nested", group_size=math.nan,
                     modelled_bytes=nested_memory_model(num_blocks, boundary_bytes, block_activation_bytes),
                     extra_forwards=(max(0, math.ceil(math.log2(num_blocks))) + 1) / 2))
    df = pd.DataFrame(rows)
    df["modelled_mib"] = df["modelled_bytes"] / MiB
    return df


def residual_stream_bytes(batch: int, context: int, d_model: int, bytes_per_element: int = 4) -> int:
    """Bytes of one residual-stream activation (batch x context x d_model elements): the input every block
    receives, and what a checkpointed group keeps for the backward."""
    return batch * context * d_model * bytes_per_element
