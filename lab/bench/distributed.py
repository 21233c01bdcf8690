"""What the data-parallel benchmarks share (:mod:`lab.bench.ddp`, :mod:`lab.bench.sharding`): the model of a
size name or an explicit config, whether a run has the GPUs it asks for or runs CPU processes with gloo,
the interleaving that fits in memory, the profiles' timing defaults, and torch DDP's default bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lab import cli
from lab.bench.interleaved import Interleaving, choose_schedule
from lab.bench.memory_estimate import HEADROOM, cpu_peak_bytes
from lab.measure.device import available_memory_bytes
from lab.model import ModelConfig, config_for
from lab.parallel import launcher

#: ``torch.nn.parallel.DistributedDataParallel``'s default ``bucket_cap_mb``: a torch DDP row's bucket size.
TORCH_DDP_BUCKET_MB = 25.0
#: Timing per profile: (rounds, timed steps per round, untimed warm-up steps). GPU steps are long and steady;
#: CPU steps are short and the shared host drifts, so the CPU takes more rounds of one step each.
GPU_ROUNDS, CPU_ROUNDS = (6, 3, 2), (20, 1, 1)


def model_config(size: str | ModelConfig, context: int) -> tuple[str, ModelConfig]:
    """``(name, config)`` of a size name or an explicit :class:`ModelConfig`, at ``context`` tokens."""
    if isinstance(size, ModelConfig):
        return "custom", replace(size, context_length=context)
    return size, config_for(size, context_length=context)


def resolve_schedule(interleaving: Interleaving, bytes_per_copy: float, copies: int, device: str,
                     world_size: int) -> Interleaving:
    """``interleaving`` with an ``"auto"`` schedule made concrete: resident when ``copies`` copies fit in half
    the memory of one rank's device (a GPU, or the CPU's available memory shared by the ranks)."""
    if interleaving.schedule != "auto":
        return interleaving
    _, device_type = launcher.resolve_backend(world_size, device=device)
    available = available_memory_bytes(device_type)
    if device_type == "cpu":
        available /= world_size
    return replace(interleaving, schedule=choose_schedule(bytes_per_copy, copies, available))


def where_to_run(quick: bool, device: str, world_size: int, gpus: int | None = None) -> tuple[bool, str]:
    """``(on_gpu, note)``: whether a run uses ``world_size`` GPUs (the full profile, when the machine has them
    and ``device`` allows) or CPU processes with gloo, and a note saying which and why."""
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if quick:
        return False, f"Quick profile: a tiny model on {world_size} CPU processes with gloo."
    if device != "cpu" and gpus >= world_size:
        return True, f"Full profile: {world_size} GPUs with NCCL."
    why = "device='cpu' was asked for" if device == "cpu" else f"this machine has {gpus} GPU(s)"
    return False, (f"The full profile needs {world_size} GPUs and {why}; this render runs the CPU-sized version "
                   "with gloo instead.")


def profile_interleaving(on_gpu: bool, rounds: int | None = None, steps_per_round: int | None = None,
                         warmup: int | None = None, schedule: str = "auto") -> Interleaving:
    """The interleaving of a profile (:data:`GPU_ROUNDS` or :data:`CPU_ROUNDS`), each None taking its default."""
    r, s, w = GPU_ROUNDS if on_gpu else CPU_ROUNDS
    return Interleaving(rounds=rounds or r, steps_per_round=steps_per_round or s,
                        warmup=w if warmup is None else warmup, schedule=schedule)


def check_fits(cfg: ModelConfig, context: int, batch: int, dtype: str, world_size: int) -> None:
    """Refuse (:class:`lab.cli.UsageError`) a CPU run whose ranks cannot all hold their train step: each rank
    needs :func:`lab.bench.memory_estimate.cpu_peak_bytes` of one AdamW step at its per-rank batch."""
    per_rank = cpu_peak_bytes(cfg, batch, context, dtype, "train_step")
    available = available_memory_bytes("cpu")
    if world_size * per_rank > HEADROOM * available:
        raise cli.UsageError(f"{world_size} CPU ranks of this model at context {context}, batch {batch} need about "
                             f"{world_size * per_rank / 2**30:.1f} GiB ({per_rank / 2**30:.1f} GiB each), but "
                             f"{available / 2**30:.1f} GiB is available; use a smaller --size, --context or --batch")


def check_command(sizes: Sequence[str], context: int, batch: int, dtype: str, world_size: int, device: str,
                  **folders: str | None) -> str:
    """What a data-parallel command line checks before any rank starts, each mistake a
    :class:`lab.cli.UsageError` of one line: known sizes, the ranks the machine has, writable ``folders``
    (``results_dir="..."`` is the flag ``--results-dir``) and, on the CPU, memory for every rank
    (:func:`check_fits`). Returns the device that runs it: ``"cuda"`` or ``"cpu"``."""
    try:
        configs = [config_for(size, context_length=context) for size in sizes]
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    resolved = ("cuda" if gpus else "cpu") if device == "auto" else device
    cli.check_ranks([world_size], resolved, gpus)
    for flag, folder in folders.items():
        if folder:
            cli.writable_dir(folder, "--" + flag.replace("_", "-"))
    if resolved == "cpu":
        for cfg in configs:
            check_fits(cfg, context, batch, dtype, world_size)
    return resolved
