"""Head dimensions split in two power-of-two column chunks (``FlashConfig.split_d``) against float64 attention.

On the CPU the kernels run interpreted (16 x 16 tiles, small shapes); the GPU-marked tests cover compiled
bf16 kernels on the tiles of the tables, up to the long-sequence ones.
"""

import pytest
import torch

from tests.kernels.test_flash_triton import DEVICE, check_against_reference, random_qkv

ft = pytest.importorskip("lab.kernels.flash_triton")
fc = pytest.importorskip("lab.kernels.flash_config")
fwd = pytest.importorskip("lab.kernels.flash_triton_forward")
bwd = pytest.importorskip("lab.kernels.flash_triton_backward")

SPLIT = ft.FlashConfig(split_d="on")


def test_split_widths_cover_d_with_fewer_columns_than_one_padded_tile():
    """Two powers of two (the second at least 16, the smallest ``tl.dot``) that sum to d exactly, or the padded
    tile alone where d has no such cut (a second chunk wider than its columns is never made)."""
    assert fc.split_widths(80) == (64, 16) and fc.split_widths(96) == (64, 32) and fc.split_widths(48) == (32, 16)
    assert fc.split_widths(160) == (128, 32) and fc.split_widths(144) == (128, 16)
    for d in (8, 16, 24, 40, 56, 64, 112, 128, 256):  # powers of two, or no exact cut (40 = 32 + 8, 112 = 64 + 48)
        assert fc.split_widths(d) == (fc.block_d(d), 0), d
    for d in range(8, fc.MAX_HEAD_DIM + 1, 8):
        first, second = fc.split_widths(d)
        if second:
            assert first & (first - 1) == 0 and second & (second - 1) == 0 and second >= 16, d
            assert first + second == d < fc.block_d(d), d


def test_split_d_follows_the_config_and_is_validated():
    assert fc.head_chunks(80, torch.bfloat16, "fwd", 64, 64, SPLIT) == (64, 16)
    assert fc.head_chunks(80, torch.bfloat16, "bwd", 64, 64, ft.FlashConfig(split_d="off")) == (128, 0)
    assert fc.head_chunks(64, torch.bfloat16, "fwd", 64, 64, SPLIT) == (64, 0)
    assert fc.head_chunks(80, torch.float32, "fwd", 64, 64) == (128, 0)  # interpreted, "auto" never splits
    with pytest.raises(ValueError, match="split_d"):
        ft.FlashConfig(split_d="yes")


SPLIT_CASES = [  # lead dims, n_q, n_k, d, causal, dtype, tol: ragged lengths, n_q != n_k both ways
    (2, 37, 53, 80, True, torch.float32, 2e-5),
    ((1, 2), 45, 29, 96, True, torch.float32, 2e-5),
    (2, 29, 45, 96, False, torch.float32, 2e-5),
    (2, 37, 21, 48, True, torch.float32, 2e-5),  # 32 + 16 columns
    (1, 21, 37, 160, False, torch.float32, 2e-5),
    (2, 37, 53, 80, False, torch.float16, 2e-2),
    (2, 45, 29, 48, True, torch.bfloat16, 6e-2),
]


@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype,tol", SPLIT_CASES)
def test_split_head_dims_match_float64_reference(lead, n_q, n_k, d, causal, dtype, tol):
    q, k, v = random_qkv(lead, n_q, n_k, d, dtype=dtype, seed=d)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=tol, rtol=tol, config=SPLIT)


VARIANTS = [SPLIT.replace(backward_launch=mode) for mode in ("fused", "two_pass")]


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.backward_launch)
def test_split_backward_variants_match_reference(config):
    """Every launch mode, square and rectangular tiles: (batch, heads) inputs at d = 80 with ragged lengths."""
    q, k, v = random_qkv((2, 2), 45, 29, 80, seed=3)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, True, atol=2e-5, rtol=2e-5, config=config)
    tiles = config.replace(fwd_tiles=(32, 16, 4, 1), bwd_tiles=(16, 32, 32, 16, 4, 1))
    check_against_reference(ft.FlashAttentionTriton, q, k, v, False, atol=2e-5, rtol=2e-5, config=tiles)


def test_split_and_padded_tiles_agree():
    """The same sums over d, cut differently: equal up to fp32 rounding."""
    q, k, v = (t.detach() for t in random_qkv(1, 40, 40, 80, seed=9))
    padded = ft.flash_forward(q, k, v, True, ft.FlashConfig(split_d="off"))
    split = ft.flash_forward(q, k, v, True, SPLIT)
    for a, b in zip(padded, split):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96, 48])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lead,n", [((2, 3), 300), ((1, 4), 1100)], ids=["short", "long"])
def test_gpu_split_head_dims_match_float64_reference(d, causal, lead, n):
    """bf16, split on, the tables' tiles (1100 tokens: the large tiles of long sequences)."""
    q, k, v = random_qkv(lead, n, n, d, dtype=torch.bfloat16, device=DEVICE, seed=d)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=3e-2, rtol=3e-2, config=SPLIT)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SPLIT.replace(backward_launch="fused"),
                                    SPLIT.replace(backward_launch="two_pass"),
                                    SPLIT.replace(fwd_tiles=(128, 128, 8, 3), bwd_tiles=(128, 128, 128, 128, 8, 2))],
                         ids=["fused", "two_pass", "big-tiles"])
def test_gpu_split_variants_match_float64_reference(config):
    q, k, v = random_qkv((1, 4), 1100, 1100, 80, dtype=torch.bfloat16, device=DEVICE)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, True, atol=3e-2, rtol=3e-2, config=config)


def test_auto_splits_only_where_measured_faster(monkeypatch):
    """On a GPU, ``"auto"`` splits 16-bit d = 80 and 96: the forward always, the backward on long sequences,
    whose table then runs two passes on 64 x 64 tiles; fp32, d = 40 and the padded-tile config do not split."""
    monkeypatch.setattr(fc, "INTERPRET", False)
    monkeypatch.setattr(fc, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for d, chunks in ((80, (64, 16)), (96, (64, 32))):
        assert fc.head_chunks(d, torch.bfloat16, "fwd", 4096, 4096) == chunks
        assert fc.head_chunks(d, torch.float16, "bwd", 4096, 4096) == chunks
        assert fc.head_chunks(d, torch.bfloat16, "fwd", 512, 512) == chunks
        assert fc.head_chunks(d, torch.bfloat16, "bwd", 512, 512) == (128, 0)
        assert fc.head_chunks(d, torch.float32, "fwd", 4096, 4096) == (128, 0)
    assert fc.head_chunks(40, torch.bfloat16, "fwd", 4096, 4096) == (64, 0)
    mode, plan = fc.backward_plan(64, 4096, 4096, 80, torch.bfloat16, cuda)
    assert mode == "two_pass" and plan[1]["BLOCK_N1"] == plan[2]["BLOCK_M2"] == 64
    mode, plan = fc.backward_plan(64, 4096, 4096, 80, torch.bfloat16, cuda, ft.FlashConfig(split_d="off"))
    assert mode == "two_pass" and plan[1]["BLOCK_N1"] == plan[2]["BLOCK_M2"] == 128
