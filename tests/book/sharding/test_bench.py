"""lab.book.sharding.bench: what notebook 08 measures in each profile."""

import pytest
import torch

from lab.bench import sharding
from lab.book.sharding import bench as sharding_bench


def test_plan_run_profiles():
    quick = sharding_bench.plan_run(True)
    assert quick.device == "cpu" and quick.sizes == ("tiny",) and quick.context == 64 and "Quick" in quick.note
    assert quick.interleaving.steps_per_round == 1 and quick.interleaving.rounds >= 5 and quick.impls == sharding.IMPLS
    assert quick.params()["rounds"] == quick.interleaving.rounds
    custom = sharding_bench.plan_run(True, sizes=["small"], context=128, rounds=7, warmup=0, schedule="rebuild")
    assert (custom.sizes, custom.context, custom.interleaving.rounds, custom.warmup) == (("small",), 128, 7, 0)
    if torch.cuda.device_count() < 2:
        assert "needs 2 GPUs" in sharding_bench.plan_run(False).note


def test_expected_state_table():
    table = sharding_bench.plan_run(True, impls=("ddp", "fsdp")).expected_state().set_index("impl")
    assert table.loc["ddp", "params_M"] == pytest.approx(1.411392)
    assert table.loc["fsdp", "total_gib"] == pytest.approx(table.loc["ddp", "total_gib"] / 2)
