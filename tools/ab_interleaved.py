"""Interleaved A/B timing of two sharding implementations in the same processes (GPU diagnostic).

The sharding notebook times each implementation in its own launch, one after the other; on a host whose
load drifts, that ranks implementations by when they ran as much as by what they do. Here both models live
in the same two processes and their train steps alternate (A, B, A, B, ...; ranks aligned by a barrier
before every step), so both see the same host conditions. Prints per-round times and the median ratio.

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 python tools/ab_interleaved.py        # two GPUs
    PYTHONPATH=. python tools/ab_interleaved.py cpu                        # smoke test, tiny model, gloo
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lab.bench.sharding import build, step_phases
from lab.measure.device import synchronize
from lab.measure.step import random_batch
from lab.model.transformer import TransformerLM, config_for
from lab.parallel import launcher as distributed

PAIRS = [("xl", "fsdp", "torch_fsdp2"), ("2.7B", "fsdp", "torch_fsdp2"), ("2.7B", "zero1", "torch_zero")]


def worker(size: str, impls: tuple[str, str], dtype: str, batch: int, warmup: int, rounds: int) -> dict:
    dev = distributed.device()
    cfg = config_for(size, context_length=512)
    tokens, targets = random_batch(cfg, batch, dev, seed=distributed.rank())
    steps = {}
    for impl in impls:
        torch.manual_seed(0)
        with torch.device(dev):
            model = TransformerLM(cfg)
        runnable, opt, _ = build(impl, model, dev, dtype)
        forward, backward, optimizer_step = step_phases(runnable, opt, tokens, targets, dev, dtype)

        def step(forward=forward, backward=backward, optimizer_step=optimizer_step):
            backward(forward())
            optimizer_step()

        steps[impl] = step
    times = {impl: [] for impl in impls}
    for r in range(warmup + rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):  # alternate which goes first
            synchronize(dev)
            dist.barrier()
            synchronize(dev)
            t0 = time.perf_counter()
            steps[impl]()
            synchronize(dev)
            if r >= warmup:
                times[impl].append((time.perf_counter() - t0) * 1e3)
    return times


def main(device: str = "cuda") -> None:
    pairs = PAIRS if device == "cuda" else [("tiny", a, b) for _, a, b in PAIRS]  # CPU: a smoke test
    for size, a, b in pairs:
        start = time.time()
        try:
            per_rank = distributed.launch(worker, 2, size, (a, b), "bf16", 2, 3, 10, device=device, timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - a diagnostic goes on with the next pair
            print(size, a, b, "FAILED", str(exc)[:1500])
            continue
        # a step is over when its slowest rank is done
        ta = [max(x) for x in zip(*(t[a] for t in per_rank))]
        tb = [max(x) for x in zip(*(t[b] for t in per_rank))]
        ratios = [x / y for x, y in zip(ta, tb)]
        print(f"== {size}: {a} vs {b} ({time.time() - start:.0f} s)")
        print(f"{a:>12}: median {statistics.median(ta):7.1f} ms  mean {statistics.mean(ta):7.1f}  "
              f"{[round(x) for x in ta]}")
        print(f"{b:>12}: median {statistics.median(tb):7.1f} ms  mean {statistics.mean(tb):7.1f}  "
              f"{[round(x) for x in tb]}")
        print(f"{'ratio':>12}: median {statistics.median(ratios):.3f}  per round {[round(x, 2) for x in ratios]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
