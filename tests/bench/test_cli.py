"""Every mistaken invocation of ``python -m lab.bench`` costs one line: what was wrong, what is accepted."""

import json
import subprocess
import sys

import pytest
import torch

from lab.bench.cli import main
from lab.paths import REPO_ROOT

TINY = ["--d-model", "32", "--d-ff", "64", "--num-layers", "1", "--num-heads", "4", "--vocab-size", "64"]

BAD = [  # argv, a phrase the one line must contain
    (["--context", "-5"], "expected a positive integer, got -5"),
    (["--context", "abc"], "expected a positive integer, got 'abc'"),
    (["--steps", "0"], "expected a positive integer, got 0"),
    (["--warmup", "-1"], "expected an integer >= 0"),
    (["--attention", "flashy"], "invalid choice: 'flashy'"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--mode", "inference"], "invalid choice: 'inference'"),
    (["--size", "gigantic"], "unknown model size 'gigantic'"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--d-model", "32"], "go together"),
    (["--d-model", "30", "--d-ff", "64", "--num-layers", "1", "--num-heads", "4"], "not divisible"),
]
if not torch.cuda.is_available():
    BAD.append((["--device", "cuda"], "this machine has no CUDA GPU"))
    BAD.append((["--size", "10B", "--device", "cpu"], "needs about"))


@pytest.mark.parametrize("argv,phrase", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_a_nonzero_exit(argv, phrase, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert phrase in err and "Traceback" not in err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="unknown device"):
        main(["--device", "gpu", "--debug"])


def test_cli_json_and_results(tmp_path, capsys):
    code = main([*TINY, "--context", "8", "16", "--mode", "forward", "--warmup", "0", "--steps", "2",
                 "--device", "cpu", "--json", "--results-dir", str(tmp_path)])
    assert code == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
    assert [r["context"] for r in lines] == [8, 16]
    assert all(len(r["fwd_samples_ms"]) == 2 for r in lines)
    assert (tmp_path / "lm_step.csv").exists()


def test_python_dash_m_prints_one_line():
    out = subprocess.run([sys.executable, "-m", "lab.bench", "--context", "-5"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("python -m lab.bench: error:")
