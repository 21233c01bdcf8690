"""Train a tiny TransformerLM for a few steps with one of the book's data-parallel wrappers.

Runs the way a multi-node user launches it, under torchrun (``lab.parallel.launcher.launch`` joins the
process group torchrun set up)::

    torchrun --nproc-per-node 2 examples/train_parallel.py --wrapper fsdp --steps 3
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST --nproc-per-node 8 examples/train_parallel.py ...

or on its own, in which case it spawns ``--world-size`` local processes. Rank 0 prints one JSON line: the
global loss of every step and a checksum of the trained weights, so the run can be checked against
single-process training on the same global batch.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from lab.measure.step import TrainStep
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher

CONFIG = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=64, context_length=16)
WRAPPERS = ("ddp_bucketed", "fsdp")


def global_batch(steps: int, batch: int, seed: int = 0) -> torch.Tensor:
    """(steps, batch, context + 1) token ids: the same on every rank and in the single-process reference."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (steps, batch, CONFIG.context_length + 1), generator=gen)


def train(wrapper: str, steps: int, batch: int) -> dict:
    """Inside each rank: ``steps`` AdamW steps on this rank's slice of the global batch."""
    from lab.parallel.ddp import DDPBucketed
    from lab.parallel.fsdp import FSDP

    rank, world = launcher.rank(), launcher.world_size()
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    wrapped = DDPBucketed(model, bucket_size_mb=0.01) if wrapper == "ddp_bucketed" else FSDP(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    data, per_rank = global_batch(steps, batch), batch // world
    losses = []
    for s in range(steps):
        mine = data[s, rank * per_rank:(rank + 1) * per_rank]
        step = TrainStep(wrapped, optimizer, mine[:, :-1], mine[:, 1:])
        loss = step.forward()
        step.backward(loss)
        step.optimizer_step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    weights = wrapped.gather_full_params() if wrapper == "fsdp" else dict(model.named_parameters())
    return dict(rank=rank, world_size=world, losses=losses,
                checksum=float(sum(w.detach().double().abs().sum() for w in weights.values())))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrapper", choices=WRAPPERS, default="fsdp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="global batch (divisible by the world size)")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not under torchrun")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.world_size))
    results = launcher.launch(train, world, args.wrapper, args.steps, args.batch, device="cpu")
    # under torchrun every process returns here (its process group already destroyed): rank 0 by torchrun's env
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(results[0]))


if __name__ == "__main__":
    main()
