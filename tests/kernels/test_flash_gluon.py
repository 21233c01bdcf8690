"""The Gluon FlashAttention kernels for Hopper: against float64 on an sm_90 GPU; on any machine, which inputs they
take and that the forward compiles for sm_90a into warp-group MMAs without spills."""

import math

import pytest
import torch

triton = pytest.importorskip("triton")
flash_gluon = pytest.importorskip("lab.kernels.flash_gluon")
flash_gluon_backward = pytest.importorskip("lab.kernels.flash_gluon_backward")

MAX_SHARED = 232448  # bytes of shared memory a block may use on an H100/H200 (227 KB)


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def reference(q, k, v, causal):
    """float64 attention and natural-log logsumexp on (batch, heads, seq, d), top-left causal."""
    qf, kf, vf = q.double(), k.double(), v.double()
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return torch.softmax(scores, -1) @ vf, torch.logsumexp(scores, -1)


# --- any machine -------------------------------------------------------------------------------------------

def test_input_reason_accepts_the_supported_inputs_and_names_what_is_wrong():
    q = torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)
    assert flash_gluon.input_reason(q, q, q, True) is None
    half64 = torch.empty(1, 2, 64, 64, dtype=torch.float16)
    assert flash_gluon.input_reason(half64, half64, half64, False) is None
    fp32 = q.float()
    assert "bf16 or fp16" in flash_gluon.input_reason(fp32, fp32, fp32, True)
    d80 = torch.empty(2, 3, 100, 80, dtype=torch.bfloat16)
    assert "head dimension" in flash_gluon.input_reason(d80, d80, d80, True)
    assert "80" in flash_gluon.input_reason(d80, d80, d80, True)
    other_heads = torch.empty(2, 4, 100, 128, dtype=torch.bfloat16)
    assert "heads" in flash_gluon.input_reason(q, other_heads, other_heads, True)
    three_d = torch.empty(2, 100, 128, dtype=torch.bfloat16)
    assert "(batch, heads, seq, d)" in flash_gluon.input_reason(three_d, three_d, three_d, True)
    mixed = q.half()
    assert "one dtype" in flash_gluon.input_reason(q, mixed, mixed, True)


def test_gluon_supported_refuses_tensors_off_a_hopper_gpu():
    q = torch.empty(1, 2, 128, 64, dtype=torch.bfloat16)
    reason = flash_gluon.gluon_supported(q, q, q, True)
    assert reason is not None and "CUDA" in reason
    # the input's own reason comes first
    assert "bf16 or fp16" in flash_gluon.gluon_supported(q.float(), q.float(), q.float(), True)


def test_forward_flops_halve_when_causal():
    assert flash_gluon.forward_flops(2, 3, 1024, 64, False) == 4 * 2 * 3 * 1024 ** 2 * 64
    assert flash_gluon.forward_flops(2, 3, 1024, 64, True) == 2 * 2 * 3 * 1024 ** 2 * 64


def test_chunked_reference_gradients_match_autograd():
    torch.manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 40, 16) for _ in range(4))
    for causal in (False, True):
        qf, kf, vf = (t.double().requires_grad_() for t in (q, k, v))
        out, _ = reference(qf, kf, vf, causal)
        expected = torch.autograd.grad(out, (qf, kf, vf), grad_out.double())
        got = flash_gluon.reference_head_gradients(q, k, v, grad_out, causal, chunk=16)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e[0, 0], rtol=0, atol=1e-12)


def test_reference_rows_match_the_full_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    rows = torch.tensor([0, 7, 39])
    for causal in (False, True):
        out, lse = reference(q, k, v, causal)
        got_out, got_lse = flash_gluon.reference_rows(q, k, v, causal, rows)
        torch.testing.assert_close(got_out, out[:, :, rows], rtol=0, atol=1e-12)
        torch.testing.assert_close(got_lse, lse[:, :, rows], rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_forward_compiles_for_sm90a_into_warp_group_mmas_without_spills(d):
    try:
        report = flash_gluon.compile_in_subprocess("forward", d, True, "bf16")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    # two consumer warp groups: the prologue's score product, two loops of (score, P V) and the last P V,
    # each product d / 16 (scores) or 128 / 16 (P V) wgmma instructions of 16-deep K steps
    assert report["wgmma"] == 2 * (d // 16 + 2 * (d // 16 + 8) + 8)
    assert report["spill_bytes"] == 0 and report["scalar_conversions"] == 0  # no one-element F2F conversion
    assert report["shared_bytes"] <= MAX_SHARED
    # the producer warp gives registers up and the consumers take them (setmaxnreg)
    assert min(report["setmaxnreg"]) == 24 and max(report["setmaxnreg"]) >= 240


# --- an sm_90 GPU ------------------------------------------------------------------------------------------

needs_hopper = pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU")

SHAPES = [  # batch, heads, n_q, n_k, d, dtype, causal
    (2, 3, 512, 512, 128, torch.bfloat16, True),
    (2, 3, 512, 512, 128, torch.bfloat16, False),
    (1, 4, 1000, 1000, 128, torch.bfloat16, True),
    (1, 2, 333, 333, 64, torch.float16, True),
    (2, 2, 777, 777, 64, torch.bfloat16, False),
    (1, 2, 64, 64, 128, torch.float16, True),
    (1, 2, 300, 700, 64, torch.bfloat16, False),
    (1, 2, 700, 300, 128, torch.bfloat16, True),
    (3, 2, 1024, 1024, 64, torch.float16, False),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}x{s[3]}x{s[4]}-{s[5]}-causal{s[6]}")
def test_forward_matches_float64(shape):
    batch, heads, n_q, n_k, d, dtype, causal = shape
    q = torch.randn(batch, heads, n_q, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, heads, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
    assert flash_gluon.gluon_supported(q, k, v, causal) is None
    poison = torch.full((2 * q.numel(),), float("nan"), device="cuda", dtype=dtype)  # the block out may reuse
    del poison
    out, lse = flash_gluon.gluon_forward(q, k, v, causal)
    ref_out, ref_lse = reference(q, k, v, causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads, n_q)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # bf16/fp16 operands and a 16-bit P: errors of a few units in the last place of the output's dtype
    assert (out.double() - ref_out).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 4e-3)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.gpu
@needs_hopper
def test_forward_matches_the_portable_kernel_and_takes_strided_inputs():
    from lab.kernels.flash_triton_forward import flash_forward

    q, k, v = (torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    out, lse = flash_gluon.gluon_forward(q, k, v, True)
    ref_out, ref_lse = flash_forward(q, k, v, True)
    assert (out.float() - ref_out.float()).abs().max().item() < 2e-2
    assert (lse - ref_lse).abs().max().item() < 1e-3


@pytest.mark.gpu
@needs_hopper
def test_forward_is_deterministic_and_writes_every_element():
    q, k, v = (torch.randn(1, 2, 640, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first, first_lse = flash_gluon.gluon_forward(q, k, v, True)
    for _ in range(3):
        out, lse = flash_gluon.gluon_forward(q, k, v, True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


@pytest.mark.slow
@pytest.mark.parametrize("d,dtype", [(64, "bf16"), (128, "bf16"), (128, "fp16")])
def test_backward_compiles_for_sm90a_into_warp_group_mmas(d, dtype):
    try:
        report = flash_gluon.compile_in_subprocess("backward", d, True, dtype)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    # two consumer warp groups, three query-tile loops, five products a tile: S^T and dP^T (d / 16 K steps),
    # dV and dK (64 queries / 16) and dQ (128 keys / 16)
    assert report["wgmma"] == 2 * 3 * (2 * d // 16 + 4 + 4 + 8)
    assert report["shared_bytes"] <= MAX_SHARED
    # the producer warp (and the dQ writer warp, sharing its warp group) ask for few registers; the consumers
    # take the rest
    assert min(report["setmaxnreg"]) == 24 and max(report["setmaxnreg"]) >= 240
    # handing dQ to the writer's TMA reduce-add instead of adding it with atomics (whose addresses took the
    # consumers' registers) keeps the consumers' spills to a few loop invariants (876 bytes a thread before)
    assert report["spill_bytes"] <= 256
    # P and dS rounded to 16 bits two elements an instruction: bf16's one-element F2F conversions (which
    # x.to(gl.bfloat16) left for half of them) made its backward 21% slower than fp16's at d 64
    assert report["scalar_conversions"] == 0


BACKWARD_SHAPES = [  # batch, heads, n_q, n_k, d, dtype, causal
    (2, 2, 512, 512, 128, torch.bfloat16, True),
    (1, 3, 640, 640, 128, torch.bfloat16, False),
    (1, 2, 1000, 1000, 64, torch.float16, True),
    (2, 2, 333, 333, 128, torch.float16, False),
    (1, 2, 300, 700, 64, torch.bfloat16, False),
    (1, 2, 700, 300, 128, torch.bfloat16, True),
]


def relative_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", BACKWARD_SHAPES,
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}x{s[3]}x{s[4]}-{s[5]}-causal{s[6]}")
@pytest.mark.parametrize("dq_writer", [None, "other"], ids=["default", "other_dq"])
def test_backward_matches_float64_and_the_portable_kernel(shape, dq_writer):
    """Each way of adding dQ (ragged ends, a ragged key tile and the causal diagonal) against float64 and the
    portable kernel."""
    from lab.kernels.flash_triton_backward import flash_backward

    batch, heads, n_q, n_k, d, dtype, causal = shape
    if dq_writer == "other":  # the way of adding dQ that d does not use by default
        dq_writer = not flash_gluon_backward.dq_writer_default(d)
    q = torch.randn(batch, heads, n_q, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, heads, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
    grad_out = torch.randn_like(q)
    qf, kf, vf = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference(qf, kf, vf, causal)
    references = torch.autograd.grad(ref_out, (qf, kf, vf), grad_out.double())
    out, lse = flash_gluon.gluon_forward(q, k, v, causal)
    grads = flash_gluon.gluon_backward(q, k, v, out, lse, grad_out, causal, dq_writer)
    portable = flash_backward(q, k, v, out, lse, grad_out, causal)
    for name, got, ref, other in zip(("dq", "dk", "dv"), grads, references, portable):
        assert got.dtype == dtype and got.shape == ref.shape, name
        assert torch.isfinite(got).all(), name
        error = relative_error(got, ref)
        # 16-bit P and dS: about 1e-3 of the gradient's largest value, as the portable kernel's
        assert error < (2e-2 if dtype == torch.bfloat16 else 5e-3), (name, error)
        assert error < 2 * relative_error(other, ref) + 2e-3, (name, error, relative_error(other, ref))


def test_without_the_tma_reduction_dq_is_added_by_the_consumers(monkeypatch):
    """Under a Triton whose IR builder may lack the TMA reduce-add (any but 3.6), d 128 adds dQ with the consumers'
    atomics, and asking for the writer warp is a one-line error; with it, d 128 uses the writer and d 64 not."""
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    rows, accum = torch.empty(1, 2, 256), torch.empty(1, 2, 256, 128)
    monkeypatch.setattr(flash_gluon_backward, "TMA_REDUCE", True)
    assert flash_gluon_backward.dq_writer_default(128) and not flash_gluon_backward.dq_writer_default(64)
    monkeypatch.setattr(flash_gluon_backward, "TMA_REDUCE", False)
    assert not flash_gluon_backward.dq_writer_default(128)
    _, _, constexprs, _, _ = flash_gluon_backward.backward_launch(q, q, q, q, rows, rows, accum, q, q, True)
    assert constexprs["DQ_WRITER"] is False
    with pytest.raises(ValueError, match="TMA reduce-add"):
        flash_gluon_backward.backward_launch(q, q, q, q, rows, rows, accum, q, q, True, dq_writer=True)


def test_the_backwards_row_statistics_and_dq_cast_are_exact_on_any_device():
    """The plain Triton ends of the Gluon backward (run interpreted here): D = rowsum(O * dO) and the base-2
    logsumexp in rows padded to the query tile with zeros past each head's end; dQ's scale and cast."""
    from lab.kernels import flash_gluon_rows as rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    out, grad_out = (torch.randn(2, 3, 100, 16, generator=gen).to(device) for _ in range(2))
    lse = torch.randn(2, 3, 100, generator=gen).to(device)
    delta, lse2 = rows.row_statistics(out, grad_out, lse, tile=64)
    assert delta.shape == lse2.shape == (2, 3, 128) and delta.dtype == torch.float32
    torch.testing.assert_close(delta[..., :100], (out * grad_out).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2[..., :100], lse * math.log2(math.e), rtol=1e-6, atol=1e-6)
    assert (delta[..., 100:] == 0).all() and (lse2[..., 100:] == 0).all()
    accum = torch.randn(2, 3, 100, 16, generator=gen).to(device)
    like = torch.empty(2, 3, 100, 16, dtype=torch.bfloat16, device=device)
    cast = rows.scale_cast(accum, like, 0.125)
    # within one bf16 rounding step (the interpreter's cast may round the other way at a tie)
    assert cast.dtype == torch.bfloat16 and cast.shape == like.shape
    torch.testing.assert_close(cast.float(), accum * 0.125, rtol=2**-7, atol=0)
