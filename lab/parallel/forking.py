"""CPU ranks as forks of a forkserver that has imported torch, for :func:`lab.parallel.launcher.launch`.

A fresh interpreter spends about 2 s of CPU importing torch before a rank does anything; a fork of a server
that imported it once starts in a fraction of that, which is most of a short CPU launch on a small machine.
GPU ranks are never forked (a process must not fork once CUDA has started): the launcher spawns them.

A fork has the server's state where a spawned rank has its launcher's as it is at the launch, so a forked
rank takes it over as it starts (:func:`inherit`): the launching process's file descriptors 1 and 2 (passed
through the server; the server's own are those of whoever started it, in a test an earlier test's capture) and
its environment. What a process reads once, as the interpreter starts or as torch is imported
(:data:`READ_AT_START`), cannot be taken over: a launch whose values differ from the server's is spawned
(:func:`context` says None), as is every CPU launch where no server can run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as _mp
import multiprocessing.reduction as _reduction
import os
import sys
from typing import Any

# Environment variables read as an interpreter starts or as the modules of PRELOAD are imported (the dynamic
# loader's and Python's own, malloc's, OpenMP's and MKL's threads, torch's C++ logging and its TORCH_LOGS,
# Dynamo's and Inductor's configuration, Triton's TRITON_INTERPRET): a forked rank keeps the server's values,
# fixed when it started. Variables of CUDA and NCCL are read later, and only by GPU ranks, which are always
# spawned.
READ_AT_START = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
                 "TORCH_", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TRITON_")
# Read when used, not at import: Inductor sets its cache folder in os.environ the first time it needs one (in the
# server as it imports Dynamo), so a caller that has not compiled yet differs from the server only in it.
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)
# The modules the server imports once for every rank it forks: torch, and the libraries lab's parallel code
# imports with it (FSDP2, Dynamo, which brings Triton, and pandas and sympy, through lab.accounting), about 2 s
# of CPU that each forked rank would otherwise pay again. Not lab's own: the server finds modules on the
# sys.path it started with, and a rank must import lab (its launcher included) from the caller's sys.path, as a
# spawned one does (a worktree's lab rather than an installed one, say); the launcher then takes milliseconds.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo", "pandas", "sympy"]
# The server this module started: its process id and its READ_AT_START variables; broken once it failed.
_SERVER: dict[str, Any] = {"pid": None, "env": None, "broken": False}


def context(defaults: dict[str, str], child_env: dict[str, str]):
    """The forkserver context for a launch's CPU ranks, whose environment is to be ``child_env`` (the server
    started, with ``defaults`` added to this process's environment, if it was not running), or None where they
    are to be spawned. The caller keeps other threads from changing ``os.environ`` meanwhile."""
    if _SERVER["broken"] or not sys.platform.startswith("linux") or not _reduction.HAVE_SEND_HANDLE:
        return None
    try:
        os.fstat(1)
        os.fstat(2)
    except OSError:  # nothing to pass on; a spawned rank inherits them closed, as they are here
        return None
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        ctx = _mp.get_context("forkserver")
        before = server._forkserver_pid
        ctx.set_forkserver_preload(PRELOAD)
        with environment(defaults):  # the server imports torch with the defaults the ranks would have
            server.ensure_running()
            if server._forkserver_pid != before:
                _SERVER.update(pid=server._forkserver_pid, env=_read_at_start(os.environ))
    except Exception:  # noqa: BLE001 - no server here (no AF_UNIX socket, ...): spawned ranks
        broken()
        return None
    if server._forkserver_pid != _SERVER["pid"] or _read_at_start(child_env) != _SERVER["env"]:
        return None  # a server started elsewhere in this process (its environment unknown) or with other values
    return ctx


@contextlib.contextmanager
def environment(updates: dict[str, str]):
    """``os.environ`` with ``updates`` inside the block, restored as it was on the way out."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def broken() -> None:
    """The server failed (to start, or to fork a rank): CPU ranks are spawned from here on."""
    _SERVER["broken"] = True


def _read_at_start(environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(READ_AT_START) and k not in READ_WHEN_USED}


class StdFds:
    """This process's file descriptors 1 and 2, for a rank to write where this process's output goes now.
    Pickled only as a rank starts: multiprocessing then passes the descriptors themselves to the new process
    (through the server, for a forked rank), which unpickles their numbers in its own table."""

    def __reduce__(self):
        return _received_fds, (_reduction.DupFd(1), _reduction.DupFd(2))


def _received_fds(out, err) -> tuple[int, int]:
    return out.detach(), err.detach()


def inherit(fds: tuple[int, int], env: dict[str, str]) -> None:
    """In a forked rank, as it starts: the received ``fds`` (:class:`StdFds`) become its 1 and 2 (what Python
    has buffered for the old ones written first), and ``env`` its whole environment."""
    import fcntl

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # copies above 2 first: a received descriptor may itself have landed on 1 or 2
    copies = [(target, fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)) for target, fd in zip((1, 2), fds)]
    for fd in set(fds) - {1, 2}:
        os.close(fd)
    for target, copy in copies:
        os.dup2(copy, target)
        os.close(copy)
    os.environ.clear()
    os.environ.update(env)
