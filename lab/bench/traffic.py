"""Communication volume of one training step of each sharding schedule (DDP, the sharded optimizer, ZeRO-1,
FSDP), counted from the collectives the code issues (:class:`lab.parallel.collectives.TrafficLog`) and set
beside the closed forms (:func:`lab.parallel.sharded_optimizer.optimizer_traffic`). Both are byte counts that
depend on the model and the number of ranks, not on the machine: the counting runs a tiny model on CPU
processes with gloo wherever the rest of a benchmark runs.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.distributed as dist

from lab.accounting import parameter_count
from lab.bench.distributed import model_config
from lab.bench.sharding import LR
from lab.measure.step import lm_loss, random_batch
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel import runner
from lab.parallel.fsdp import FSDP
from lab.parallel.sharded_optimizer import ShardedOptimizer, TrafficLog, optimizer_traffic, record_collective
from lab.parallel.zero1 import ZeRO1Optimizer
from lab.units import GiB


def _average_gradients(model: torch.nn.Module) -> None:
    """DDP's gradient synchronization, unbucketed: all-reduce (sum) every gradient, divide by the world size."""
    for p in model.parameters():
        if p.grad is not None:
            record_collective("all_reduce", p.grad)
            dist.all_reduce(p.grad)
            p.grad.div_(distributed.world_size())


IMPLS = ("ddp", "sharded_optimizer", "zero1", "fsdp")


def traffic_row(impl: str, cfg: ModelConfig, batch: int = 2) -> dict:
    """Inside a launched process: one training step of ``impl`` (one of :data:`IMPLS`; ddp all-reduces every
    gradient, fsdp in fp32) under a :class:`TrafficLog`. Returns ``impl``, ``collectives`` (``{collective:
    ring bytes per rank}``), ``num_params`` and ``status``."""
    device, n = distributed.device(), distributed.world_size()
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    if impl == "ddp":
        runnable, opt = model, torch.optim.AdamW(model.parameters(), lr=LR)
    elif impl == "sharded_optimizer":
        runnable, opt = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    elif impl == "zero1":
        runnable, opt = model, ZeRO1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    elif impl == "fsdp":
        runnable = FSDP(model)
        opt = torch.optim.AdamW(runnable.parameters(), lr=LR)
    else:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    with TrafficLog() as log:
        lm_loss(runnable, tokens, targets).backward()
        if impl in ("ddp", "sharded_optimizer"):
            _average_gradients(model)
        opt.step()
    return dict(impl=impl, collectives={op: log.bytes_per_rank(n, op) for op in log.summary()},
                num_params=model.num_parameters(), status="ok", error="")


def measure_traffic(size: str | ModelConfig = "tiny", world_size: int = 2, context: int = 64,
                    device: str = "cpu") -> pd.DataFrame:
    """Bytes per rank of one step of each schedule, recorded from the collectives the code issues, next to
    :func:`lab.parallel.sharded_optimizer.optimizer_traffic`'s closed form (fp32 gradients and parameters).

    Columns: impl, collective, measured_bytes, expected_bytes (NaN for FSDP, which has no row in the
    optimizer closed form), measured_ratio_to_ddp, status and error. Each schedule is an item of
    :func:`lab.parallel.runner.run`: one that fails on a rank is one row (status ``failed`` or ``oom``, NaN
    bytes) and the others are measured in new processes.
    """
    _, cfg = model_config(size, context)
    per_impl = runner.run(runner.each_item, IMPLS, world_size,
                          lambda todo, progress: (traffic_row, todo, progress, cfg),
                          blank=lambda impl, status, error: dict(impl=impl, status=status, error=error),
                          skip_failed=True, device=device)
    results = [ranks[0] for ranks in per_impl]  # rank 0's log: every rank issues the same collectives
    num_params = next((r["num_params"] for r in results if r["status"] == "ok"), parameter_count(cfg))
    closed = optimizer_traffic(num_params, world_size).set_index("impl")
    rows = []
    for impl, res in zip(IMPLS, results):
        if res["status"] != "ok":
            rows.append(dict(impl=impl, collective="", measured_bytes=math.nan, expected_bytes=math.nan,
                             status=res["status"], error=res["error"]))
            continue
        for op, measured in res["collectives"].items():
            expected = math.nan
            if impl in closed.index:
                c = closed.loc[impl]
                expected = c["gradient_bytes"] if op == c["gradient_collective"] else \
                    c["parameter_bytes"] if op == c["parameter_collective"] else math.nan
            rows.append(dict(impl=impl, collective=op, measured_bytes=measured, expected_bytes=expected,
                             status="ok", error=""))
    df = pd.DataFrame(rows)
    totals = df.groupby("impl", sort=False)["measured_bytes"].sum(min_count=1)
    df["measured_ratio_to_ddp"] = df["impl"].map(totals / totals.get("ddp", math.nan))
    return df


def closed_form_traffic(size: str | ModelConfig, world_size: int = 2) -> pd.DataFrame:
    """:func:`lab.parallel.sharded_optimizer.optimizer_traffic` for the model ``size`` (parameters counted on
    the meta device): bytes per rank per step of DDP, the sharded optimizer and ZeRO-1, with ``size`` and
    ``*_gib`` columns."""
    name, cfg = model_config(size, 64)
    df = optimizer_traffic(parameter_count(cfg), world_size)
    for col in ("gradient", "parameter", "total"):
        df[f"{col}_gib"] = df[f"{col}_bytes"] / GiB
    return df.assign(size=name)
