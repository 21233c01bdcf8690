"""Communication volume of one training step of each sharding schedule (DDP, the sharded optimizer, ZeRO-1,
FSDP), recorded from the collectives the code issues (:class:`lab.parallel.collectives.TrafficLog`) and set
beside the closed forms (:func:`lab.parallel.sharded_optimizer.optimizer_traffic`).
"""


from __future__ import annotations

import math

import pandas as pd
import torch

from lab.accounting import parameter_count
from lab.book.ddp.bench import model_config
from lab.book.sharding.bench import LR
from lab.measure.step import lm_loss, random_batch
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel.fsdp import FSDP
from lab.parallel.sharded_optimizer import ShardedOptimizer, TrafficLog, optimizer_traffic, record_collective
from lab.parallel.zero1 import ZeRO1Optimizer
from lab.units import GiB


def _average_gradients(model: torch.nn.Module) -> None:
    """DDP's gradient synchronization, unbucketed: all-reduce (sum) every gradient, divide by the world size."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            record_collective("all_reduce", p.grad)
            dist.all_reduce(p.grad)
            p.grad.div_(distributed.world_size())


def traffic_worker(cfg: ModelConfig, batch: int = 2) -> dict:
    """Inside a launched process: one training step of each schedule under a :class:`TrafficLog`.

    Returns ``{impl: {collective: ring bytes per rank}}`` for ddp (all-reduce of every gradient),
    sharded_optimizer, zero1 and fsdp (fp32), plus ``num_params``.
    """

    device, n = distributed.device(), distributed.world_size()
    tokens, targets = random_batch(cfg, batch, device, seed=distributed.rank())
    out: dict = {}
    for impl in ("ddp", "sharded_optimizer", "zero1", "fsdp"):
        torch.manual_seed(0)
        with torch.device(device):
            model = TransformerLM(cfg)
        out["num_params"] = model.num_parameters()
        if impl == "ddp":
            runnable, opt = model, torch.optim.AdamW(model.parameters(), lr=LR)
        elif impl == "sharded_optimizer":
            runnable, opt = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
        elif impl == "zero1":
            runnable, opt = model, ZeRO1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
        else:
            runnable = FSDP(model)
            opt = torch.optim.AdamW(runnable.parameters(), lr=LR)
        with TrafficLog() as log:
            lm_loss(runnable, tokens, targets).backward()
            if impl in ("ddp", "sharded_optimizer"):
                _average_gradients(model)
            opt.step()
        out[impl] = {op: log.bytes_per_rank(n, op) for op in log.summary()}
    return out


def measure_traffic(size: str | ModelConfig = "tiny", world_size: int = 2, context: int = 64,
                    device: str = "cpu") -> pd.DataFrame:
    """Bytes per rank of one step of each schedule, recorded from the collectives the code issues, next to
    :func:`lab.parallel.sharded_optimizer.optimizer_traffic`'s closed form (fp32 gradients and parameters).

    Columns: impl, collective, measured_bytes, expected_bytes (NaN for FSDP, which has no row in the
    optimizer closed form), measured_ratio_to_ddp.
    """
    _, cfg = model_config(size, context)
    res = distributed.launch(traffic_worker, world_size, cfg, device=device)[0]
    closed = optimizer_traffic(res["num_params"], world_size).set_index("impl")
    rows = []
    for impl in ("ddp", "sharded_optimizer", "zero1", "fsdp"):
        for op, measured in res[impl].items():
            expected = math.nan
            if impl in closed.index:
                c = closed.loc[impl]
                expected = c["gradient_bytes"] if op == c["gradient_collective"] else \
                    c["parameter_bytes"] if op == c["parameter_collective"] else math.nan
            rows.append(dict(impl=impl, collective=op, measured_bytes=measured, expected_bytes=expected))
    df = pd.DataFrame(rows)
    totals = df.groupby("impl", sort=False)["measured_bytes"].sum()
    df["measured_ratio_to_ddp"] = df["impl"].map(totals / totals["ddp"])
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
