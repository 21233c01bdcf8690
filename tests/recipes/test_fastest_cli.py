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
