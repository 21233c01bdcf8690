"""The one distributed launcher: run a function on N ranks and get every rank's return value back.

Every multi-process notebook, test and CLI in the lab book goes through :func:`launch`::

    from lab.parallel import launcher as distributed

    def allreduce_sum(x):                        # must live in an importable module (see below)
        t = torch.tensor([x + distributed.rank()], device=distributed.device())
        torch.distributed.all_reduce(t)
        return t.item()

    distributed.launch(allreduce_sum, 2, 10.0)   # -> [21.0, 21.0]

Two ways of running, same code:

* **spawned** (the usual case in a notebook or test): ``launch`` starts ``world_size`` processes on this
  machine, picks a free TCP port for the rendezvous, uses gloo on the CPU and NCCL on GPUs (one GPU per
  rank), and sends each rank's return value back through a queue. GPU ranks are fresh interpreters
  (``torch.multiprocessing``'s *spawn* method: a process must not fork once CUDA has started). CPU ranks are
  forks of a *forkserver* that imported torch once (:mod:`lab.parallel.forking`), because a fresh interpreter
  spends about 2 s of CPU importing torch, most of a short CPU launch on a small machine. A forked rank takes
  what a spawned one inherits as it is at the launch: the caller's environment, and its file descriptors 1
  and 2 (where the caller's output goes now, e.g. a test's capture), not the server's. Where no forkserver
  can be used (not Linux, no server could start) or the environment differs from the server's in a variable
  read when the interpreter starts or torch is imported (``TORCH_CPP_LOG_LEVEL``, ``OMP_NUM_THREADS``, ...),
  CPU ranks are spawned too.
  ``fn`` travels to the workers by pickling, i.e. by *reference* (module + name): functions and
  lambdas defined in a notebook cell are **not** picklable into a spawned process, so notebooks call
  functions that live in ``lab``.
* **under torchrun** (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are in the environment): the launcher
  joins the ``env://`` rendezvous torchrun set up, runs ``fn`` in *this* process and returns every rank's
  value (gathered with ``all_gather_object``). The same script therefore runs on several nodes unchanged.

A worker's exception reaches the caller with the worker's traceback, and the other ranks are terminated
rather than left waiting in a collective. Process groups get a timeout, and are destroyed at the end.
"""

from __future__ import annotations

import datetime as _dt
import io
import os
import pickle
import queue as _queue
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lab.measure.process import describe_exit
from lab.parallel import forking
from lab.parallel.forking import environment

# The launcher leaves NCCL's and torch's settings to its user: a machine whose NCCL needs a switch (NVLink SHARP
# multicast off where the fabric lacks it: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1) gets it from
# the command or script that runs there, and spawned ranks inherit it, or from ``launch(env=...)``.
# One default for spawned children, only where the user set none: torch's C++ logging (read when torch loads)
# at errors only, so that gloo's and the TCP store's connection notices do not bury a rank's own output.
CHILD_DEFAULTS = {"TORCH_CPP_LOG_LEVEL": "ERROR"}

# This process's device, set by the launcher in each worker (None outside a launched function).
_DEVICE: torch.device | None = None
# True in a rank that launch() spawned (whose environment also has torchrun's variables).
_SPAWNED = False
_ENV_LOCK = threading.Lock()


class WorkerError(RuntimeError):
    """A rank raised (or died); the message carries the rank, the error and the worker's traceback."""

    def __init__(self, rank: int, message: str, worker_traceback: str = ""):
        self.rank = rank
        self.worker_traceback = worker_traceback
        text = f"rank {rank} failed: {message}"
        if worker_traceback:
            text += "\n\n--- traceback in the worker ---\n" + worker_traceback
        super().__init__(text)


# --------------------------------------------------------------------------------------------------------
# helpers used inside a launched function


def rank() -> int:
    """This process's rank (0 when no process group is running)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 when no process group is running)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    """This process's index on its node (the GPU it drives)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def device() -> torch.device:
    """This rank's device: ``cuda:<local rank>`` under NCCL, else the CPU."""
    if _DEVICE is not None:
        return _DEVICE
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def is_torchrun() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env:// variables;
    a rank :func:`launch` spawned sets them too, see :func:`is_spawned`)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def is_spawned() -> bool:
    """True inside a rank that :func:`launch` spawned: its peers are ended when it fails, so a rank may end
    the launch on purpose (under torchrun a failing rank ends only itself)."""
    return _SPAWNED


# --------------------------------------------------------------------------------------------------------
# choosing device and backend


def resolve_backend(world_size: int, backend: str | None = None, device: str | None = None) -> tuple[str, str]:
    """``(backend, device_type)`` for a run: gloo on the CPU, NCCL on GPUs, from ``device`` "auto"|"cpu"|"cuda".

    Raises ``ValueError`` for a bad name and ``RuntimeError`` when more ranks than GPUs are asked for.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    device = "auto" if device is None else str(device)
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if device == "auto":
        device = "cuda" if backend != "gloo" and torch.cuda.is_available() else "cpu"
    if backend is None:
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ValueError("the NCCL backend needs device='cuda'; use gloo for CPU tensors")
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > gpus and not is_torchrun():
            raise RuntimeError(f"asked for {world_size} ranks on device='cuda' (one GPU per rank) but this "
                               f"machine has {gpus} GPU(s); use world_size <= {gpus} or device='cpu' (gloo)")
    return backend, device


def free_port() -> int:
    """A TCP port that is free right now on localhost (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_picklable(fn: Callable) -> None:
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is defined in an interactive session (a notebook "
                         "cell); spawned workers cannot import it. Put it in a module (e.g. lab/...) and pass that.")
    try:
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - lambdas, closures, local functions
        raise ValueError(f"fn must be picklable by reference (a module-level function); {fn!r} is not: {exc}") \
            from exc


def _to_bytes(obj: Any) -> bytes:
    # torch.save pickles tensors by value (plain pickle through a multiprocessing queue would share them via
    # shared memory, which dies with the worker); the caller loads onto the CPU.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


# --------------------------------------------------------------------------------------------------------
# the worker


def _worker(local: int, world: int, port: int, backend: str, device_type: str, timeout_s: float,
            fn: Callable, args: tuple, kwargs: dict, results, first_gpu: int = 0, env: dict | None = None,
            std_fds: tuple[int, int] | None = None) -> None:
    global _DEVICE, _SPAWNED
    _SPAWNED = True
    try:
        if env is not None:  # forked: the server's fds 1 and 2 and environment replaced by the caller's
            forking.inherit(std_fds, env)
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(local),
                           "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
        if device_type == "cuda":
            torch.cuda.set_device(first_gpu + local)
            _DEVICE = torch.device("cuda", first_gpu + local)
        else:
            _DEVICE = torch.device("cpu")
            # N ranks on one CPU: share the cores rather than oversubscribing them N times.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        init = dict(backend=backend, rank=local, world_size=world, timeout=_dt.timedelta(seconds=timeout_s))
        if backend == "nccl":
            init["device_id"] = _DEVICE
        dist.init_process_group(**init)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        results.put((local, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), False))
        return
    try:
        out = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        # report before tearing the group down: the teardown makes the other ranks fail too, and the caller
        # should see this error (the cause), not theirs (the consequence)
        results.put((local, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                     _is_communication_error(exc)))
        _sent(results)
        _destroy_quietly()
        return
    # send the result before tearing the group down: a teardown that hangs must not lose it
    try:
        results.put((local, "ok", _to_bytes(out)))
    except BaseException as exc:  # noqa: BLE001 - e.g. an unpicklable return value
        results.put((local, "error", f"cannot send the return value back: {type(exc).__name__}: {exc}",
                     traceback.format_exc(), False))
    _sent(results)
    _destroy_quietly()


def _sent(results) -> None:
    """Wait until what this rank put on the queue is written to its pipe. ``put`` leaves that to a feeder
    thread, which needs the GIL: a teardown that blocks in C++ holding it (NCCL's, with a peer still inside a
    collective) would otherwise keep the report from ever leaving, and the caller would wait for nothing."""
    results.close()
    results.join_thread()


def _destroy_quietly() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may already be broken by a failed peer
        pass


def _is_communication_error(exc: BaseException) -> bool:
    """True for errors that a rank gets because a *peer* failed (closed connections, timeouts)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    text = str(exc)
    return any(k in text for k in ("gloo/transport", "Connection closed by peer", "Connection reset",
                                   "NCCL communicator", "ProcessGroupNCCL", "Socket Timeout"))


# --------------------------------------------------------------------------------------------------------
# the launcher


def launch(fn: Callable, world_size: int, *args, backend: str | None = None, device: str | None = None,
           timeout_s: float = 300, deadline_s: float | None = None, first_gpu: int = 0,
           env: dict[str, str] | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; returns the list of the ranks' return values.

    ``device``: "auto" (default: CUDA when present), "cpu" (gloo) or "cuda" (NCCL, one GPU per rank).
    ``backend``: override ("gloo" also works on GPUs' host processes). ``timeout_s``: the process-group
    timeout in seconds (a collective that waits longer fails). ``deadline_s``: if set, the whole launch
    fails with :class:`WorkerError` (ranks terminated) when it takes longer. Inside ``fn`` use :func:`rank`,
    :func:`world_size` and :func:`device`. Return values come back on the CPU. A failing rank raises
    :class:`WorkerError` here with its traceback, after the other ranks were terminated. ``first_gpu``: rank
    ``r`` drives GPU ``first_gpu + r`` (launches on disjoint GPUs may run side by side from threads).
    ``env``: more environment variables for the ranks, set before they start (so before CUDA reads them:
    ``PYTORCH_CUDA_ALLOC_CONF``, for instance); not for torchrun, whose ranks are already running. Otherwise
    the ranks get this process's environment as it is (NCCL's settings included); only
    :data:`CHILD_DEFAULTS` fill variables the user left unset.
    Under torchrun (env:// variables set) ``fn`` runs in this process only and ``world_size`` must match.
    """
    if is_torchrun():
        if env:
            import warnings

            warnings.warn(f"launch(env=...) is ignored under torchrun (its ranks are already running): set "
                          f"{', '.join(env)} in torchrun's environment", stacklevel=2)
        return _launch_in_torchrun(fn, world_size, args, kwargs, backend, device, timeout_s)
    backend, device_type = resolve_backend(world_size, backend, device)
    cores = os.cpu_count() or 1
    if device_type == "cpu" and world_size > 4 * cores:
        raise ValueError(f"asked for {world_size} CPU ranks on a machine with {cores} cores; at most {4 * cores} "
                         "are allowed (each rank is a full process)")
    _check_picklable(fn)
    if device_type == "cuda" and first_gpu + world_size > torch.cuda.device_count():
        raise ValueError(f"{world_size} ranks from GPU {first_gpu} need GPUs {first_gpu}-{first_gpu + world_size - 1}; "
                         f"this machine has {torch.cuda.device_count()}")

    def rank_args(r: int, port: int, results, *forked) -> tuple:
        return (r, world_size, port, backend, device_type, timeout_s, fn, args, kwargs, results, first_gpu, *forked)

    defaults = {k: v for k, v in CHILD_DEFAULTS.items() if k not in os.environ}
    ranks = None
    if device_type == "cpu":
        with _ENV_LOCK:  # launches from threads must not interleave: environment() changes os.environ for a moment
            child_env = {**os.environ, **defaults, **(env or {})}
            ctx = forking.context(defaults, child_env)
        if ctx is not None:
            try:
                ranks = _start_ranks(ctx, world_size, lambda *a: rank_args(*a, child_env, forking.StdFds()))
            except (OSError, EOFError):  # the server died or cannot be reached: spawn, now and from here on
                forking.broken()
    if ranks is None:
        # The children inherit this environment when they start, before they import torch.
        with _ENV_LOCK, environment({**defaults, **(env or {})}):
            ranks = _start_ranks(mp.get_context("spawn"), world_size, rank_args)
    results, procs = ranks
    values: dict[int, Any] = {}
    started = time.monotonic()
    try:
        dead_since: dict[int, float] = {}
        while len(values) < world_size:
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                missing = [r for r in range(world_size) if r not in values]
                raise WorkerError(missing[0], f"no result after the {deadline_s:.0f} s deadline "
                                              f"(ranks {missing} still running)")
            try:
                item = results.get(timeout=0.2)
            except _queue.Empty:
                item = None
            if item is not None:
                r, status = item[0], item[1]
                if status == "error":
                    raise _root_cause(item, results)
                values[r] = _from_bytes(item[2])
                continue
            # A rank that died without reporting (segfault, killed for memory, NCCL abort): give the queue
            # a moment to deliver what it may have sent just before exiting, then fail.
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in values and p.exitcode is not None:
                    if now - dead_since.setdefault(r, now) > 5.0:
                        raise WorkerError(r, f"process {describe_exit(p.exitcode)} without returning a result "
                                             "(its own output, if any, is above on stderr)")
    finally:
        if len(values) == world_size:  # success: let the ranks finish their teardown on their own
            for p in procs:
                p.join(timeout=30)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world_size)]


def _start_ranks(ctx, world_size: int, rank_args: Callable[[int, int, Any], tuple]) -> tuple:
    """``(results, processes)``: ``world_size`` ranks of :func:`_worker` started from ``ctx`` with the
    arguments ``rank_args(rank, port, results)`` on a fresh port; none left running if one fails to start."""
    results = ctx.Queue()
    port = free_port()
    # not daemonic: a worker may start processes of its own (DataLoader workers, compile workers)
    procs = [ctx.Process(target=_worker, daemon=False, args=rank_args(r, port, results)) for r in range(world_size)]
    started = []
    try:
        for p in procs:
            p.start()
            started.append(p)
    except BaseException:
        for p in started:
            p.kill()
            p.join()
        results.close()
        raise
    return results, procs


def _root_cause(first: tuple, results, grace_s: float = 2.0) -> WorkerError:
    """The error to show the caller: the first one that is not a mere consequence of a peer's failure.

    When one rank raises, its peers soon fail too (their collectives lose a partner); their reports may
    even arrive first, so collect for a moment and prefer an error that is not a communication error.
    """
    errors = [first]
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not any(not e[4] for e in errors):
        try:
            item = results.get(timeout=0.1)
        except _queue.Empty:
            continue
        if item[1] == "error":
            errors.append(item)
    cause = next((e for e in errors if not e[4]), errors[0])
    others = [f"rank {e[0]}: {e[2].splitlines()[0][:160]}" for e in errors if e is not cause]
    message = cause[2] + ("\n(other ranks failed after it: " + "; ".join(others) + ")" if others else "")
    return WorkerError(cause[0], message, cause[3])


def _launch_in_torchrun(fn, world_size, args, kwargs, backend, device, timeout_s) -> list:
    global _DEVICE
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size is not None and world_size != env_world:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}")
    backend, device_type = resolve_backend(env_world, backend, device)
    created = not dist.is_initialized()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
        _DEVICE = torch.device("cuda", local_rank())
    else:
        _DEVICE = torch.device("cpu")
    if created:
        init = dict(backend=backend, init_method="env://", timeout=_dt.timedelta(seconds=timeout_s))
        if backend == "nccl":
            init["device_id"] = _DEVICE
        dist.init_process_group(**init)
    try:
        out = fn(*args, **kwargs)
        gathered: list = [None] * env_world
        dist.all_gather_object(gathered, out)
        return gathered
    finally:
        if created:
            dist.destroy_process_group()
        _DEVICE = None
