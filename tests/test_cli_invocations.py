"""Every command line answers a mistaken invocation in one line, with a non-zero exit and no traceback, before
any work starts (each case runs the real ``python -m`` in a subprocess; all are refused in seconds)."""

import os
import subprocess
import sys

import pytest
import torch

from lab.paths import REPO_ROOT

CORES = os.cpu_count() or 1
NO_GPU = not torch.cuda.is_available()

COLLECTIVES = "lab.bench.collectives"
FLASH_SWEEP = "lab.book.flash.sweep"
CASES = [  # module, argv, whether this machine can tell it is wrong
    ("lab.bench", ["--context", "0"], True),
    ("lab.bench", ["--size", "gigantic"], True),
    ("lab.bench", ["--size", "tiny", "--context", "8", "--device", "cpu", "--results-dir", "/proc/no/such"], True),
    ("lab.bench", ["--size", "tiny", "--context", "10000000", "--device", "cpu"], True),
    (COLLECTIVES, ["--world-sizes", "0"], True),
    (COLLECTIVES, ["--sizes-mb", "-1"], True),
    (COLLECTIVES, ["--device", "cpu", "--world-sizes", str(CORES + 1)], True),
    (COLLECTIVES, ["--device", "cpu", "--world-sizes", "2", "--sizes-mb", "100000000"], CORES >= 2),
    (COLLECTIVES, ["--device", "cpu", "--world-sizes", "2", "--results-dir", "/proc/no/such"], CORES >= 2),
    (COLLECTIVES, ["--device", "cuda"], NO_GPU),
    ("lab.bench.ddp", ["--world-size", "0"], True),
    ("lab.bench.ddp", ["--size", "gigantic"], True),
    ("lab.bench.ddp", ["--device", "cpu", "--world-size", str(CORES + 1)], True),
    ("lab.bench.ddp", ["--device", "cpu", "--world-size", "1", "--size", "10B"], True),
    ("lab.bench.ddp", ["--bucket-sizes-mb", "0"], True),
    ("lab.bench.ddp", ["--device", "cpu", "--world-size", "1", "--size", "tiny", "--results-dir", "/proc/no/such"],
     True),
    ("lab.bench.sharding", ["--world-size", "0"], True),
    ("lab.bench.sharding", ["--sizes", "tiny", "gigantic"], True),
    ("lab.bench.sharding", ["--impls", "zero3"], True),
    ("lab.bench.sharding", ["--rounds", "0"], True),
    ("lab.bench.sharding", ["--device", "cpu", "--world-size", str(CORES + 1), "--sizes", "tiny"], True),
    ("lab.bench.sharding", ["--device", "cpu", "--world-size", "1", "--sizes", "10B"], True),
    ("lab.bench.sharding", ["--device", "cpu", "--world-size", "1", "--sizes", "tiny", "--results-dir",
                            "/proc/no/such"], True),
    ("lab.bench.sharding", ["--device", "cuda", "--sizes", "tiny"], NO_GPU),
    ("lab.fastest", ["--config", "leaderboard", "--device", "cpu"], True),
    ("lab.fastest", ["--config", "tiny", "--device", "cpu", "--world-size", str(CORES + 1)], True),
    ("lab.fastest", ["--config", "tiny", "--device", "cpu", "--results-dir", "/proc/no/such"], CORES >= 2),
    ("lab.fastest", ["--rep-ms", "-1"], True),
    ("lab.render", ["--only", "99"], True),
    ("lab.render", ["-p", "no_such_parameter", "1", "--only", "01"], True),
    ("lab.render", ["--html-only", "--no-html"], True),
    (FLASH_SWEEP, ["sweep", "--shapes", "4x32x512"], True),
    (FLASH_SWEEP, ["sweep", "--variants", "no such variant"], True),
    (FLASH_SWEEP, ["sweep", "--peers", "cudnn"], True),
    (FLASH_SWEEP, ["sweep", "--rep-ms", "0"], True),
    (FLASH_SWEEP, ["sweep", "--workers", "-1"], True),
    (FLASH_SWEEP, ["sweep", "--device", "cpu"], True),  # the defaults are sized for a GPU
    (FLASH_SWEEP, ["course", "--device", "cpu"], True),
    (FLASH_SWEEP, ["check", "--device", "cpu", "--shapes", "1x1x16x16", "--out", "/proc/no/such"], True),
    (FLASH_SWEEP, ["sweep", "--device", "cuda"], NO_GPU),
]


@pytest.mark.parametrize("module,argv", [(m, a) for m, a, wrong in CASES if wrong],
                         ids=[f"{m} {' '.join(a)}" for m, a, wrong in CASES if wrong])
def test_mistake_is_one_line_and_a_nonzero_exit(module, argv):
    out = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    err = out.stderr.strip()
    assert out.returncode != 0
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith(f"python -m {module}: error:"), err
    assert out.stdout.strip() == ""  # refused before anything ran or printed


def test_memory_refusal_names_the_estimate_and_the_change():
    out = subprocess.run([sys.executable, "-m", "lab.bench", "--size", "tiny", "--context", "10000000", "--device",
                          "cpu"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "GiB" in out.stderr and "--context" in out.stderr


def test_flash_sweep_refuses_gpu_sized_work_on_a_cpu_with_the_estimate():
    out = subprocess.run([sys.executable, "-m", FLASH_SWEEP, "sweep", "--device", "cpu"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "tile pairs" in out.stderr and "--shapes" in out.stderr and "--host-shape" in out.stderr


def test_debug_shows_the_traceback():
    out = subprocess.run([sys.executable, "-m", "lab.bench.ddp", "--size", "gigantic", "--debug"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" in out.stderr and "gigantic" in out.stderr
