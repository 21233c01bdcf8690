"""``python -m lab.fastest``: the fastest training step built from the book's parts, beside stock PyTorch.

    python -m lab.fastest --config leaderboard --world-size 2     # two GPUs: the course's leaderboard step
    python -m lab.fastest --config 2.7B                           # one GPU: 2.7B, batch 4, context 512
    # two nodes of two GPUs (HSDP), as on two machines: the same command with --node-rank 0 and 1
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:29500 --node-rank 0 \
        -m lab.fastest --config leaderboard_hsdp

Under torchrun every rank runs this command; the ranks per node come from ``LOCAL_WORLD_SIZE`` (or
``--gpus-per-node``), each rank takes the allocator settings spawned ranks get
(``lab.bench.fastest.allocator_env``), and rank 0 alone prints and saves the rows. Two agents on one
machine need disjoint GPUs: ``CUDA_VISIBLE_DEVICES=0,1`` for one, ``2,3`` for the other.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

import torch

from lab import cli
from lab.accounting import state_memory
from lab.bench.fastest import allocator_env, benchmark, results_table
from lab.bench.memory_estimate import HEADROOM
from lab.measure.device import available_memory_bytes
from lab.measure.machine import busy_host
from lab.measure.results import save_results
from lab.parallel import launcher
from lab.recipes.fastest_step import CONFIGS, PROJECT, PROJECT_ONE_GPU, ablations, recipes_for


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m lab.fastest", description="Time the book's fastest training step (and the stock "
                   "PyTorch step) for a configuration; prints step time, peak memory, tokens/s and MFU.")
    p.add_argument("--config", choices=list(CONFIGS), default="2.7B",
                   help="leaderboard: 8.1B params, 32k context, 2 GPUs; 2.7B: batch 4, context 512, 1 GPU; "
                   "leaderboard_hsdp: the leaderboard on 2 nodes of 2 GPUs; tiny*: CPU-sized stand-ins")
    p.add_argument("--world-size", type=cli.positive_int, default=None,
                   help="ranks (default: torchrun's WORLD_SIZE, else the config's)")
    p.add_argument("--gpus-per-node", type=cli.positive_int, default=None,
                   help="ranks per node for hybrid sharding (default: torchrun's LOCAL_WORLD_SIZE, else the config's)")
    bases = (PROJECT, PROJECT_ONE_GPU, dataclasses.replace(PROJECT, sharding="hsdp"))
    switches = dict.fromkeys(r.name for base in bases for r in ablations(base))
    p.add_argument("--recipes", nargs="+", default=["project", "stock_compiled"],
                   help=f"project, stock_eager, stock_compiled, and the ablations ({', '.join(switches)}), or 'all'")
    p.add_argument("--num-layers", type=cli.positive_int, default=None,
                   help="override the model's layer count (a quicker try of the same step shape)")
    p.add_argument("--rep-ms", type=float, default=3000.0, help="do_bench repetition budget in ms (>= 1 step)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step (phase breakdown)")
    p.add_argument("--fresh-cache", action="store_true", help="compile into empty Inductor and Triton caches, as "
                   "the leaderboard's 10-minute rule counts it (wall_s: build, first step and timing)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: gloo, for trying the code path)")
    p.add_argument("--busy-host", type=cli.non_negative_int, default=0, metavar="N",
                   help="time beside N processes that each keep a host core busy (lab.measure.machine.busy_host)")
    p.add_argument("--results-dir", default=None,
                   help="also save the rows as <dir>/fastest_step.csv (fastest_step_busyN.csv with --busy-host N)")
    return p


def choose_recipes(config, names: Sequence[str]):
    """The named recipes of ``config`` (``all``: the book's, both stock steps and every ablation)."""
    base = recipes_for(config)
    known = {**base, **{r.name: r for r in ablations(base["project"])}}
    if list(names) == ["all"]:
        return list(known.values())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise cli.UsageError(f"unknown recipe {unknown[0]!r}; choose from {', '.join(known)} or 'all'")
    return [known[n] for n in names]


def check_cpu_fits(config, recipes, world: int) -> None:
    """Refuse (:class:`lab.cli.UsageError`) a CPU run this machine cannot hold: more ranks than cores, or a model
    whose parameters, gradients and AdamW state alone (a lower bound on any recipe's need, as if sharded
    perfectly over the ranks) exceed the available memory; the advice names the layer count that would fit."""

    cli.check_ranks([world], "cpu", 0)
    available = available_memory_bytes("cpu")

    def need(model) -> int:
        return max(sum(state_memory(model, r.precision)[k] for k in ("params", "grads", "optimizer"))
                   for r in recipes)

    total = need(config.model)
    if total <= HEADROOM * available:
        return
    layers = [n for n in range(config.model.num_layers - 1, 0, -1)
              if need(dataclasses.replace(config.model, num_layers=n)) <= HEADROOM * available]
    change = (f"--config tiny, --num-layers {layers[0]} (room for that state only; activations come on top)"
              if layers else "--config tiny")
    raise cli.UsageError(f"the {config.name} step needs at least {total / 2**30:.1f} GiB on the CPU (its "
                         f"parameters, gradients and AdamW state alone), but {available / 2**30:.1f} GiB is "
                         f"available; try {change}, or a GPU machine")


def fastest_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = CONFIGS[args.config]
    if args.num_layers:
        config = dataclasses.replace(config, name=f"{config.name}_{args.num_layers}layers",
                                     model=dataclasses.replace(config.model, num_layers=args.num_layers))
    if not args.rep_ms > 0:
        raise cli.UsageError(f"--rep-ms must be a positive number of milliseconds, got {args.rep_ms:g}")
    torchrun = launcher.is_torchrun()
    if torchrun:  # this process is a rank: the allocator settings the spawned ranks get, before CUDA starts
        os.environ.update(allocator_env())
    world = args.world_size or (int(os.environ["WORLD_SIZE"]) if torchrun else config.world_size)
    per_node = args.gpus_per_node or (int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if torchrun else 0)
    if per_node and world % per_node:
        raise cli.UsageError(f"{world} ranks do not make whole nodes of {per_node} (--gpus-per-node)")
    if per_node:
        config = dataclasses.replace(config, gpus_per_node=per_node)
    local = per_node if torchrun and per_node else world  # the ranks this machine runs
    if args.device not in ("auto", "cuda", "cpu"):
        raise cli.UsageError(f"unknown --device {args.device!r}; choose auto, cuda or cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device in ("auto", "cuda"):
        if gpus == 0 and args.device == "cuda":
            raise cli.UsageError("--device cuda was asked for but this machine has no CUDA GPU")
        if gpus and local > gpus:
            raise cli.UsageError(f"--world-size {world} needs {local} GPUs here; this machine has {gpus}")
        if gpus == 0 and args.config.startswith("leaderboard"):
            raise cli.UsageError("the leaderboard step needs two GPUs with about 60 GiB each; this machine has no GPU")
    device = "cuda" if args.device == "auto" and gpus else args.device
    device = "cpu" if device == "auto" else device
    recipes = choose_recipes(config, args.recipes)
    if args.results_dir:
        cli.writable_dir(args.results_dir)
    if device == "cpu":
        check_cpu_fits(config, recipes, local)
    # one set of neighbours per machine: under torchrun each rank runs this, the node's first starts them
    neighbours = args.busy_host if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 0
    with busy_host(neighbours):
        df = benchmark(config, recipes, world, device, rep_ms=args.rep_ms,
                       profile=not args.no_profile, fresh_cache=args.fresh_cache)
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0  # every rank has the rows (gathered): rank 0 prints and saves them
    table = results_table(df).assign(busy_host=args.busy_host)
    cols = ["impl", "config", "world_size", "status", "step_ms", "peak_gib", "tokens_per_s", "mfu", "first_step_s",
            "wall_s"]
    print(table[cols].to_markdown(index=False, floatfmt=".4g"))
    if args.results_dir:
        name = "fastest_step" + (f"_busy{args.busy_host}" if args.busy_host else "")  # beside the rows timed alone
        print(save_results(table, name, args.results_dir, vars(args), source="lab.fastest"), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(fastest_main, argv, prog="python -m lab.fastest")


if __name__ == "__main__":
    sys.exit(main())
