"""lab.book.memory.workload: the 03 notebook's configuration and what follows from it in closed form."""

import math

import pytest

from lab.book.memory import workload as ms


def test_setup_defaults_follow_the_profile():
    full = ms.MemorySetup.resolve(quick=False)
    assert (full.size, full.model.d_model, full.model.num_layers) == ("2.7B", 2560, 32)
    assert full.peak_contexts == (128, 256, 512, 2048) and full.timeline_context == 512
    assert full.checkpoint_context == full.block_context == 2048 and full.model.context_length == 2048
    assert full.checkpoint_group_sizes == (None, 1, 2, 4, 8, 16, 32)
    quick = ms.MemorySetup.resolve(quick=True, block_context=32)
    assert quick.size == "mini" and quick.block_context == 32 and quick.checkpoint_context == 64
    assert quick.checkpoint_group_sizes == (None, 1, 2, 4)
    assert quick.peak_contexts == (32, 64) and quick.model.d_model == 128 and quick.timing_steps == 5
    with pytest.raises(ValueError, match="training dtype"):
        ms.MemorySetup.resolve(quick=True, dtype="fp8")


def test_sizes_derived_from_the_setup():
    s = ms.MemorySetup.resolve(quick=False)
    # 4 x 2048 x 2560 x 4 bytes = 80 MiB; parameters from the closed form, 4 bytes each
    assert s.residual_bytes(2048) == 80 * 2**20
    assert s.parameter_bytes == 4 * 3_406_809_600
    table = ms.residual_stream_table(s)
    assert table["context"].tolist() == [128, 256, 512, 2048]
    assert table["residual_mib"].tolist() == [5, 10, 20, 80]
    assert table["all_block_inputs_mib"].iloc[-1] == 32 * 80


def test_checkpoint_model_scales_the_block_to_the_checkpoint_context():
    s = ms.MemorySetup.resolve(quick=False, block_context=1024)
    model = ms.checkpoint_model(s, block_saved_bytes=2**30, block_context=1024)
    r, a = 80 * 2**20, 2 * 2**30  # A measured at 1024 tokens doubles at 2048
    assert model["boundary_bytes"].iloc[0] == r and model["block_bytes"].iloc[0] == a
    assert model["k_star"].iloc[0] == pytest.approx(math.sqrt(32 * r / a))
    none = model[model["strategy"] == "none"]["modelled_bytes"].item()
    assert none == 32 * a
    k4 = model[(model["strategy"] == "single") & (model["group_size"] == 4)]["modelled_bytes"].item()
    assert k4 == 8 * r + 4 * a
