"""Where a measurement ran: the host's CPU model and what else ran beside it."""

import subprocess
import sys
import time

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
