"""Tests for lab.accounting.attention: the FLOP and memory closed forms against counts, the power-law fit."""


import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab.accounting import attention as costs
from lab.measure.saved_tensors import saved_tensor_bytes
from lab.model.attention import naive_attention as model_naive_attention

# ---------------------------------------------------------------------------------------------------------
# FLOPs


def test_attention_pairs_by_hand():
    assert costs.attention_pairs(4) == 16
    assert costs.attention_pairs(4, causal=True) == 4 + 3 + 2 + 1
    # top-left aligned causal mask (as SDPA): query 0 sees key 0, query 1 keys 0..1
    assert costs.attention_pairs(2, 4, causal=True) == 1 + 2
    # more queries than keys: the later queries see every key
    assert costs.attention_pairs(4, 2, causal=True) == 1 + 2 + 2 + 2
    with pytest.raises(ValueError):
        costs.attention_pairs(0)


def test_attention_flops_by_hand():
    # batch 2, seq 4, d 8: forward 2 matmuls x 2 FLOPs x 2*16 pairs x 8 = 1024
    assert costs.attention_flops(2, 4, 8) == 1024
    assert costs.attention_flops(2, 4, 8, causal=True) == 4 * 2 * 10 * 8
    assert costs.attention_flops(2, 4, 8, causal=True, pass_="bwd") == 2.5 * 640
    assert costs.attention_flops(2, 4, 8, causal=True, pass_="e2e") == 3.5 * 640
    assert costs.attention_flops(1, 4, 8, heads=2) == costs.attention_flops(2, 4, 8)
    # large causal: the papers' s^2/2 rounding is off by 1/s
    s = 65536
    assert costs.attention_flops(1, s, 128, True) / (4 * s * s * 128 / 2) == pytest.approx(1 + 1 / s)
    with pytest.raises(ValueError):
        costs.attention_flops(1, 4, 8, pass_="backward")


def test_attention_flops_match_torch_flop_counter():
    """Non-causal naive attention: forward is exactly 4*b*s^2*d; its backward (no recomputation) does the
    four gradient matmuls, 8*b*s^2*d, i.e. our backward count minus the recomputed Q K^T."""
    b, s, d = 2, 24, 16
    q, k, v = (torch.randn(b, s, d, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as fwd_counter:
        out = model_naive_attention(q, k, v, False)
    with FlopCounterMode(display=False) as bwd_counter:
        out.sum().backward()
    assert fwd_counter.get_total_flops() == costs.attention_flops(b, s, d, False, "fwd")
    recompute = 2 * b * s * s * d
    assert bwd_counter.get_total_flops() == costs.attention_flops(b, s, d, False, "bwd") - recompute



# ---------------------------------------------------------------------------------------------------------
# Memory


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_saved_bytes_closed_form_matches_autograd(dtype, causal):
    b, s, d = 3, 40, 8
    q, k, v = (torch.randn(b, s, d, dtype=costs.DTYPES[dtype], requires_grad=True) for _ in range(3))
    measured = saved_tensor_bytes(lambda x, y, z: model_naive_attention(x, y, z, causal), q, k, v)
    e = 4 if dtype == "fp32" else 2
    closed = b * s * s * e + (s * s if causal else 0)
    assert measured == closed == costs.naive_attention_totals(b, s, d, dtype, causal)["saved"]


def test_naive_memory_terms_by_hand():
    # batch 8, seq 16384, fp32: P alone is 8 * 16384^2 * 4 B = 8 GiB
    t = costs.naive_attention_memory(8, 16384, 64, "fp32")
    assert t.set_index("term").loc["probabilities P (saved)", "bytes"] == 8 * 2**30
    totals = costs.naive_attention_totals(8, 16384, 64, "fp32")
    qkv_do_out = 5 * 8 * 16384 * 64 * 4
    assert totals["before_backward"] == 8 * 2**30 + qkv_do_out
    assert totals["peak"] == 3 * 8 * 2**30 + qkv_do_out
    causal = costs.naive_attention_totals(8, 16384, 64, "fp32", causal=True)
    assert causal["saved"] == 8 * 2**30 + 16384**2


def test_flash_saved_bytes_closed_form():
    assert costs.flash_attention_saved_bytes(2, 16, 8, "bf16", heads=3) == 4 * 6 * 16 * 8 * 2 + 6 * 16 * 4


def test_flash_pytorch_saves_what_the_closed_form_says():
    from lab.kernels.flash_pytorch import FlashAttentionPytorch

    b, s, d = 2, 64, 16
    q, k, v = (torch.randn(b, s, d, requires_grad=True) for _ in range(3))
    measured = saved_tensor_bytes(lambda x, y, z: FlashAttentionPytorch.apply(x, y, z, True), q, k, v,
                                     exclude_inputs=False)
    assert measured == costs.flash_attention_saved_bytes(b, s, d, "fp32")


def test_fit_power_law():
    x = [256, 1024, 4096]
    p, c = costs.fit_power_law(x, [3.0 * v**2 for v in x])
    assert p == pytest.approx(2.0) and c == pytest.approx(3.0)
    with pytest.raises(ValueError):
        costs.fit_power_law([1], [1])
