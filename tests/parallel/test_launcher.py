"""The launcher: values come back per rank, errors come back with the worker's message, ports are reused."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from lab.parallel import launcher as distributed


# Worker functions live at module level so spawned processes can import them by reference.
def _rank_report(offset):
    t = torch.tensor([float(distributed.rank() + 1)])
    dist.all_reduce(t)
    return {"rank": distributed.rank(), "world": distributed.world_size(), "device": str(distributed.device()),
            "sum": t.item() + offset, "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
            "tensor": torch.arange(3) * distributed.rank(), "extra": os.environ.get("LAB_TEST_EXTRA")}


def _fail_on_rank_one(message):
    if distributed.rank() == 1:
        raise ValueError(message)
    # rank 0 waits in a collective that rank 1 never joins: the launcher must not hang here
    t = torch.zeros(1)
    dist.all_reduce(t)
    return "unreachable"


def _killed_on_rank_one():
    if distributed.rank() == 1:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does
    import time

    time.sleep(60)
    return distributed.rank()


def _sleep_on_rank_one(seconds):
    if distributed.rank() == 1:
        import time

        time.sleep(seconds)
    return distributed.rank()


def test_results_per_rank_and_back_to_back_launches(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    for offset in (0.0, 100.0):  # a second launch right after the first needs a fresh port and group
        out = distributed.launch(_rank_report, 2, offset, device="cpu")
        assert [o["rank"] for o in out] == [0, 1]
        assert all(o["world"] == 2 and o["device"] == "cpu" and o["nvls"] is None for o in out)
        assert all(o["sum"] == 3.0 + offset for o in out)  # 1 + 2, all-reduced
        assert torch.equal(out[1]["tensor"], torch.tensor([0, 1, 2]))
        assert [o["extra"] for o in out] == [None, None]
    out = distributed.launch(_rank_report, 2, 0.0, device="cpu", env={"LAB_TEST_EXTRA": "on"})
    assert [o["extra"] for o in out] == ["on", "on"] and "LAB_TEST_EXTRA" not in os.environ  # the ranks' only


def _environment(names):
    return {name: os.environ.get(name) for name in names}


NCCL_SWITCHES = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def test_spawned_ranks_get_the_users_environment_as_it_is(monkeypatch):
    """No NCCL or torch switch the user did not set; what the user set (NCCL's, or torch's logging) stands."""
    for name in NCCL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    names = (*NCCL_SWITCHES, "TORCH_CPP_LOG_LEVEL")
    out = distributed.launch(_environment, 2, names, device="cpu")
    # the one default: torch's C++ logging at errors only, where the user chose no level
    assert out == [{"NCCL_NVLS_ENABLE": None, "TORCH_SYMM_MEM_DISABLE_MULTICAST": None,
                    "TORCH_CPP_LOG_LEVEL": "ERROR"}] * 2
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    out = distributed.launch(_environment, 2, names, device="cpu")
    assert out == [{"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": None,
                    "TORCH_CPP_LOG_LEVEL": "INFO"}] * 2
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"  # and this process's own environment is as it was


def _forked_and_environment(names):
    import multiprocessing.forkserver

    return multiprocessing.forkserver.get_inherited_fds() is not None, _environment(names)


# CPU ranks are forks of a forkserver on Linux (elsewhere spawned)
FORKED = sys.platform.startswith("linux")


def test_forked_ranks_get_the_environment_as_it_is_at_the_launch(monkeypatch):
    """A variable set after the forkserver started (at the first launch, here or in an earlier test) reaches
    the ranks: they take the caller's environment, not the server's."""
    monkeypatch.delenv("LAB_TEST_LATE", raising=False)
    names = ("LAB_TEST_LATE",)
    out = distributed.launch(_forked_and_environment, 2, names, device="cpu")  # the server runs from here on
    assert out == [(FORKED, {"LAB_TEST_LATE": None})] * 2
    monkeypatch.setenv("LAB_TEST_LATE", "set after the server started")
    out = distributed.launch(_forked_and_environment, 2, names, device="cpu")
    assert out == [(FORKED, {"LAB_TEST_LATE": "set after the server started"})] * 2


def test_a_variable_torch_reads_as_it_is_imported_gets_spawned_ranks():
    """The forkserver imported torch without this variable (its name is one torch may read then): ranks that
    must see it are fresh interpreters."""
    out = distributed.launch(_forked_and_environment, 2, ("TORCH_LAB_TEST",), device="cpu",
                             env={"TORCH_LAB_TEST": "1"})
    assert out == [(False, {"TORCH_LAB_TEST": "1"})] * 2 and "TORCH_LAB_TEST" not in os.environ


def _speaks(words):
    """``words`` (if any) on stdout through Python and on fd 2 directly (as C++ code writes); whether this rank
    is a fork of a forkserver."""
    import multiprocessing.forkserver

    if words:
        print(f"{words} on stdout from rank {distributed.rank()}", flush=True)
        os.write(2, f"{words} on fd 2 from rank {distributed.rank()}\n".encode())
    return multiprocessing.forkserver.get_inherited_fds() is not None


def test_ranks_write_where_the_callers_fds_1_and_2_go_at_the_launch(capfd):
    """A forked rank's fds 1 and 2 are the caller's at the launch (here capfd's files), not the forkserver's,
    which it inherited when it started: here, before capfd took fds 1 and 2 (capture off), or in an earlier
    test, with that test's capture."""
    with capfd.disabled():
        assert distributed.launch(_speaks, 2, "", device="cpu") == [FORKED] * 2  # the server runs from here on
    assert distributed.launch(_speaks, 2, "heard", device="cpu") == [FORKED] * 2
    out, err = capfd.readouterr()
    for r in (0, 1):
        assert f"heard on stdout from rank {r}" in out and f"heard on fd 2 from rank {r}" in err


def test_under_torchrun_the_environment_is_left_alone(monkeypatch):
    """Under torchrun the rank is this very process: the launcher joins its group and changes no variable."""
    for name in NCCL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(distributed.free_port())).items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    assert distributed.launch(_environment, 1, NCCL_SWITCHES, device="cpu") == [dict.fromkeys(NCCL_SWITCHES)]
    assert dict(os.environ) == before


def test_worker_exception_reaches_caller_with_message():
    with pytest.raises(distributed.WorkerError) as info:
        distributed.launch(_fail_on_rank_one, 2, "boom from the worker", device="cpu", timeout_s=60)
    assert info.value.rank == 1
    assert "boom from the worker" in str(info.value)
    assert "_fail_on_rank_one" in info.value.worker_traceback


def test_more_ranks_than_gpus_is_a_clear_error():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(RuntimeError, match=f"has {gpus} GPU"):
        distributed.launch(_rank_report, gpus + 1, 0.0, device="cuda")


def test_bad_arguments():
    with pytest.raises(ValueError, match="device"):
        distributed.launch(_rank_report, 2, 0.0, device="tpu")
    with pytest.raises(ValueError, match="picklable"):
        distributed.launch(lambda: 1, 2, device="cpu")
    assert distributed.resolve_backend(2, device="cpu") == ("gloo", "cpu")


def test_helpers_outside_a_process_group():
    assert distributed.rank() == 0 and distributed.world_size() == 1
    assert distributed.device() == torch.device("cpu")


def test_root_cause_is_preferred_over_peer_failures():
    import queue

    q = queue.Queue()
    q.put((1, "error", "ValueError: the real problem", "tb of rank 1", False))
    first = (0, "error", "RuntimeError: gloo/transport: Connection closed by peer", "tb of rank 0", True)
    err = distributed._root_cause(first, q, grace_s=0.5)
    assert err.rank == 1 and "the real problem" in str(err) and "Connection closed" in str(err)
    assert distributed._is_communication_error(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error"))
    assert not distributed._is_communication_error(ValueError("boom"))


def test_deadline_stops_a_stuck_launch():
    import time

    start = time.monotonic()
    with pytest.raises(distributed.WorkerError, match="deadline") as info:
        distributed.launch(_sleep_on_rank_one, 2, 300, device="cpu", deadline_s=20)
    assert info.value.rank == 1 and time.monotonic() - start < 120


def test_a_killed_worker_says_how_it_died():
    with pytest.raises(distributed.WorkerError, match="killed by SIGKILL .likely out of memory") as info:
        distributed.launch(_killed_on_rank_one, 2, device="cpu", deadline_s=50)
    assert info.value.rank == 1


def _raises_then_teardown_blocks_holding_the_gil():
    import ctypes

    # as NCCL's teardown does with a peer still inside a collective: a C call that keeps the GIL
    distributed._destroy_quietly = lambda: ctypes.PyDLL(None).sleep(40)
    raise RuntimeError(f"out of memory on rank {distributed.rank()}")


def test_an_error_reaches_the_caller_though_the_teardown_blocks():
    import time

    start = time.monotonic()
    with pytest.raises(distributed.WorkerError, match="out of memory on rank"):
        distributed.launch(_raises_then_teardown_blocks_holding_the_gil, 2, device="cpu", deadline_s=30)
    assert time.monotonic() - start < 25  # the report left before the teardown, not at the process's exit


def test_too_many_cpu_ranks_are_refused():
    with pytest.raises(ValueError, match="CPU ranks on a machine with"):
        distributed.launch(_rank_report, 4 * (os.cpu_count() or 1) + 1, 0.0, device="cpu")
