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

import json
import os
import sys

import torch

from lab import cli
from lab.accounting import training_flops
from lab.bench.memory_estimate import HEADROOM, cpu_peak_bytes
from lab.measure.device import available_memory_bytes
from lab.measure.step import TrainStep
from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher
from lab.parallel.ddp import DDPBucketed
from lab.parallel.fsdp import FSDP
from lab.units import GiB

CONFIG = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=64, context_length=16)
WRAPPERS = ("ddp_bucketed", "fsdp")


def global_batch(steps: int, batch: int, seed: int = 0) -> torch.Tensor:
    """(steps, batch, context + 1) token ids: the same on every rank and in the single-process reference."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (steps, batch, CONFIG.context_length + 1), generator=gen)


def train(wrapper: str, steps: int, batch: int) -> dict:
    """Inside each rank: ``steps`` AdamW steps on this rank's slice of the global batch."""
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


#: A CPU core's rate for the time estimate (FLOP/s): a low bound for this toy model's fp32 matmuls, so that the
#: estimate errs long.
CPU_FLOPS_PER_CORE = 1e9
#: Per step and rank: Python, the optimizer and the collectives of a model this small (s; measured 5-30 ms).
STEP_OVERHEAD_S = 0.05
#: The longest run this script starts on a CPU without --no-time-limit (s).
CPU_TIME_LIMIT_S = 600


def estimate(steps: int, batch: int, ranks_here: int, cores: int) -> tuple[float, int]:
    """``(seconds, bytes)`` a run needs on this machine's CPU: every rank builds the global batch (int64 token
    ids) and trains its share; the ranks on this machine share its cores and memory."""
    per_rank = batch // ranks_here if ranks_here else batch
    tokens = steps * batch * (CONFIG.context_length + 1) * 8
    need = ranks_here * (tokens + cpu_peak_bytes(CONFIG, per_rank, CONFIG.context_length, "fp32", "train_step"))
    flops = training_flops(CONFIG, per_rank, CONFIG.context_length) * ranks_here
    seconds = steps * (flops / (CPU_FLOPS_PER_CORE * cores) + STEP_OVERHEAD_S)
    return seconds, need


def parser() -> cli.Parser:
    p = cli.Parser(prog="examples/train_parallel.py", description=__doc__.splitlines()[0])
    p.add_argument("--wrapper", choices=WRAPPERS, default="fsdp")
    p.add_argument("--steps", type=cli.positive_int, default=3)
    p.add_argument("--batch", type=cli.positive_int, default=4, help="global batch (divisible by the world size)")
    p.add_argument("--world-size", type=cli.positive_int, default=None,
                   help="ranks to spawn when not under torchrun (default 2; under torchrun: its WORLD_SIZE)")
    p.add_argument("--no-time-limit", action="store_true",
                   help=f"start a run estimated to take longer than {CPU_TIME_LIMIT_S // 60} minutes on the CPU")
    return p


def check(args, world: int, ranks_here: int, cores: int, available: int) -> None:
    """Refuse, in one line, what cannot run as asked, before any process starts."""
    if not launcher.is_torchrun():
        cli.check_ranks([world], "cpu", gpus=0, cores=cores)
    if args.batch % world:
        nearest = world * max(1, args.batch // world)
        raise cli.UsageError(f"--batch {args.batch} does not divide among {world} ranks (each trains batch / ranks "
                             f"sequences): use a multiple of {world}, e.g. --batch {nearest}")
    seconds, need = estimate(args.steps, args.batch, ranks_here, cores)
    if need > HEADROOM * available:
        raise cli.UsageError(f"--steps {args.steps} --batch {args.batch} needs about {need / GiB:.1f} GiB on this "
                             f"machine ({ranks_here} ranks), {available / GiB:.1f} GiB is available: fewer steps or "
                             "a smaller batch")
    if seconds > CPU_TIME_LIMIT_S and not args.no_time_limit:
        fits = max(1, int(args.steps * CPU_TIME_LIMIT_S / seconds))
        raise cli.UsageError(f"--steps {args.steps} --batch {args.batch} would take about {seconds / 60:.0f} minutes "
                             f"on {cores} cores (at {CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s a core): --steps {fits} "
                             "or fewer, or --no-time-limit")


def run(argv) -> int:
    args = parser().parse_args(argv)
    if launcher.is_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world):
            raise cli.UsageError(f"--world-size {args.world_size} under torchrun, whose WORLD_SIZE is {world}: "
                                 "leave --world-size out (torchrun's --nnodes and --nproc-per-node set it)")
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        world = ranks_here = args.world_size or 2
    check(args, world, ranks_here, os.cpu_count() or 1, available_memory_bytes("cpu"))
    results = launcher.launch(train, world, args.wrapper, args.steps, args.batch, device="cpu")
    # under torchrun every process returns here (its process group already destroyed): rank 0 by torchrun's env
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(results[0]))
    return 0


def main(argv=None) -> int:
    return cli.run(run, argv, prog="examples/train_parallel.py")


if __name__ == "__main__":
    sys.exit(main())
