"""Device selection and the facts about it that a measurement needs: memory, synchronization, OOM."""

from __future__ import annotations

import gc
import os
import re

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>")


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``"auto"`` picks CUDA when present. An unknown name, or CUDA on a machine without it, is a
    ``ValueError`` of one line that says what is accepted."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; use one of {', '.join(DEVICE_CHOICES)}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported here; use one of {', '.join(DEVICE_CHOICES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but this machine has no CUDA GPU; use 'cpu' or 'auto'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU, where work is synchronous)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def available_memory_bytes(device: torch.device | str) -> int:
    """Memory a new measurement can use on ``device``: the GPU's total memory (what PyTorch's allocator may
    grow to), or on the CPU the kernel's ``MemAvailable`` (falls back to physical memory)."""
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory error from any backend (CUDA, CPU allocator, Triton shared memory)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    markers = ("out of memory", "can't allocate memory", "outofresources")
    return isinstance(exc, RuntimeError) and any(m in text.replace("out of resources", "outofresources")
                                                 for m in markers)


def error_summary(exc: BaseException, limit: int = 200) -> str:
    """``"OutOfMemoryError: CUDA out of memory. Tried ..."``: the type and first line of an error, for the
    ``error`` column of a result row."""
    text = str(exc)
    first = text.splitlines()[0] if text else ""
    cuda = _CUDA_OOM.search(text)
    if cuda:  # the whole story in one line: what was asked, what was free, and whether it was fragmentation
        first = (f"CUDA out of memory: tried to allocate {cuda['want']} with {cuda['free']} free of "
                 f"{cuda['total']}; this process held {cuda['held']}")
        split = _CUDA_SPLIT.search(text)
        if split:
            first += f" ({split['live']} allocated by PyTorch, {split['cached']} reserved but unallocated)"
    return f"{type(exc).__name__}: {first[:limit]}"


_SIZE = r"[\d.]+ (?:[KMGT]i?B|bytes)"  # torch's format_size: "20.00 MiB", and "0 bytes" up to 1 KiB
_CUDA_OOM = re.compile(rf"Tried to allocate (?P<want>{_SIZE})\. GPU \d+ has a total capacity of (?P<total>{_SIZE}) "
                       rf"of which (?P<free>{_SIZE}) is free\..*?this process has (?P<held>{_SIZE}) memory in use",
                       re.S)
_CUDA_SPLIT = re.compile(rf"(?P<live>{_SIZE}) is allocated by PyTorch, and (?P<cached>{_SIZE}) is reserved by "
                         r"PyTorch but unallocated")


def empty_cache() -> None:
    """Release cached blocks so the next measurement starts from a clean allocator."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
