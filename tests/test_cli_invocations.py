"""Every command line answers a mistaken invocation in one line, with a non-zero exit and no traceback, before
any work starts. The refusals run as ``python -m`` runs them (``runpy``, ``__name__ == "__main__"``), each with
its own argv, environment and file descriptors 1 and 2 captured (so that a C++ warning or a stray print counts),
all in one interpreter: one start of Python and torch instead of one per case. Training and torchrun run in
processes of their own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lab.parallel.launcher import free_port
from lab.paths import REPO_ROOT

CORES = os.cpu_count() or 1
NO_GPU = not torch.cuda.is_available()

COLLECTIVES = "lab.bench.collectives"
FLASH_SWEEP = "lab.bench.flash_sweep"
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
    ("lab.fastest", ["--busy-host", "-1"], True),
    ("lab.render", ["--only", "99"], True),
    ("lab.render", ["-p", "no_such_parameter", "1", "--only", "01"], True),
    ("lab.render", ["--html-only", "--no-html"], True),
    ("lab.render", ["--resume", "-p", "replay", "True", "--only", "01"], True),
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


# Runs each invocation of a JSON list read from stdin (["module" or "path", target, argv]) as the interpreter
# would run it, and prints one JSON result per invocation: its exit code and what it wrote to fds 1 and 2.
DRIVER = textwrap.dedent("""
    import json, os, runpy, sys, tempfile, traceback
    results = []
    for kind, target, argv in json.load(sys.stdin):
        env, code = dict(os.environ), 0
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush(); sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            sys.argv = [target, *argv]
            try:
                if kind == "module":
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                code = 1
                traceback.print_exc()
            finally:
                sys.stdout.flush(); sys.stderr.flush()
                os.dup2(saved[0], 1); os.dup2(saved[1], 2)
                os.close(saved[0]); os.close(saved[1])
            os.environ.clear(); os.environ.update(env)
            out.seek(0); err.seek(0)
            results.append(dict(code=code, stdout=out.read().decode(errors="replace"),
                                stderr=err.read().decode(errors="replace")))
    print(json.dumps(results))
""")


def run_in_one_interpreter(invocations: list[tuple[str, str, list[str]]]) -> list[dict]:
    """Each ``(kind, target, argv)`` run by :data:`DRIVER` in one fresh interpreter, in order."""
    out = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(invocations), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def refused():
    """The outcome of every refusal case of this module, keyed by (target, argv): one interpreter for all."""
    cases = [("module", m, a) for m, a, wrong in CASES if wrong] + [("path", EXAMPLE, a) for a, _ in EXAMPLE_CASES]
    cases += [("module", "lab.bench.ddp", DEBUG_ARGV)]
    return {(target, tuple(argv)): r for (_, target, argv), r in zip(cases, run_in_one_interpreter(cases))}


@pytest.mark.parametrize("module,argv", [(m, a) for m, a, wrong in CASES if wrong],
                         ids=[f"{m} {' '.join(a)}" for m, a, wrong in CASES if wrong])
def test_mistake_is_one_line_and_a_nonzero_exit(module, argv, refused):
    out = refused[(module, tuple(argv))]
    err = out["stderr"].strip()
    assert out["code"] != 0
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith(f"python -m {module}: error:"), err
    assert out["stdout"].strip() == ""  # refused before anything ran or printed


def test_the_driver_sees_what_a_process_would_show(tmp_path):
    """What a case prints, writes straight to file descriptor 2 (as C++ code does) or exits with is seen as a
    process of its own would see it; the environment a case changes is restored for the next case."""
    script = tmp_path / "probe.py"
    script.write_text("import os, sys\n"
                      "print('PROBE was', os.environ.get('PROBE'))\n"
                      "os.environ['PROBE'] = 'set'\n"
                      "os.write(2, b'fd two\\n')\n"
                      "sys.exit('said ' + ' '.join(sys.argv[1:]))\n")
    first, second = run_in_one_interpreter([("path", str(script), ["a", "b"]), ("path", str(script), ["c"])])
    assert first == dict(code=1, stdout="PROBE was None\n", stderr="fd two\nsaid a b\n")
    assert second == dict(code=1, stdout="PROBE was None\n", stderr="fd two\nsaid c\n")


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
def test_example_refuses_a_mistake_in_one_line(argv, phrase, refused):
    out = refused[(EXAMPLE, tuple(argv))]
    err = out["stderr"].strip()
    assert out["code"] == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("examples/train_parallel.py: error:") and phrase in err, err
    assert out["stdout"].strip() == ""


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


def test_memory_refusal_names_the_estimate_and_the_change(refused):
    out = refused[("lab.bench", ("--size", "tiny", "--context", "10000000", "--device", "cpu"))]
    assert out["code"] == 2
    assert "GiB" in out["stderr"] and "--context" in out["stderr"]


def test_flash_sweep_refuses_gpu_sized_work_on_a_cpu_with_the_estimate(refused):
    out = refused[(FLASH_SWEEP, ("sweep", "--device", "cpu"))]
    assert out["code"] == 2
    assert "tile pairs" in out["stderr"] and "--shapes" in out["stderr"] and "--host-shape" in out["stderr"]


DEBUG_ARGV = ["--size", "gigantic", "--debug"]


def test_debug_shows_the_traceback(refused):
    out = refused[("lab.bench.ddp", tuple(DEBUG_ARGV))]
    assert out["code"] != 0 and "Traceback" in out["stderr"] and "gigantic" in out["stderr"]
