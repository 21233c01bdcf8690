"""The 03 notebook's configuration: :class:`MemorySetup` holds every size and switch of the memory experiments,
resolved from a notebook's parameters, and what follows from it in closed form without building a model: the
residual stream's size at each context and the modelled memory of activation checkpointing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from lab.accounting import parameter_count
from lab.book.report import with_profile_defaults
from lab.dtypes import autocast_dtype
from lab.model import ModelConfig, config_for
from lab.model.checkpointing import checkpoint_memory_table, residual_stream_bytes
from lab.units import MiB

#: Each profile's defaults of the knobs a notebook leaves None: the 2.7B model on a GPU, the 4-block toy on a CPU.
FULL = dict(size="2.7B", timeline_context=512, peak_contexts=(128, 256, 512, 2048), checkpoint_context=2048)
QUICK = dict(size="mini", timeline_context=64, peak_contexts=(32, 64), checkpoint_context=64)


@dataclass(frozen=True)
class MemorySetup:
    """Every size and switch of the memory experiments (built by :meth:`resolve`): ``model``'s context covers
    every context used; ``dtype`` is the training dtype of the timelines, block accounting and checkpointing
    sweep; ``peak_contexts`` x ``peak_dtypes`` the peak-memory grid; ``timing_steps`` the timed steps of each
    checkpointing configuration (five: the fewest a verdict takes)."""

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
    timing_steps: int = 5

    @classmethod
    def resolve(cls, quick: bool, **knobs) -> MemorySetup:
        """``knobs`` (the fields but ``model``) with every None filled from :data:`QUICK` or :data:`FULL`; the
        block context defaults to the checkpoint context, the group sizes to no checkpointing and every
        divisor of the number of blocks."""
        profile = QUICK if quick else FULL
        k = with_profile_defaults({**dict.fromkeys(profile), **knobs}, profile)
        k = {n: v for n, v in k.items() if v is not None}
        autocast_dtype(k.get("dtype", "fp32"))
        k.setdefault("block_context", k["checkpoint_context"])
        longest = max(k["timeline_context"], k["checkpoint_context"], k["block_context"], *k["peak_contexts"])
        cfg = config_for(k["size"], context_length=longest)
        n = cfg.num_layers
        k.setdefault("checkpoint_group_sizes", (None, *(d for d in range(1, n + 1) if n % d == 0)))
        return cls(model=cfg, **k)

    def residual_bytes(self, context: int, bytes_per_element: int = 4) -> int:
        """Bytes of one residual-stream activation, batch x context x d_model (fp32 by default)."""
        return residual_stream_bytes(self.batch, context, self.model.d_model, bytes_per_element)

    @property
    def parameter_bytes(self) -> int:
        """Bytes of the fp32 parameters (from the closed form; no model is built)."""
        return 4 * parameter_count(self.model)


def residual_stream_table(setup: MemorySetup, contexts: Sequence[int] | None = None) -> pd.DataFrame:
    """The residual stream's size (batch x context x d_model, fp32) at each context of ``setup`` (or
    ``contexts``): columns ``context``, ``batch``, ``d_model``, ``num_layers``, ``residual_bytes``,
    ``residual_mib`` and ``all_block_inputs_mib`` (one per block)."""
    contexts = contexts or sorted({*setup.peak_contexts, setup.timeline_context, setup.checkpoint_context})
    df = pd.DataFrame([dict(context=c, batch=setup.batch, d_model=setup.model.d_model,
                            num_layers=setup.model.num_layers, residual_bytes=setup.residual_bytes(c))
                       for c in contexts])
    return df.assign(residual_mib=df["residual_bytes"] / MiB,
                     all_block_inputs_mib=df["residual_bytes"] / MiB * df["num_layers"])


def checkpoint_model(setup: MemorySetup, block_saved_bytes: float, block_context: int | None = None) -> pd.DataFrame:
    """:func:`lab.model.checkpointing.checkpoint_memory_table` for ``setup``'s model at its checkpoint context:
    r = one residual-stream activation, A = ``block_saved_bytes`` (what one block saves, measured at
    ``block_context``) scaled linearly to the checkpoint context. Adds the columns ``boundary_bytes`` (r),
    ``block_bytes`` (A) and ``k_star`` (the continuous optimum sqrt(N r / A))."""
    a = float(block_saved_bytes) * setup.checkpoint_context / (block_context or setup.block_context)
    r, n = setup.residual_bytes(setup.checkpoint_context), setup.model.num_layers
    return checkpoint_memory_table(n, r, a).assign(boundary_bytes=r, block_bytes=a, k_star=math.sqrt(n * r / a))
