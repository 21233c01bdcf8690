"""The environment is the user's: importing lab sets no variable, and the Triton interpreter is switched on
only where an entry point asks for it (``lab.use_triton_interpreter``), once, and never over the user's own
setting. Each case runs in a fresh interpreter, whose environment the test controls."""

import json
import os
import subprocess
import sys

import pytest
import torch

import lab
from lab.paths import REPO_ROOT

NO_GPU = not torch.cuda.is_available()
# prefixes of the variables a library could be tempted to set for its user
WATCHED = ("NCCL_", "TORCH_", "TRITON_", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "GLOO_")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(WATCHED)}
    return {**env, "PYTHONPATH": str(REPO_ROOT), **extra}


def _python(code: str, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_clean_env(**extra), capture_output=True,
                          text=True, timeout=300)


IMPORT_EVERYTHING = """
import json, os, pkgutil, importlib
import torch._dynamo  # torch's own machinery sets TORCHINDUCTOR_CACHE_DIR when it loads: not lab's doing
before = dict(os.environ)
import lab
names = [m.name for m in pkgutil.walk_packages(lab.__path__, "lab.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
after = dict(os.environ)
print(json.dumps({"modules": len(names), "changed": {k: after.get(k) for k in set(before) | set(after)
                                                      if before.get(k) != after.get(k)}}))
"""


def test_importing_every_lab_module_sets_no_environment_variable():
    out = _python(IMPORT_EVERYTHING)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["modules"] > 50  # the walk found the package, not an empty path
    assert report["changed"] == {}


SWITCH = """
import json, os, sys
import lab
first = lab.use_triton_interpreter()
second = lab.use_triton_interpreter()
print(json.dumps([first, second, os.environ.get("TRITON_INTERPRET")]))
"""


@pytest.mark.skipif(not NO_GPU, reason="the interpreter is for machines without a GPU")
def test_interpreter_is_switched_on_when_asked_and_said_once():
    out = _python(SWITCH)
    assert json.loads(out.stdout) == [True, True, "1"]
    assert out.stderr.count(lab.INTERPRETER_NOTICE) == 1 and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value,interpreted", [("0", False), ("1", True)])
def test_the_users_setting_stands_and_nothing_is_said(value, interpreted):
    out = _python(SWITCH, TRITON_INTERPRET=value)
    assert json.loads(out.stdout) == [interpreted, interpreted, value]
    assert out.stderr.strip() == ""


@pytest.mark.skipif(not NO_GPU, reason="the interpreter is for machines without a GPU")
def test_too_late_for_this_process_is_an_error_but_the_processes_it_starts_still_get_it():
    code = """
import json, os, triton
import lab
try:
    lab.use_triton_interpreter()
except RuntimeError as exc:
    print("refused:", exc)
print(json.dumps([os.environ.get("TRITON_INTERPRET"), lab.use_triton_interpreter(this_process=False),
                  os.environ.get("TRITON_INTERPRET")]))
"""
    out = _python(code)
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("refused:") and "before lab.use_triton_interpreter()" in lines[0]
    assert json.loads(lines[1]) == [None, True, "1"]


@pytest.mark.skipif(not NO_GPU, reason="the interpreter is for machines without a GPU")
def test_a_command_line_says_it_ran_triton_interpreted_once_at_the_end():
    """``lab.cli.run`` asks for the interpreter; a refusal stays one line, a run that used Triton says so."""
    code = """
import sys
from lab import cli

def uses_triton(argv):
    if argv:
        raise cli.UsageError("refused")
    import triton  # noqa: F401 - what a kernel's first call does
    print("worked")

sys.exit(cli.run(uses_triton, sys.argv[1:], prog="demo"))
"""
    ok = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_clean_env(), capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip() == "worked"
    assert ok.stderr.strip().splitlines() == [f"demo: {lab.INTERPRETER_NOTICE.removeprefix('lab: ')}"]
    refused = subprocess.run([sys.executable, "-c", code, "bad"], cwd=REPO_ROOT, env=_clean_env(),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == ["demo: error: refused"]


def test_a_lab_command_is_recognised_by_how_it_was_started():
    assert lab.running_a_lab_command(["python", "-m", "lab.bench", "--size", "tiny"])
    assert lab.running_a_lab_command(["python3", "-u", "-m", "lab.fastest"])
    assert not lab.running_a_lab_command(["python", "-m", "pytest", "tests/"])
    assert not lab.running_a_lab_command(["python", "my_script.py", "-m", "x"])
    assert not lab.running_a_lab_command(["python", "-m", "laboratory"])


@pytest.mark.skipif(not NO_GPU, reason="the interpreter is for machines without a GPU")
def test_a_lab_command_runs_the_kernels_interpreted_without_being_told():
    """``python -m lab.bench`` imports the kernels before its main runs: the switch happens as lab is imported by
    a lab command, not later; the run says so once, at the end."""
    out = subprocess.run([sys.executable, "-m", "lab.bench", "--size", "tiny", "--context", "16", "--batch", "1",
                          "--mode", "forward", "--warmup", "0", "--steps", "1", "--attention", "flash_triton",
                          "--device", "cpu"], cwd=REPO_ROOT, env=_clean_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith(lab.INTERPRETER_NOTICE.removeprefix("lab: "))
