"""The 03 notebook's configuration: :class:`MemorySetup` holds every size and switch of the memory
experiments, resolved from a notebook's parameters, and what follows from it in closed form without building
a model: the residual stream's size at each context and the modelled memory of activation checkpointing.
The measurements themselves are :mod:`lab.book.memory.bench`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from lab.accounting import parameter_count
from lab.dtypes import autocast_dtype
from lab.model import ModelConfig, config_for
from lab.model.checkpointing import checkpoint_memory_table, residual_stream_bytes
from lab.units import MiB


@dataclass(frozen=True)
class MemorySetup:
    """Every size and switch of the memory experiments, with the defaults of the full (GPU) profile.

    ``model`` is the model's configuration (its ``context_length`` covers every context used);
    ``dtype`` the training dtype of the timelines, block accounting and checkpointing sweep;
    ``peak_contexts`` x ``peak_dtypes`` the grid of the peak-memory table. Build it with :meth:`resolve`.
    """

    size: str
    model: ModelConfig
    batch: int = 4
    dtype: str = "fp32"
    timeline_context: int = 512
    peak_contexts: tuple[int, ...] = (128, 256, 512, 2048)
    peak_dtypes: tuple[str, ...] = ("fp32", "bf16")
    block_context: int = 2048
    checkpoint_context: int = 2048
    checkpoint_group_sizes: tuple[int | None, ...] = (None, 1, 2, 4, 8, 16, 32)
    compile_rmsnorm: bool = True
    max_entries: int = 1_000_000
    timing_steps: int = 2

    @classmethod
    def resolve(cls, quick: bool, size: str | None = None, batch: int = 4, dtype: str = "fp32",
                timeline_context: int | None = None, peak_contexts: Sequence[int] | None = None,
                peak_dtypes: Sequence[str] = ("fp32", "bf16"), block_context: int | None = None,
                checkpoint_context: int | None = None, checkpoint_group_sizes: Sequence[int | None] | None = None,
                compile_rmsnorm: bool = True, max_entries: int = 1_000_000, timing_steps: int = 2) -> MemorySetup:
        """Fill every ``None`` with the profile's default: the 2.7B model at contexts 512 (timelines), 128, 256,
        512 and 2048 (peaks) and 2048 (blocks, checkpointing) in full; the ``mini`` toy model (4 blocks) at
        64, (32, 64) and 64 with ``quick``. Checkpoint group sizes default to no checkpointing and every
        divisor of the number of blocks."""
        autocast_dtype(dtype)
        size = size or ("mini" if quick else "2.7B")
        timeline_context = timeline_context or (64 if quick else 512)
        peak_contexts = tuple(peak_contexts or ((32, 64) if quick else (128, 256, 512, 2048)))
        checkpoint_context = checkpoint_context or (64 if quick else 2048)
        block_context = block_context or checkpoint_context
        longest = max(timeline_context, checkpoint_context, block_context, *peak_contexts)
        cfg = config_for(size, context_length=longest)
        if checkpoint_group_sizes is None:
            checkpoint_group_sizes = [None] + [k for k in range(1, cfg.num_layers + 1) if cfg.num_layers % k == 0]
        return cls(size=size, model=cfg, batch=batch, dtype=dtype, timeline_context=timeline_context,
                   peak_contexts=peak_contexts, peak_dtypes=tuple(peak_dtypes), block_context=block_context,
                   checkpoint_context=checkpoint_context, checkpoint_group_sizes=tuple(checkpoint_group_sizes),
                   compile_rmsnorm=compile_rmsnorm, max_entries=max_entries, timing_steps=timing_steps)

    def params(self) -> dict:
        """The resolved knobs as plain values, for a chapter's provenance."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
        out.update(d_model=self.model.d_model, d_ff=self.model.d_ff, num_layers=self.model.num_layers,
                   num_heads=self.model.num_heads, vocab_size=self.model.vocab_size)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def residual_bytes(self, context: int, bytes_per_element: int = 4) -> int:
        """Bytes of one residual-stream activation, batch x context x d_model (fp32 by default)."""
        return residual_stream_bytes(self.batch, context, self.model.d_model, bytes_per_element)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of the fp32 parameters (from the closed form; no model is built)."""
        return 4 * parameter_count(self.model)

    @property
    def embedding_bytes(self) -> int:
        """Bytes of the fp32 embedding table (and so of its gradient)."""
        return 4 * self.model.vocab_size * self.model.d_model


def residual_stream_table(setup: MemorySetup, contexts: Sequence[int] | None = None) -> pd.DataFrame:
    """The residual stream's size (batch x context x d_model, fp32) at each context of ``setup`` (or
    ``contexts``): columns ``context``, ``batch``, ``d_model``, ``num_layers``, ``residual_bytes``,
    ``residual_mib`` and ``all_block_inputs_mib`` (one per block)."""
    contexts = contexts or sorted({*setup.peak_contexts, setup.timeline_context, setup.checkpoint_context})
    rows = [dict(context=c, batch=setup.batch, d_model=setup.model.d_model, num_layers=setup.model.num_layers,
                 residual_bytes=setup.residual_bytes(c)) for c in contexts]
    df = pd.DataFrame(rows)
    df["residual_mib"] = df["residual_bytes"] / MiB
    df["all_block_inputs_mib"] = df["residual_mib"] * df["num_layers"]
    return df


def checkpoint_model(setup: MemorySetup, block_saved_bytes: float, block_context: int | None = None) -> pd.DataFrame:
    """:func:`lab.model.checkpointing.checkpoint_memory_table` for ``setup``'s model at its checkpoint context:
    r = one residual-stream activation, A = ``block_saved_bytes`` (what one block saves, measured at
    ``block_context``) scaled linearly to the checkpoint context. Adds the columns ``boundary_bytes`` (r),
    ``block_bytes`` (A) and ``k_star`` (the continuous optimum sqrt(N r / A))."""
    scale = setup.checkpoint_context / (block_context or setup.block_context)
    a = float(block_saved_bytes) * scale
    r = setup.residual_bytes(setup.checkpoint_context)
    n = setup.model.num_layers
    table = checkpoint_memory_table(n, r, a)
    return table.assign(boundary_bytes=r, block_bytes=a, k_star=math.sqrt(n * r / a))
