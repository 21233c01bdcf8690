"""Where a measurement ran: the host's CPU model and what else ran beside it."""

import os
import subprocess
import sys
import time

import pytest

from lab.measure import machine


def test_host_cpu_and_gpu_model_are_named():
    assert machine.host_cpu() and "\n" not in machine.host_cpu()
    assert machine.gpu_model() == "cpu" or machine.gpu_count() >= 1


def test_a_busy_process_beside_us_is_a_neighbour_and_our_own_children_are_not():
    spin = "import time\nend = time.time() + 5\nwhile time.time() < end: pass"
    # started in a new session by a shell that exits at once: the spinner is no child of ours
    outside = subprocess.Popen(["setsid", sys.executable, "-c", spin], start_new_session=True)
    time.sleep(0.3)
    try:
        found = machine.neighbours(sample_s=0.5)
        assert any(f"pid {outside.pid})" in n for n in found) or any("python" in n for n in found)
    finally:
        outside.kill()
    child = subprocess.Popen([sys.executable, "-c", spin])
    time.sleep(0.3)
    try:
        assert not any(f"pid {child.pid})" in n for n in machine.neighbours(sample_s=0.5))
    finally:
        child.kill()


def test_busy_host_keeps_cores_busy_and_stops_them():
    from lab.measure.machine import _cpu_ticks

    with machine.busy_host(2, mib=1) as pids:
        assert len(pids) == 2
        time.sleep(0.2)
        before = _cpu_ticks()
        time.sleep(1.0)
        after = _cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        busy = [(after[p][1] - before[p][1]) / hz for p in pids]
        # each spins: a sleeping process takes no CPU time at all, a spinning one some even on a loaded host
        # (a share of two cores with a test suite beside it, a tenth of a core or less at worst)
        assert all(b >= 0.02 for b in busy), busy
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
    with machine.busy_host(0) as none:
        assert none == []
    with pytest.raises(ValueError):
        with machine.busy_host(-1):
            pass


def test_a_neighbour_stops_when_its_parent_is_killed_outright():
    """torchrun ends a rank with a signal that runs no cleanup: the rank's neighbours must not spin on."""
    import signal

    code = ("import time\nfrom lab.measure.machine import busy_host\n"
            "with busy_host(1, mib=1) as pids:\n    print(pids[0], flush=True)\n    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    spinner = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()

    def spinning() -> bool:
        try:
            return open(f"/proc/{spinner}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    deadline = time.time() + 5
    while spinning() and time.time() < deadline:
        time.sleep(0.05)
    assert not spinning()
