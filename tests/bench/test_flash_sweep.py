"""lab.bench.flash_sweep: the command line's shapes, and its refusal of work sized for a GPU on a CPU (the
invocations themselves: tests/test_cli_invocations.py)."""

import pytest

from lab import cli
from lab.bench import flash_sweep as sweep
from lab.bench.attention_grid import Shape


def test_parse_shape_and_its_errors():
    assert sweep.parse_shape("4x32x512x80") == (Shape(4, 32, 512, 80, True), "bf16")
    assert sweep.parse_shape("2x16x4096x64:fp16:full") == (Shape(2, 16, 4096, 64, False), "fp16")
    for bad in ("4x32x512", "4x32x512x80:int8", "axbxcxd", "0x1x16x16"):
        with pytest.raises(ValueError, match="bad shape"):
            sweep.parse_shape(bad)


def test_tile_pairs_and_the_cpu_refusal():
    assert sweep.tile_pairs(Shape(1, 1, 128, 64)) == 3  # 2 query tiles: 1 + 2 causal pairs
    assert sweep.tile_pairs(Shape(2, 3, 128, 64, False)) == 24
    assert sweep.tile_pairs(Shape(1, 32, 32768, 128)) == 32 * 512 * 513 // 2
    sweep.refuse_cpu_work([Shape(2, 3, 1100, 80)], "check")  # small enough: nothing refused
    with pytest.raises(cli.UsageError, match="4,202,496 tile pairs.*--shapes"):
        sweep.refuse_cpu_work([Shape(2, 3, 1100, 80), Shape(1, 32, 32768, 128)], "sweep")
    with pytest.raises(cli.UsageError, match="GPU"):
        sweep.refuse_cpu_work([sweep.COURSE_SHAPE], "course")
