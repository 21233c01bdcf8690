"""Every command line answers a mistaken invocation in one line, with a non-zero exit and no traceback, before
any work starts (each case runs the real ``python -m`` in a subprocess; all are refused in seconds)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lab.parallel.launcher import free_port
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


EXAMPLE = str(REPO_ROOT / "examples" / "train_parallel.py")
EXAMPLE_CASES = [  # argv, a phrase of the refusal
    (["--batch", "5"], "--batch 5 does not divide among 2 ranks"),  # once trained silently on 4 of the 5
    (["--batch", "3", "--world-size", "2"], "use a multiple of 2, e.g. --batch 2"),
    (["--world-size", str(CORES + 1), "--batch", str(CORES + 1)], f"needs {CORES + 1} ranks"),
    (["--steps", "0"], "expected a positive integer"),
    (["--wrapper", "zero"], "invalid choice: 'zero'"),
    (["--steps", "100000000"], "GiB on this machine"),  # the global batch alone would not fit
    (["--steps", "1000000"], "minutes on"),  # hours of CPU: refused with the estimate
]


@pytest.mark.parametrize("argv,phrase", EXAMPLE_CASES, ids=[" ".join(a) for a, _ in EXAMPLE_CASES])
def test_example_refuses_a_mistake_in_one_line(argv, phrase):
    out = subprocess.run([sys.executable, EXAMPLE, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("examples/train_parallel.py: error:") and phrase in err, err
    assert out.stdout.strip() == ""


def test_example_trains_when_asked_right():
    out = subprocess.run([sys.executable, EXAMPLE, "--wrapper", "ddp_bucketed", "--steps", "2", "--batch", "2"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and len(result["losses"]) == 2 and result["checksum"] > 0


@pytest.mark.skipif(CORES < 2, reason="torchrun with 2 CPU ranks")
def test_under_torchrun_the_refusal_is_said_once_and_is_torchruns_root_cause():
    """Each rank refuses the same arguments: rank 0 says it, and torchrun's failure report names that line as
    the root cause instead of pointing at a traceback."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), EXAMPLE, "--batch", "3"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    refusal = "examples/train_parallel.py: error: --batch 3 does not divide among 2 ranks"
    assert out.returncode != 0
    said = [line for line in out.stderr.splitlines() if line.startswith(refusal)]
    assert len(said) == 1, out.stderr  # rank 0's line; the report below quotes it for each failed rank
    root_cause = out.stderr[out.stderr.index("Root Cause"):]
    assert refusal in root_cause and "To enable traceback" not in root_cause, root_cause


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
