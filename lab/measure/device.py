"""Device selection and the facts about it that every result carries."""

from __future__ import annotations

import torch


def resolve_device(name: str = "auto") -> torch.device:
    """``"auto"`` picks CUDA when present; asking for CUDA on a machine without it is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was asked for but this machine has no CUDA GPU; use 'cpu' or 'auto'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU, where work is synchronous)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device | str = "auto") -> str:
    """A human name for the device: the GPU model, or the CPU's."""
    device = resolve_device(device) if isinstance(device, str) else device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


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
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first[:limit]}"


def empty_cache() -> None:
    """Release cached blocks so the next measurement starts from a clean allocator."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
