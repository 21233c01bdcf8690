"""FlashAttentionTriton (and the compiled-backward variant) against float64 attention.

On a machine without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before this file is imported, so the
kernels run interpreted on CPU tensors: shapes stay tiny there (16 x 16 tiles, so a few dozen tokens already
give ragged tiles, diagonal tiles and unmasked tiles). GPU-marked tests cover long sequences and the
large-tile configs. Compile/op-registration tests: test_flash_compile.py.
"""

import dataclasses
import math

import pytest
import torch

ft = pytest.importorskip("lab.kernels.flash_triton")
fc = pytest.importorskip("lab.kernels.flash_config")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference64(q, k, v, is_causal):
    """Output, logsumexp and the leaf inputs of float64 attention with a dense ``-inf`` causal mask,
    independently of lab. Works on (..., seq, d)."""
    q, k, v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1), (q, k, v)


def random_qkv(lead, n_q, n_k, d, dtype=torch.float32, seed=0, device=DEVICE):
    """Fresh random q, k, v of shape (*lead, n, d) that require grad."""
    lead = (lead,) if isinstance(lead, int) else tuple(lead)
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, n, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                 for n in (n_q, n_k, n_k))


def check_against_reference(fn, q, k, v, causal, atol, rtol, config=None):
    """Run ``fn.apply`` forward and backward and compare output, logsumexp, dQ, dK, dV with float64."""
    out = fn.apply(q, k, v, causal, config)
    saved = out.grad_fn.saved_tensors
    lse = [t for t in saved if tuple(t.shape) == tuple(q.shape[:-1])]
    assert len(lse) == 1, "exactly one saved tensor must have shape q.shape[:-1] (the logsumexp)"
    assert lse[0].dtype == torch.float32
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


HEAD_DIM_CASES = [  # lead dims, n_q, n_k, d, causal, dtype, tol: head dims that are not powers of two
    (2, 37, 53, 80, True, torch.float32, 2e-5),
    (2, 53, 37, 80, False, torch.float32, 2e-5),
    ((1, 2), 45, 29, 96, True, torch.float32, 2e-5),
    (2, 29, 45, 96, False, torch.float32, 2e-5),
    (2, 37, 21, 40, True, torch.float32, 2e-5),
    (1, 21, 37, 24, False, torch.float32, 2e-5),
    (2, 19, 19, 8, True, torch.float32, 2e-5),
    (1, 20, 33, 256, True, torch.float32, 2e-5),
    (2, 37, 53, 80, True, torch.float16, 2e-2),
    ((1, 2), 29, 45, 96, False, torch.float16, 2e-2),
    (2, 45, 29, 40, True, torch.float16, 2e-2),
    (2, 37, 53, 80, False, torch.bfloat16, 6e-2),  # bf16: 8 significant bits in q, k, v, o and the grads
    (2, 45, 29, 24, True, torch.bfloat16, 6e-2),
]


@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype,tol", HEAD_DIM_CASES)
def test_any_head_dim_multiple_of_8_matches_float64_reference(lead, n_q, n_k, d, causal, dtype, tol):
    """BLOCK_D is the next power of two; the columns past d are masked inside the kernels."""
    q, k, v = random_qkv(lead, n_q, n_k, d, dtype=dtype, seed=d)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_half_precision_matches_float64_reference(dtype, tol, causal):
    q, k, v = random_qkv(2, 37, 45, 16, dtype=dtype)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=tol, rtol=tol)


VARIANTS = [ft.FlashConfig(backward_launch=mode) for mode in ("fused", "two_pass")]


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.backward_launch)
@pytest.mark.parametrize("causal", [True, False])
def test_backward_variants_match_reference(config, causal):
    """Every launch mode: (batch, heads) inputs, a padded head dim and ragged lengths."""
    q, k, v = random_qkv((2, 2), 45, 29, 24, seed=3)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=2e-5, rtol=2e-5, config=config)


@pytest.mark.parametrize("mode", ["fused", "two_pass"])
def test_model_layout_comes_back_in_its_own_strides(mode):
    """q, k, v as the model makes them, (batch, seq, heads, d) projections seen as (batch, heads, seq, d):
    the output and the gradients come back in that layout, so the model's ``transpose(1, 2).reshape`` of
    the output is a view, and they match float64."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(2, 37, 3, 24, generator=gen).to(DEVICE) for _ in range(3)]
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in base)  # leaves with the strides of base
    check_against_reference(ft.FlashAttentionTriton, q, k, v, True, atol=2e-5, rtol=2e-5,
                            config=ft.FlashConfig(backward_launch=mode))
    out = ft.flash_attention_bhsd(q, k, v, True, config=ft.FlashConfig(backward_launch=mode))
    assert out.stride() == q.stride()
    merged = out.transpose(1, 2).reshape(2, 37, 72)
    assert merged.data_ptr() == out.data_ptr() and merged._base is not None  # a view, nothing copied
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("causal", [True, False])
def test_explicit_rectangular_tiles_match_reference(causal):
    """Tiles given in the config, with BLOCK_M != BLOCK_N and BLOCK_M1 != BLOCK_N1, so the causal tile
    bounds are exercised beyond square 16 x 16 tiles."""
    config = ft.FlashConfig(fwd_tiles=(32, 16, 4, 1), bwd_tiles=(16, 32, 32, 16, 4, 1), backward_launch="fused")
    q, k, v = random_qkv(2, 75, 61, 40, seed=4)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=2e-5, rtol=2e-5, config=config)
    two_pass = config.replace(backward_launch="two_pass", fwd_tiles=(16, 32, 4, 1), bwd_tiles=(32, 16, 16, 32, 4, 1))
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=2e-5, rtol=2e-5, config=two_pass)


def test_launch_modes_agree():
    """The two launches compute the same sums in the same order: bit for bit equal."""
    q, k, v = (t.detach() for t in random_qkv(1, 50, 70, 32))
    out, lse = ft.flash_forward(q, k, v, True)
    grad = torch.randn_like(out)
    fused = ft.flash_backward(q, k, v, out, lse, grad, True, ft.FlashConfig(backward_launch="fused"))
    two = ft.flash_backward(q, k, v, out, lse, grad, True, ft.FlashConfig(backward_launch="two_pass"))
    for a, b in zip(fused, two):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_head_strided_inputs_are_not_copied():
    """The model hands over (batch, seq, heads, d) projections transposed to (batch, heads, seq, d)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 33, 3, 16, generator=gen).to(DEVICE).transpose(1, 2).requires_grad_()
               for _ in range(3))
    assert not q.is_contiguous() and q.stride(-1) == 1
    check_against_reference(ft.FlashAttentionTriton, q, k, v, True, atol=2e-5, rtol=2e-5)


def test_causal_output_ignores_future_keys_entirely():
    """Future key tiles are skipped, not only masked: NaNs in them must not reach earlier query tiles.
    (Inside a tile that crosses the diagonal a NaN key would still poison the row: 0 * NaN = NaN.)"""
    tile = fc.forward_tiles(1, 32, 32, 16, torch.float32, torch.device(DEVICE))["BLOCK_M"]
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


@pytest.mark.slow
def test_compiled_backward_matches_reference():
    q, k, v = random_qkv(2, 37, 53, 16)
    check_against_reference(ft.FlashAttentionTritonCompiledBackward, q, k, v, True, atol=2e-5, rtol=2e-5)


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
    with pytest.raises(ValueError, match="batch, heads, seq, d"):
        ft.flash_attention_bhsd(q[0], k[0], v[0], causal=True)


@pytest.mark.parametrize("make,error,match", [
    (lambda q, k, v: (q[0], k[0], v[0]), ValueError, "shape"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dimension"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
    (lambda q, k, v: (q, k.half(), v), TypeError, "dtype"),
    (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), ValueError, "not supported"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "not supported"),
    (lambda q, k, v: (q[None], k[None], v[None, :1]), ValueError, "batch and heads"),
    (lambda q, k, v: tuple(t.repeat(1, 1, 17)[..., :264] for t in (q, k, v)), ValueError, "multiple of 8"),
])
def test_bad_inputs_raise_clear_errors(make, error, match):
    q, k, v = (t.detach() for t in random_qkv(2, 16, 16, 16))
    with pytest.raises(error, match=match):
        ft.FlashAttentionTriton.apply(*make(q, k, v), False)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(fc, "INTERPRET", False)
    q, k, v = (t.detach().cpu() for t in random_qkv(1, 16, 16, 16, device="cpu"))
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        ft.FlashAttentionTriton.apply(q, k, v, False)


# ------------------------------------------------------------------------------------------- config
def test_config_is_frozen_data_with_clear_errors():
    config = ft.FlashConfig()
    assert config == ft.DEFAULT_CONFIG and hash(config) == hash(ft.FlashConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.autotune = True
    assert config.op_args() == tuple(getattr(config, f.name) for f in dataclasses.fields(config))
    assert ft.FlashConfig(fwd_tiles=[64, 32, 4, 2]).fwd_tiles == (64, 32, 4, 2)  # lists from the op schema
    bad_configs = [(dict(backward_launch="both"), "backward_launch"), (dict(fp32_precision="fp64"), "fp32_precision"),
                   (dict(fwd_tiles=(64, 64, 4)), "fwd_tiles"),
                   (dict(bwd_tiles=(48, 64, 64, 64, 4, 2)), "powers of two")]
    for bad, match in bad_configs:
        with pytest.raises(ValueError, match=match):
            ft.FlashConfig(**bad)
    q, k, v = (t.detach() for t in random_qkv(1, 16, 16, 16))
    with pytest.raises(TypeError, match="FlashConfig"):
        ft.FlashAttentionTriton.apply(q, k, v, True, {"autotune": True})


def test_fp32_precision_follows_torch_settings(monkeypatch):
    assert fc.dot_precision(torch.bfloat16, "ieee") == "tf32"  # ignored by Triton for 16-bit operands
    assert fc.dot_precision(torch.float32, "ieee") == "ieee"
    monkeypatch.setattr(fc, "tf32_allowed", lambda: True)
    assert fc.dot_precision(torch.float32) == "tf32"
    monkeypatch.setattr(fc, "tf32_allowed", lambda: False)
    assert fc.dot_precision(torch.float32) == "tf32x3"


def test_tf32_allowed_reads_torch_matmul_precision():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not fc.tf32_allowed()
        torch.set_float32_matmul_precision("high")
        assert fc.tf32_allowed()
    finally:
        torch.set_float32_matmul_precision(before)


def test_tile_tables_follow_grid_size_dtype_and_head_dim(monkeypatch):
    """Long bf16 shapes get the configs tuning chose: small query tiles and one fused backward launch when
    one head leaves SMs idle, big tiles and two backward launches when heads fill the GPU. Padded head
    dims use the tiles of their BLOCK_D; fp32 gets tiles of at most half the bytes."""
    monkeypatch.setattr(fc, "INTERPRET", False)
    monkeypatch.setattr(fc, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    one_head = fc.forward_tiles(1, 16384, 16384, 128, torch.bfloat16, cuda)
    many_heads = fc.forward_tiles(16, 16384, 16384, 128, torch.bfloat16, cuda)
    assert one_head["BLOCK_M"] == 64 and many_heads["BLOCK_M"] == 128
    # causal d = 128 up to 8k tokens: the diagonal's masked tiles are cheaper a quarter the size; without the mask
    # (or longer) the large tiles stay
    assert fc.forward_tiles(128, 2048, 2048, 128, torch.bfloat16, cuda)["BLOCK_M"] == 64
    assert fc.forward_tiles(128, 2048, 2048, 128, torch.bfloat16, cuda, causal=False)["BLOCK_M"] == 128
    # d = 80 as 64 + 16 columns: 128 x 64 tiles on 8 warps without the mask, 64 x 64 with it or unsplit
    full80 = fc.forward_tiles(32, 4096, 4096, 80, torch.bfloat16, cuda, causal=False)
    assert (full80["BLOCK_M"], full80["BLOCK_N"], full80["num_warps"]) == (128, 64, 8)
    assert fc.forward_tiles(32, 4096, 4096, 80, torch.bfloat16, cuda)["BLOCK_M"] == 64
    unsplit = ft.FlashConfig(split_d="off")
    assert fc.forward_tiles(32, 4096, 4096, 80, torch.bfloat16, cuda, unsplit, causal=False)["BLOCK_M"] == 64
    padded = fc.forward_tiles(16, 16384, 16384, 80, torch.bfloat16, cuda)  # BLOCK_D 128 with 48 masked columns
    assert padded["BLOCK_M"] * padded["BLOCK_N"] < many_heads["BLOCK_M"] * many_heads["BLOCK_N"]
    fp32 = fc.forward_tiles(16, 16384, 16384, 128, torch.float32, cuda)
    assert fp32["BLOCK_N"] * 4 <= many_heads["BLOCK_N"] * 2 and fp32["num_stages"] < many_heads["num_stages"]
    assert fc.backward_plan(1, 16384, 16384, 64, torch.bfloat16, cuda)[0] == "fused"
    mode, plan = fc.backward_plan(16, 16384, 16384, 128, torch.bfloat16, cuda)
    assert mode == "two_pass" and plan[2]["BLOCK_M2"] == 128
    assert plan[1]["BLOCK_N1"] == 2 * plan[1]["BLOCK_M1"]  # dK/dV programs: 64 queries x 128 keys
    assert fc.backward_plan(16, 16384, 16384, 64, torch.bfloat16, cuda)[1][1]["BLOCK_N1"] == 64
    short = fc.backward_plan(128, 512, 512, 80, torch.bfloat16, cuda)
    assert short[0] == "fused" and short[1][0]["num_warps"] == 4
    explicit = ft.FlashConfig(fwd_tiles=(32, 64, 4, 5), bwd_tiles=(32, 128, 128, 32, 4, 5))
    assert fc.forward_tiles(16, 4096, 4096, 64, torch.bfloat16, cuda, explicit)["num_stages"] == 5
    assert fc.backward_plan(16, 4096, 4096, 64, torch.bfloat16, cuda, explicit)[1][1]["BLOCK_N1"] == 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_tables_fit_shared_memory_and_registers(monkeypatch, dtype):
    """For every supported head dim, short and long, thin and full grids: a K and a V tile per pipeline
    stage plus the Q tile fit in Hopper's 227 KB of shared memory per block, and the fp32 accumulators
    (forward: output; backward: dK and dV) need at most 128 registers a thread, so no table entry is sure
    to fail or spill."""
    monkeypatch.setattr(fc, "INTERPRET", False)
    monkeypatch.setattr(fc, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    size = torch.finfo(dtype).bits // 8
    for d in range(8, fc.MAX_HEAD_DIM + 1, 8):
        bd = fc.block_d(d)
        for bh, n in [(1, 512), (1, 16384), (64, 4096)]:
            t = max((fc.forward_tiles(bh, n, n, d, dtype, cuda, causal=c) for c in (True, False)),
                    key=lambda t: t["BLOCK_M"] * t["BLOCK_N"] * t["num_stages"])
            smem = t["num_stages"] * 2 * t["BLOCK_N"] * bd * size + t["BLOCK_M"] * bd * size
            assert smem <= 227 * 1024, (d, bh, n, t)
            assert t["BLOCK_M"] * bd / (32 * t["num_warps"]) <= 128, (d, bh, n, t)
            _, plan = fc.backward_plan(bh, n, n, d, dtype, cuda)
            for b in plan.values():
                assert 2 * b["BLOCK_N1"] * bd / (32 * b["num_warps"]) <= 128, (d, bh, n, b)


# ----------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_cuda_tensors_without_visible_gpu_are_refused(monkeypatch):
    q, k, v = (t.detach() for t in random_qkv(1, 16, 16, 16, device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        ft.FlashAttentionTriton.apply(q, k, v, False)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype,tol", [
    (2, 300, 300, 64, True, torch.bfloat16, 3e-2),
    (1, 411, 173, 64, False, torch.bfloat16, 3e-2),
    (3, 129, 129, 16, True, torch.bfloat16, 3e-2),
    (2, 173, 411, 128, True, torch.float16, 1e-2),
    (2, 173, 411, 64, True, torch.float32, 1e-4),
    ((2, 3), 300, 257, 80, True, torch.bfloat16, 3e-2),
    ((2, 3), 257, 300, 96, False, torch.float16, 1e-2),
    ((1, 2), 200, 200, 256, True, torch.bfloat16, 3e-2),
    (1, 2048, 2048, 64, True, torch.bfloat16, 3e-2),  # long enough for the large tiles
    (1, 1100, 1100, 80, True, torch.float32, 1e-4),
])
@pytest.mark.parametrize("kernels", ["auto", "triton"])  # auto: the Gluon kernels on Hopper where they can run
def test_gpu_dtypes_match_float64_reference(lead, n_q, n_k, d, causal, dtype, tol, kernels):
    q, k, v = random_qkv(lead, n_q, n_k, d, dtype=dtype, device="cuda")
    config = ft.FlashConfig(forward_kernel=kernels, backward_kernel=kernels)
    check_against_reference(ft.FlashAttentionTriton, q, k, v, causal, atol=tol, rtol=tol, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [ft.FlashConfig(backward_launch="fused"),
                                    ft.FlashConfig(backward_launch="two_pass"),
                                    ft.FlashConfig(fast_launch=False),
                                    ft.FlashConfig(autotune=True),
                                    ft.FlashConfig(autotune=True, backward_launch="two_pass")],
                         ids=["fused", "two_pass", "public-launch", "autotune", "autotune-two_pass"])
def test_gpu_variants_match_float64_reference(config):
    """The portable kernels' launch variants (the portable forward and backward, which a Hopper GPU would
    otherwise leave to the Gluon ones)."""
    q, k, v = random_qkv((1, 4), 1100, 1100, 64, dtype=torch.bfloat16, device="cuda")
    config = config.replace(forward_kernel="triton", backward_kernel="triton")
    check_against_reference(ft.FlashAttentionTriton, q, k, v, True, atol=3e-2, rtol=3e-2, config=config)


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
