"""python -m lab.fastest: one-line errors, and the CPU code path end to end on the tiny configuration."""

import pytest
import torch

from lab.fastest import main


@pytest.mark.parametrize("argv,phrase", [(["--config", "huge"], "invalid choice: 'huge'"),
                                         (["--recipes", "turbo", "--device", "cpu", "--config", "tiny"],
                                          "unknown recipe 'turbo'"),
                                         (["--num-layers", "0"], "expected a positive integer")])
def test_bad_input_is_one_line(argv, phrase, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and phrase in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_leaderboard_without_gpus_is_refused(capsys):
    assert main(["--config", "leaderboard"]) == 2
    assert "needs two GPUs" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_stock_step_on_two_cpu_ranks(capsys, tmp_path):
    assert main(["--config", "tiny", "--device", "cpu", "--recipes", "stock_eager", "--no-profile", "--fresh-cache",
                 "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stock_eager" in out and "wall_s" in out and (tmp_path / "fastest_step.csv").exists()


def test_nodes_must_divide_the_ranks(capsys):
    assert main(["--config", "tiny_hsdp", "--device", "cpu", "--gpus-per-node", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "whole nodes" in err, err


@pytest.mark.slow
def test_two_nodes_under_torchrun_as_on_two_machines(tmp_path):
    """The README's two-node command on the CPU: two torchrun agents of two gloo ranks each, one
    rendezvous; rank 0 alone saves the rows, two nodes of two."""
    import subprocess
    import sys

    import pandas as pd

    from lab.parallel.launcher import free_port

    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--node-rank", str(n),
                               "-m", "lab.fastest", "--config", "tiny_hsdp", "--device", "cpu", "--recipes",
                               "stock_eager", "--no-profile", "--results-dir", str(tmp_path / str(n))],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    saved = [tmp_path / str(n) / "fastest_step.csv" for n in (0, 1)]
    assert sum(p.exists() for p in saved) == 1  # the agent that holds rank 0
    row = pd.read_csv(next(p for p in saved if p.exists())).iloc[0]
    assert (row["world_size"], row["nodes"], row["status"]) == (4, 2, "ok") and row["across_node_bytes"] > 0
