"""FlashAttentionTriton (and the compiled-backward variant) against float64 attention.

On a machine without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before this file is imported, so the
kernels run interpreted on CPU tensors: shapes stay tiny there. GPU-marked tests cover low precision, long
sequences and the autotuned path.
"""

import math

import pytest
import torch

ft = pytest.importorskip("lab.kernels.flash_triton")
ftb = pytest.importorskip("lab.kernels.flash_triton_backward")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference64(q, k, v, is_causal):
    """Output, logsumexp and the leaf inputs of float64 attention with a dense ``-inf`` causal mask."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        future = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1), (q, k, v)


def random_qkv(batch, n_q, n_k, d, dtype=torch.float32, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, n, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                 for n in (n_q, n_k, n_k))


def check_against_reference(fn, q, k, v, causal, atol, rtol):
    """Run ``fn.apply`` forward and backward and compare output, logsumexp, dQ, dK, dV with float64."""
    out = fn.apply(q, k, v, causal)
    saved = out.grad_fn.saved_tensors
    lse = [t for t in saved if tuple(t.shape) == (q.shape[0], q.shape[1])]
    assert len(lse) == 1, "exactly one saved tensor must have shape (batch, n_queries)"
    ref_out, ref_lse, ref_inputs = reference64(q, k, v, causal)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(device=q.device, dtype=q.dtype))
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad)

    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().double(), ref_out.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[0].cpu().double(), ref_lse.detach(), atol=atol, rtol=rtol)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == q.dtype and g.shape == r.shape
        torch.testing.assert_close(g.cpu().double(), r, atol=atol, rtol=rtol, msg=f"d{name} differs")


SMALL_SHAPES = [  # batch, n_queries, n_keys, d, causal: ragged lengths, n_q != n_k both ways
    (2, 37, 53, 16, True),
    (2, 53, 37, 16, True),
    (2, 37, 53, 16, False),
    (1, 64, 64, 32, True),
    (1, 80, 80, 32, False),
    (2, 17, 80, 16, True),
    (1, 1, 5, 16, False),
]


@pytest.mark.parametrize("batch,n_q,n_k,d,causal", SMALL_SHAPES)
def test_triton_matches_float64_reference(batch, n_q, n_k, d, causal):
    q, k, v = random_qkv(batch, n_q, n_k, d)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_half_precision_matches_float64_reference(dtype, tol, causal):
    # bf16 and fp16 inputs round q, k, v, the output and the gradients to 8 / 11 significant bits
    q, k, v = random_qkv(2, 37, 45, 16, dtype=dtype)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [True, False])
def test_two_pass_backward_launch_matches_reference(monkeypatch, causal):
    monkeypatch.setattr(ftb, "BACKWARD_LAUNCH", "two_pass")
    q, k, v = random_qkv(2, 45, 29, 16)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=2e-5, rtol=2e-5)


def test_fused_and_two_pass_backward_agree():
    q, k, v = random_qkv(1, 50, 70, 32)
    out = ft.FlashAttentionTriton.apply(q, k, v, True).detach()
    _, lse = ft.flash_forward(q.detach(), k.detach(), v.detach(), True)
    grad = torch.randn_like(out)
    fused = ftb.flash_backward(q.detach(), k.detach(), v.detach(), out, lse, grad, True, launch="fused")
    two = ftb.flash_backward(q.detach(), k.detach(), v.detach(), out, lse, grad, True, launch="two_pass")
    for a, b in zip(fused, two):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_compiled_backward_matches_reference():
    q, k, v = random_qkv(2, 37, 53, 16)
    check_against_reference(ft.FlashAttentionTritonCompiledBackward, q, k, v, True, atol=2e-5, rtol=2e-5)


def test_causal_output_ignores_future_keys_entirely():
    """Future key tiles are skipped, not only masked: NaNs in them must not reach earlier query tiles.
    (Inside a tile that crosses the diagonal a NaN key would still poison the row: 0 * NaN = NaN.)"""
    tile = ft._fwd_fixed_config(16)["BLOCK_M"]
    q, k, v = (t.detach() for t in random_qkv(1, 2 * tile, 2 * tile, 16))
    k2, v2 = k.clone(), v.clone()
    k2[:, tile:] = float("nan")
    v2[:, tile:] = float("nan")
    out = ft.FlashAttentionTriton.apply(q, k, v, True)
    out2 = ft.FlashAttentionTriton.apply(q, k2, v2, True)
    torch.testing.assert_close(out2[:, :tile], out[:, :tile], atol=0, rtol=0)
    assert out2[:, tile:].isnan().all()


def test_non_contiguous_inputs():
    base = torch.randn(2, 16, 40, 3, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    q = base[..., 0].transpose(1, 2).requires_grad_()  # last-dimension stride != 1: copied
    k = base[..., 1].transpose(1, 2).requires_grad_()
    wide = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    v = wide[:, :, :16].requires_grad_()  # sequence stride 32: passed as is
    assert q.stride(-1) != 1 and v.stride(1) == 32
    check_against_reference(ft.FlashAttentionTriton, q, k, v, True, atol=2e-5, rtol=2e-5)


def test_bhsd_wrapper_matches_reference_per_head():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=gen).to(DEVICE) for _ in range(3))
    for backward in ("triton", "compiled"):
        out = ft.flash_attention_bhsd(q, k, v, causal=True, backward=backward)
        assert out.shape == (2, 2, 24, 16)
        for b in range(2):
            for h in range(2):
                ref, _, _ = reference64(q[b, h][None], k[b, h][None], v[b, h][None], True)
                torch.testing.assert_close(out[b, h].cpu().double(), ref[0].detach(), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="backward"):
        ft.flash_attention_bhsd(q, k, v, causal=True, backward="cuda")


@pytest.mark.parametrize("make,error,match", [
    (lambda q, k, v: (q[0], k[0], v[0]), ValueError, "shape"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dimension"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k.half(), v), TypeError, "dtype"),
    (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), ValueError, "not supported"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "not supported"),
])
def test_bad_inputs_raise_clear_errors(make, error, match):
    q, k, v = (t.detach() for t in random_qkv(2, 16, 16, 16))
    with pytest.raises(error, match=match):
        ft.FlashAttentionTriton.apply(*make(q, k, v), False)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(ft, "INTERPRET", False)
    q, k, v = (t.detach().cpu() for t in random_qkv(1, 16, 16, 16, device="cpu"))
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        ft.FlashAttentionTriton.apply(q, k, v, False)


def test_untuned_configs_follow_the_grid_size(monkeypatch):
    """Without autotuning, long bf16 shapes get the configs tuning chose: small query tiles and one fused
    backward launch when one head leaves SMs idle, big tiles and two backward launches when heads fill
    the GPU; fp32 and short sequences keep the small fixed configs."""
    monkeypatch.setattr(ft, "INTERPRET", False)
    monkeypatch.setattr(ft, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    one_head = ft._fwd_untuned_config(1, 16384, 16384, 128, cuda, torch.bfloat16)
    many_heads = ft._fwd_untuned_config(16, 16384, 16384, 128, cuda, torch.bfloat16)
    assert one_head["BLOCK_M"] == 64 and many_heads["BLOCK_M"] == 128
    assert ft._fwd_untuned_config(16, 16384, 16384, 128, cuda, torch.float32) == ft._fwd_fixed_config(128)
    assert ft._fwd_untuned_config(16, 512, 512, 64, cuda, torch.bfloat16) == ft._fwd_fixed_config(64)
    assert ftb._bwd_untuned_plan(1, 16384, 16384, 64, cuda, torch.bfloat16)[0] == "fused"
    mode, configs = ftb._bwd_untuned_plan(16, 16384, 16384, 128, cuda, torch.bfloat16)
    assert mode == "two_pass" and configs[2]["BLOCK_M2"] == 128
    monkeypatch.setattr(ft, "AUTOTUNE", False)
    assert not ft.uses_autotune(16384, 16384, torch.bfloat16)


# ----------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_cuda_tensors_without_visible_gpu_are_refused(monkeypatch):
    q, k, v = (t.detach() for t in random_qkv(1, 16, 16, 16, device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        ft.FlashAttentionTriton.apply(q, k, v, False)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,n_q,n_k,d,causal,dtype,tol", [
    (2, 300, 300, 64, True, torch.bfloat16, 3e-2),
    (1, 411, 173, 64, False, torch.bfloat16, 3e-2),
    (3, 129, 129, 16, True, torch.bfloat16, 3e-2),
    (2, 173, 411, 128, True, torch.float16, 1e-2),
    (2, 173, 411, 64, True, torch.float32, 1e-4),
    (1, 2048, 2048, 64, True, torch.bfloat16, 3e-2),  # long enough for the autotuned kernels
])
def test_gpu_dtypes_match_float64_reference(batch, n_q, n_k, d, causal, dtype, tol):
    q, k, v = random_qkv(batch, n_q, n_k, d, dtype=dtype, device="cuda")
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_gpu_long_sequence_matches_sdpa():
    """4096 tokens, d 128, causal, bf16 kernels against fp32 SDPA (the float64 reference would be slow)."""
    causal = True
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4096, 128, device="cuda", generator=gen) for _ in range(3))
    grad = torch.randn(2, 4096, 128, device="cuda", generator=gen)
    q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad)
    q16, k16, v16 = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = ft.FlashAttentionTriton.apply(q16, k16, v16, causal)
    grads = torch.autograd.grad(out, (q16, k16, v16), grad.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,n,d", [(1, 2048, 64), (40, 1024, 128)])
def test_gpu_untuned_configs_match_sdpa(monkeypatch, batch, n, d):
    """AUTOTUNE off: the fixed long-sequence configs (thin grid: fused backward; full grid: two passes)."""
    monkeypatch.setattr(ft, "AUTOTUNE", False)
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v, grad = (torch.randn(batch, n, d, device="cuda", generator=gen) for _ in range(4))
    q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad)
    q16, k16, v16 = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = ft.FlashAttentionTriton.apply(q16, k16, v16, True)
    grads = torch.autograd.grad(out, (q16, k16, v16), grad.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r, atol=3e-2, rtol=3e-2)
