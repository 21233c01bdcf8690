"""lab.bench.distributed: what the data-parallel benchmarks share (where a run goes, its rounds, its model, the
checks a command line makes before any rank starts)."""

import pytest
import torch

from lab import cli
from lab.bench import distributed
from lab.model import ModelConfig


def test_where_to_run_says_which_and_why():
    assert distributed.where_to_run(True, "auto", 2, gpus=8) == (False, "Quick profile: a tiny model on 2 CPU "
                                                                        "processes with gloo.")
    assert distributed.where_to_run(False, "auto", 2, gpus=2) == (True, "Full profile: 2 GPUs with NCCL.")
    on_gpu, note = distributed.where_to_run(False, "cpu", 2, gpus=8)
    assert not on_gpu and "device='cpu' was asked for" in note
    on_gpu, note = distributed.where_to_run(False, "auto", 4, gpus=2)
    assert not on_gpu and "needs 4 GPUs" in note and "2 GPU(s)" in note


def test_profiles_give_enough_rounds_for_a_verdict():
    for on_gpu in (True, False):
        plan = distributed.profile_interleaving(on_gpu)
        assert plan.rounds >= 5  # lab.measure.verdicts.MIN_SAMPLES
    assert distributed.profile_interleaving(False, rounds=7, warmup=0, schedule="rebuild").params() == dict(
        rounds=7, steps_per_round=1, warmup=0, schedule="rebuild")


def test_model_config_of_a_name_or_a_config():
    name, cfg = distributed.model_config("tiny", 48)
    assert name == "tiny" and cfg.context_length == 48
    custom = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, context_length=16, vocab_size=64)
    assert distributed.model_config(custom, 8) == ("custom", ModelConfig(**{**custom.__dict__, "context_length": 8}))


def test_command_checks_refuse_mistakes_before_anything_runs(tmp_path):
    assert distributed.check_command(["tiny"], 16, 2, "fp32", 1, "cpu", results_dir=str(tmp_path)) == "cpu"
    with pytest.raises(cli.UsageError, match="gigantic"):
        distributed.check_command(["tiny", "gigantic"], 16, 2, "fp32", 1, "cpu")
    with pytest.raises(cli.UsageError, match="--results-dir"):
        distributed.check_command(["tiny"], 16, 2, "fp32", 1, "cpu", results_dir="/proc/no/such")
    with pytest.raises(cli.UsageError, match="GiB"):
        distributed.check_command(["10B"], 512, 2, "fp32", 1, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(cli.UsageError):
            distributed.check_command(["tiny"], 16, 2, "fp32", 2, "cuda")
