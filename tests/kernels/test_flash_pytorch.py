"""FlashAttentionPytorch against float64 textbook attention: output, logsumexp, dQ, dK, dV."""

import math

import pytest
import torch

from lab.kernels.flash_pytorch import (
    FlashAttentionPytorch,
    attention_backward_recompute,
    attention_reference,
    flash_attention_bhsd,
)


def reference64(q, k, v, is_causal):
    """Output, logsumexp and gradients of attention computed in float64 with a dense mask, independently
    of lab: ``torch.softmax`` over scores with ``-inf`` in the future."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    out = torch.softmax(scores, dim=-1) @ v
    return out, torch.logsumexp(scores, dim=-1), (q, k, v)


def random_qkv(batch, n_q, n_k, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, n, d, generator=gen, dtype=dtype) for n in (n_q, n_k, n_k))


SHAPES = [  # batch, n_queries, n_keys, d, causal, q_tile, k_tile
    (2, 37, 53, 16, True, 16, 16),
    (2, 53, 37, 16, True, 16, 32),
    (2, 37, 53, 16, False, 32, 16),
    (1, 64, 64, 64, True, 16, 16),
    (1, 64, 64, 64, False, 64, 64),
    (2, 100, 100, 64, True, 32, 16),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("batch,n_q,n_k,d,causal,q_tile,k_tile", SHAPES)
def test_forward_backward_match_float64_reference(batch, n_q, n_k, d, causal, q_tile, k_tile, dtype, tol):
    q, k, v = (t.requires_grad_() for t in random_qkv(batch, n_q, n_k, d, dtype))
    out = FlashAttentionPytorch.apply(q, k, v, causal, q_tile, k_tile)
    lse = out.grad_fn.saved_tensors[4]
    ref_out, ref_lse, ref_inputs = reference64(q, k, v, causal)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, atol=tol, rtol=tol, msg=f"d{name} differs")


def test_saves_q_k_v_o_and_exactly_one_logsumexp_shaped_tensor():
    batch, n_q, n_k, d = 2, 48, 40, 16
    q, k, v = (t.requires_grad_() for t in random_qkv(batch, n_q, n_k, d, torch.float32))
    out = FlashAttentionPytorch.apply(q, k, v, True)
    saved = out.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved].count((batch, n_q)) == 1
    assert len(saved) == 5
    for original, kept in zip((q, k, v, out), saved[:4]):
        assert kept.shape == original.shape and torch.equal(kept, original)


def test_fully_masked_tiles_are_skipped_not_just_zeroed():
    """Causal output of the first rows must not depend on later keys at all (not even through NaNs)."""
    q, k, v = random_qkv(1, 64, 64, 16, torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[:, 32:] = float("nan")
    v2[:, 32:] = float("nan")
    out = FlashAttentionPytorch.apply(q, k, v, True, 16, 16)
    out2 = FlashAttentionPytorch.apply(q, k2, v2, True, 16, 16)
    torch.testing.assert_close(out2[:, :32], out[:, :32], atol=0, rtol=0)


def test_low_precision_inputs_keep_their_dtype_and_stay_close():
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in random_qkv(2, 40, 40, 16, torch.float32))
    out = FlashAttentionPytorch.apply(q, k, v, True, 16, 16)
    assert out.dtype == torch.bfloat16
    ref_out, _, _ = reference64(q, k, v, True)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_recompute_backward_matches_autograd(causal):
    q, k, v = random_qkv(2, 29, 45, 16, torch.float64)
    ref_out, ref_lse, ref_inputs = reference64(q, k, v, causal)
    grad = torch.randn(ref_out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad)
    grads = attention_backward_recompute(q, k, v, ref_out.detach(), ref_lse.detach(), grad, causal)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


def test_reference_helper_agrees_with_independent_reference():
    q, k, v = random_qkv(2, 21, 33, 16, torch.float64)
    out, lse = attention_reference(q, k, v, True)
    ref_out, ref_lse, _ = reference64(q, k, v, True)
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, ref_lse.detach())


def test_bhsd_wrapper_folds_heads_into_batch():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 33, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    out = flash_attention_bhsd(q, k, v, causal=True)
    assert out.shape == (2, 3, 33, 16)
    for b in range(2):
        for h in range(3):
            ref, _, _ = reference64(q[b, h][None], k[b, h][None], v[b, h][None], True)
            torch.testing.assert_close(out[b, h], ref[0].detach(), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("make,error,match", [
    (lambda q, k, v: (q[0], k[0], v[0]), ValueError, "shape"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dimension"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k, v[:, :5]), ValueError, "same number of keys"),
    (lambda q, k, v: (q, k.double(), v), TypeError, "dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating"),
])
def test_bad_inputs_raise_clear_errors(make, error, match):
    q, k, v = random_qkv(2, 16, 16, 16, torch.float32)
    with pytest.raises(error, match=match):
        FlashAttentionPytorch.apply(*make(q, k, v), False)


def test_tiles_smaller_than_16_are_refused():
    q, k, v = random_qkv(1, 16, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="at least 16"):
        FlashAttentionPytorch.apply(q, k, v, False, 8, 16)


def test_bhsd_rejects_mismatched_heads():
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="heads"):
        flash_attention_bhsd(q, k, k, causal=False)
