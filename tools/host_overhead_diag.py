"""Is a training step host-bound, and where does lab.FSDP spend host time? (GPU diagnostic, not a benchmark.)

For each configuration: per step, the host time to *enqueue* forward, backward and optimizer (no
synchronization in between) next to the synchronized wall time, plus the CUDA allocator's cudaMalloc/free
counts; for the FSDP variants a cProfile of two steps on rank 0. When the enqueue times add up to about the
wall time, the GPU is waiting for the host. Run on a machine with 2 GPUs:

    PYTHONPATH=. NCCL_NVLS_ENABLE=0 python tools/host_overhead_diag.py

notes/host_overhead_diag_61cddb2860e8.log is its output from before lab.FSDP grouped collectives by block.
"""
import cProfile
import io
import pstats
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist

from lab.bench.sharding import build_impl
from lab.measure.step import TrainStep, random_batch
from lab.model.transformer import TransformerLM, config_for
from lab.parallel import launcher as distributed

CONFIGS = [("2.7B", "single", 1), ("xl", "ddp", 2), ("xl", "fsdp", 2), ("xl", "torch_fsdp2", 2)]


def _phases(fwd, bwd, opt, dev, steps: int = 6, warmup: int = 2) -> list[dict]:
    rows = []
    for i in range(warmup + steps):
        torch.cuda.synchronize(dev)
        dist.barrier()
        torch.cuda.synchronize(dev)
        s0 = torch.cuda.memory_stats(dev)
        t0 = time.perf_counter()
        loss = fwd()
        t1 = time.perf_counter()
        bwd(loss)
        t2 = time.perf_counter()
        opt()
        t3 = time.perf_counter()
        torch.cuda.synchronize(dev)
        t4 = time.perf_counter()
        s1 = torch.cuda.memory_stats(dev)
        if i >= warmup:
            rows.append(dict(host_fwd=(t1 - t0) * 1e3, host_bwd=(t2 - t1) * 1e3, host_opt=(t3 - t2) * 1e3,
                             wall=(t4 - t0) * 1e3, mallocs=s1["num_device_alloc"] - s0["num_device_alloc"],
                             frees=s1["num_device_free"] - s0["num_device_free"],
                             retries=s1["num_alloc_retries"] - s0["num_alloc_retries"]))
    return rows


def worker(size: str, impl: str, dtype: str, batch: int):
    dev = distributed.device()
    cfg = config_for(size, context_length=512)
    torch.manual_seed(0)
    with torch.device(dev):
        model = TransformerLM(cfg)
    tokens, targets = random_batch(cfg, batch, dev, seed=distributed.rank())
    if impl == "single":
        runnable, optimizer = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        runnable, optimizer, _ = build_impl(impl, model, dev, dtype)
    step = TrainStep(runnable, optimizer, tokens, targets, dtype=dtype)  # the book's one phased step
    fwd, bwd, opt = step.forward, step.backward, step.optimizer_step

    rows = _phases(fwd, bwd, opt, dev)
    profile = ""
    if impl in ("fsdp", "torch_fsdp2"):  # every rank steps; rank 0 records where its host time goes
        prof = cProfile.Profile() if distributed.rank() == 0 else None
        if prof:
            prof.enable()
        for _ in range(2):
            bwd(fwd())
            opt()
        torch.cuda.synchronize(dev)
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
            profile = buf.getvalue()
    return rows, profile


def main() -> None:
    for size, impl, world in CONFIGS:
        start = time.time()
        try:
            res = distributed.launch(worker, world, size, impl, "bf16", 2, device="cuda", timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - a diagnostic goes on with the next configuration
            print(size, impl, "FAILED", str(exc)[:2000])
            continue
        for rank, (rows, profile) in enumerate(res):
            if profile:
                print(profile[:6000])
            print(f"== {size} {impl} rank {rank} ({time.time() - start:.0f} s)")
            print(pd.DataFrame(rows).round(1).to_string())
        sys.stdout.flush()


if __name__ == "__main__":
    main()
