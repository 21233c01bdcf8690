"""What notebook 08 measures: the implementations, sizes and rounds of a render (:class:`ShardingRun`), measured
by :func:`lab.bench.sharding.run_sharding_benchmark` (memory in fresh processes, step times interleaved)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from lab.bench.distributed import profile_interleaving, where_to_run
from lab.bench.interleaved import Interleaving
from lab.bench.sharding import IMPLS, expected_state_table, run_sharding_benchmark


@dataclass(frozen=True)
class ShardingRun:
    """``impls`` on each of ``sizes`` with ``world_size`` ranks of ``device`` ("cuda": NCCL; "cpu": gloo),
    ``batch`` sequences of ``context`` tokens per rank under ``dtype`` autocast; step times with ``interleaving``;
    ``profile_impl``'s step profiled. ``note`` says where it runs and why
    (:func:`lab.bench.distributed.where_to_run`)."""

    device: str
    world_size: int
    sizes: tuple[str, ...]
    impls: tuple[str, ...] = IMPLS
    context: int = 512
    batch: int = 2
    dtype: str = "bf16"
    fsdp_reduce_dtype: str | None = None
    warmup: int = 1
    interleaving: Interleaving = field(default_factory=Interleaving)
    profile_impl: str | None = "fsdp"
    note: str = ""

    def params(self) -> dict:
        """The resolved settings, for a report's provenance."""
        return dict(run_device=self.device, world_size=self.world_size, sizes=list(self.sizes),
                    impls=list(self.impls), context=self.context, batch=self.batch, dtype=self.dtype,
                    fsdp_reduce_dtype=self.fsdp_reduce_dtype, memory_warmup=self.warmup,
                    **self.interleaving.params(), profile_impl=self.profile_impl)

    def measure(self, artifacts_dir: str | None = None) -> pd.DataFrame:
        """:func:`lab.bench.sharding.run_sharding_benchmark` with these settings."""
        return run_sharding_benchmark(self.impls, self.sizes, self.world_size, self.context, self.batch,
                                      self.dtype, self.interleaving, self.warmup, self.device, artifacts_dir,
                                      self.profile_impl, fsdp_reduce_dtype=self.fsdp_reduce_dtype)

    def expected_state(self) -> pd.DataFrame:
        """The closed form of the state per rank for these sizes and implementations."""
        return expected_state_table(self.sizes, self.impls, self.world_size)


def plan_run(quick: bool, device: str = "auto", world_size: int = 2, sizes: Sequence[str] | None = None,
             impls: Sequence[str] = IMPLS, context: int | None = None, batch: int = 2, dtype: str = "bf16",
             fsdp_reduce_dtype: str | None = None, rounds: int | None = None, steps_per_round: int | None = None,
             warmup: int | None = None, schedule: str = "auto", profile_impl: str | None = "fsdp") -> ShardingRun:
    """The notebook's settings made concrete. Full profile on ``world_size`` GPUs: xl and 2.7B at context 512.
    Quick, or without enough GPUs: the tiny model at context 64 with gloo on the CPU. Rounds: the profile's
    (:func:`lab.bench.distributed.profile_interleaving`). ``None`` picks these defaults."""
    on_gpu, note = where_to_run(quick, device, world_size)
    interleaving = profile_interleaving(on_gpu, rounds, steps_per_round, warmup, schedule)
    return ShardingRun("cuda" if on_gpu else "cpu", world_size,
                       tuple(sizes or (("xl", "2.7B") if on_gpu else ("tiny",))), tuple(impls),
                       context or (512 if on_gpu else 64), batch, dtype, fsdp_reduce_dtype, interleaving.warmup,
                       interleaving, profile_impl, note)
