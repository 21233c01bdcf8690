"""What notebook 07 measures: the models, bucket sizes and rounds of a render (:class:`DDPRun`), each model
timed by :func:`lab.bench.ddp.benchmark_ddp` (every wrapper, torch DDP and one device, interleaved)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from lab.bench import overlap
from lab.bench.ddp import benchmark_ddp
from lab.bench.distributed import profile_interleaving, where_to_run
from lab.bench.interleaved import Interleaving
from lab.measure.machine import busy_host, half_the_cores


@dataclass(frozen=True)
class DDPRun:
    """Each of ``configs`` (dicts of size, dtype, batch per rank, context) on ``world_size`` ranks of ``device``
    ("cuda": NCCL; "cpu": gloo), bucketed at ``bucket_sizes_mb``, timed with ``interleaving``; ``note`` says
    where it runs and why (:func:`lab.bench.distributed.where_to_run`)."""

    device: str
    world_size: int
    configs: tuple[dict, ...]
    bucket_sizes_mb: tuple[float, ...]
    interleaving: Interleaving = field(default_factory=Interleaving)
    profile_steps: int = 1
    note: str = ""
    #: the step that hides more (:meth:`hide_more`): size, context, batch, compile, loss_steps, busy, and on the
    #: CPU rounds (the rule's fewest: its toy step shows the code path, not a GPU's verdict)
    hide: dict = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def params(self) -> dict:
        """The resolved settings, for a report's provenance."""
        return dict(run_device=self.device, world_size=self.world_size, configs=list(self.configs),
                    bucket_sizes_mb=list(self.bucket_sizes_mb), **self.interleaving.params(),
                    profile_steps=self.profile_steps, hide=self.hide)

    def measure(self, artifacts_dir: str = "artifacts") -> pd.DataFrame:
        """:func:`lab.bench.ddp.benchmark_ddp` for every config, one table with a ``config`` column ("xl fp32")."""
        tables = []
        for c in self.configs:
            df = benchmark_ddp(c["size"], context=c["context"], batch=c["batch"], dtype=c["dtype"],
                               world_size=self.world_size, device=self.device, bucket_sizes_mb=self.bucket_sizes_mb,
                               interleaving=self.interleaving, profile_steps=self.profile_steps,
                               artifacts_dir=artifacts_dir)
            tables.append(df.assign(config=f"{c['size']} {c['dtype']}"))
        return pd.concat(tables, ignore_index=True)

    def hide_more(self, bucket_mb: float, busy: int = 0,
                  artifacts_dir: str = "artifacts") -> pd.DataFrame:
        """:mod:`lab.bench.overlap`'s ``ddp`` part on this run's ranks and rounds at ``bucket_mb``: one device,
        torch DDP with and without bf16 communication, ours in both bucket orders, with bf16 communication and
        with the optimizer inside the backward, each timed against the entry one choice away (``hide``'s model;
        on a GPU each block compiled, so that the kernels rather than the launches set the pace); the rows
        (``busy_host``: ``busy``, the processes that kept host cores busy meanwhile), with each entry's loss
        curve as a JSON list (``loss_curve``). With the host busy only the rounds are timed: the loss curves and
        the profiled step, which the host's load does not change, are the quiet run's (and would double its
        time)."""
        h = self.hide
        with busy_host(busy):
            rounds = dataclasses.replace(self.interleaving, rounds=h.get("rounds", self.interleaving.rounds))
            table, losses = overlap.measure("ddp", h["size"], h["context"], h["batch"], self.world_size, self.device,
                                            rounds, bucket_mb, 0 if busy else h["loss_steps"], profile=not busy,
                                            artifacts_dir=artifacts_dir,
                                            plan=overlap.plan_for("ddp", bucket_mb, h["compile"]))
        curves = {e: json.dumps([float(x) for x in g.sort_values("step")["loss"]]) for e, g in losses.groupby("entry")}
        return table.assign(busy_host=busy, loss_curve=[curves.get(e, "[]") for e in table["entry"]])


def plan_run(quick: bool, device: str = "auto", world_size: int = 2, configs: Sequence[dict] | None = None,
             bucket_sizes_mb: Sequence[float] | None = None, rounds: int | None = None,
             steps_per_round: int | None = None, warmup: int | None = None, schedule: str = "auto") -> DDPRun:
    """The notebook's settings made concrete. Full profile on ``world_size`` GPUs: xl in fp32 and 2.7B in
    bf16 (batch 2 per rank, context 512), buckets of 1, 10, 100 and 1000 MiB. Quick, or without enough GPUs: a
    tiny model with gloo on the CPU, buckets of 0.1, 1 and 10 MiB. Rounds: the profile's
    (:func:`lab.bench.distributed.profile_interleaving`). ``None`` picks these defaults."""
    on_gpu, note = where_to_run(quick, device, world_size)
    configs = configs or ([dict(size="xl", dtype="fp32", batch=2, context=512),
                           dict(size="2.7B", dtype="bf16", batch=2, context=512)] if on_gpu else
                          [dict(size="tiny", dtype="fp32", batch=2, context=32)])
    buckets = bucket_sizes_mb or ((1, 10, 100, 1000) if on_gpu else (0.1, 1, 10))
    # the goal's step; on a GPU half the host's cores kept busy for the second timing (none on the CPU, whose
    # ranks are the host)
    hide = (dict(size="2.7B", context=512, batch=2, compile="block", loss_steps=10, busy=half_the_cores())
            if on_gpu else dict(size="tiny", context=16, batch=2, compile="none", loss_steps=3, busy=0, rounds=5))
    return DDPRun("cuda" if on_gpu else "cpu", world_size, tuple(dict(c) for c in configs),
                  tuple(float(b) for b in buckets), profile_interleaving(on_gpu, rounds, steps_per_round, warmup,
                                                                         schedule), note=note, hide=hide)
