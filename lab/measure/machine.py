"""Where a measurement ran: the GPU model and count, the host's CPU model, and what else ran beside it.

A timing depends on more than the GPU: an eager step whose kernels are short is paced by the host's kernel
launches, so the same GPU model behind another CPU gives another answer, and a second process on the same
GPUs or host moves every number. So every saved row names its host CPU, and a render records what else was
running when it started (:func:`neighbours`): a report says whether it had its GPUs and host to itself.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

#: Another process using more than this share of one CPU core counts as running beside a render.
BUSY_CORE_SHARE = 0.2


def gpu_model() -> str:
    """``"NVIDIA H100 80GB HBM3"``, or ``"cpu"`` without a GPU: the model, whatever the count."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def host_cpu() -> str:
    """The host's CPU model (``/proc/cpuinfo``'s model name; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _own_tree() -> set[int]:
    """This process, its ancestors and its descendants: a render's own papermill, kernel and workers."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    mine, pid = {os.getpid()}, os.getpid()
    while pid in parents and parents[pid] > 1:
        pid = parents[pid]
        mine.add(pid)
    grew = True
    while grew:
        children = {p for p, parent in parents.items() if parent in mine and p not in mine}
        mine |= children
        grew = bool(children)
    return mine


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (name, int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _gpu_processes() -> list[tuple[int, str]]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.stdout.splitlines():
        pid, _, name = line.partition(",")
        if pid.strip().isdigit():
            rows.append((int(pid), name.strip()))
    return rows


def neighbours(sample_s: float = 0.5) -> list[str]:
    """What else runs on this machine now, outside this process's own tree: each process on a GPU, and each
    process using more than :data:`BUSY_CORE_SHARE` of a core over ``sample_s`` seconds. Empty when alone
    (on a machine without ``/proc``, only the GPU's processes are seen)."""
    mine = _own_tree()
    found = [f"{name or 'a process'} (pid {pid}) on the GPU" for pid, name in _gpu_processes() if pid not in mine]
    before = _cpu_ticks()
    if before:
        time.sleep(sample_s)
        after = _cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        for pid, (name, ticks) in after.items():
            if pid in mine or pid not in before:
                continue
            share = (ticks - before[pid][1]) / hz / sample_s
            if share > BUSY_CORE_SHARE:
                found.append(f"{name} (pid {pid}) using {share:.0%} of a core")
    return found


# One busy neighbour: copies a buffer into another, so it holds a core and draws on the memory bus, until its
# parent is gone (a parent killed outright, as torchrun ends its ranks, runs no cleanup: the spinner would stay).
_SPINNER = ("import os\nb = bytearray({n}); c = bytearray({n})\n"
            "while os.getppid() == {parent}:\n    c[:] = b\n")


def half_the_cores() -> int:
    """How many neighbours a busy-host timing runs beside: half the host's cores (at least one)."""
    return max((os.cpu_count() or 2) // 2, 1)


@contextlib.contextmanager
def busy_host(processes: int, mib: int = 32) -> Iterator[list[int]]:
    """For the time of the block, ``processes`` neighbours that each keep one core busy copying ``mib`` MiB
    buffers (what another job's data loaders or a second benchmark take from a host: cores and memory
    bandwidth), started as bare interpreters (no imports, so in milliseconds); yields their pids. They are
    stopped on leaving the block, also on an error. A step whose pace the host sets slows under them; one that
    the GPU sets does not: timing a choice both ways says whether its verdict depends on the host."""
    if processes < 0:
        raise ValueError(f"processes must be >= 0, got {processes}")
    code = _SPINNER.format(n=int(mib) * 2**20, parent=os.getpid())  # given, not read: the parent may die first
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            spinners.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield [p.pid for p in spinners]
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
