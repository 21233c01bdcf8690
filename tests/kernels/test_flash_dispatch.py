"""Which FlashAttention forward runs (lab.kernels.flash_dispatch): the decision on any machine (fake tensors, the
GPU's compute capability stubbed), the layout contract of the Gluon branch, what a traced call decomposes into;
on an sm_90 GPU, FlashAttentionTriton with the Gluon forward against float64, against the portable forward, and
compiled with fullgraph=True."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ft = pytest.importorskip("lab.kernels.flash_triton")
fd = pytest.importorskip("lab.kernels.flash_dispatch")
ops = pytest.importorskip("lab.kernels.flash_triton_ops")

from lab.bench.attention import attention_impl  # noqa: E402
from tests.kernels.dispatch_support import GPU_SHAPES, fake, float64_reference, gpu_inputs, needs_hopper  # noqa: E402

AUTO, GLUON, TRITON = (ft.FlashConfig(forward_kernel=k) for k in ("auto", "gluon", "triton"))
FORWARD = torch.ops.lab.flash_attention_forward.default


# ------------------------------------------------------------------------------------------------ decision
#: (compute capability, shape, dtype, device, config) -> the forward that runs; shape "model": (2, 256, 4, 128)
#: seen as (batch, heads, seq, d), the model's head-strided projections
DECISIONS = [
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", AUTO, "gluon"),
    ((9, 0), (2, 4, 256, 64), torch.float16, "cuda", AUTO, "gluon"),
    ((9, 0), (8, 256, 64), torch.bfloat16, "cuda", AUTO, "gluon"),  # (batch, seq, d): one batch of 8 heads
    ((9, 0), (2, 4, 256, 128), torch.float32, "cuda", AUTO, "triton"),  # fp32
    ((9, 0), (2, 4, 256, 80), torch.bfloat16, "cuda", AUTO, "triton"),  # d 80: the portable kernel splits it
    ((9, 0), (2, 4, 256, 256), torch.bfloat16, "cuda", AUTO, "triton"),
    ((8, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", AUTO, "triton"),  # A100
    ((10, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", AUTO, "triton"),  # Blackwell: no wgmma
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cpu", AUTO, "triton"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", TRITON, "triton"),  # the sweep's override
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", GLUON, "gluon"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", ft.FlashConfig(fwd_tiles=(64, 64, 4, 3)), "triton"),
    ((8, 0), (2, 4, 256, 80), torch.float32, "cuda", TRITON, "triton"),
    ((9, 0), "model", torch.bfloat16, "cuda", AUTO, "triton"),  # Gluon would copy the strided views first
    ((9, 0), "model", torch.bfloat16, "cuda", GLUON, "gluon"),  # and does where asked to
]


@pytest.mark.parametrize("capability,shape,dtype,device,config,expected", DECISIONS)
def test_which_forward_decision_table(compiled_triton, capability, shape, dtype, device, config, expected):
    compiled_triton(capability)
    with FakeTensorMode():
        q = fake((2, 256, 4, 128), dtype, device).transpose(1, 2) if shape == "model" else fake(shape, dtype, device)
        assert fd.which_forward(q, q, q, True, config) == expected
        assert fd.which_forward(q, q, q, False, config) == expected
        refusal, declined = fd.gluon_refusal(q, q, q, True), fd.auto_declines_gluon(q, q, q, config)
    if config.forward_kernel == "auto":
        assert (refusal is None and declined is None) == (expected == "gluon")
    for reason in (refusal, declined):
        assert reason is None or "\n" not in reason  # one line, for a table's note


def test_refusals_say_why_in_one_line(compiled_triton):
    compiled_triton((8, 0))
    with FakeTensorMode():
        q = fake((1, 2, 64, 128))
        assert "sm_90" in fd.gluon_refusal(q, q, q, True) and "sm_80" in fd.gluon_refusal(q, q, q, True)
        compiled_triton((9, 0))
        assert "80" in fd.gluon_refusal(*(fake((1, 2, 64, 80)),) * 3, True)
        assert "bf16 or fp16" in fd.gluon_refusal(*(fake((1, 2, 64, 64), torch.float32),) * 3, True)
        assert "fwd_tiles" in fd.auto_declines_gluon(q, q, q, ft.FlashConfig(fwd_tiles=(64, 64, 4, 3)))
        strided = fake((1, 64, 2, 128)).transpose(1, 2)
        assert "strided" in fd.auto_declines_gluon(strided, strided, strided, AUTO)
        assert fd.auto_declines_gluon(q, q, q, AUTO) is None
        assert fd.gluon_refusal(strided, strided, strided, True) is None
        assert "(batch, seq, d)" in fd.gluon_refusal(fake((2, 64)), fake((2, 64)), fake((2, 64)), True)


def test_forcing_gluon_where_it_cannot_run_is_an_error(compiled_triton):
    compiled_triton((9, 0))
    with FakeTensorMode():
        d80 = fake((1, 2, 64, 80))
        with pytest.raises(ValueError, match="forward_kernel='gluon'.*head dimension"):
            fd.which_forward(d80, d80, d80, True, GLUON)
        compiled_triton((8, 9))
        q = fake((1, 2, 64, 64))
        with pytest.raises(ValueError, match="sm_89"):
            fd.which_forward(q, q, q, True, GLUON)
    with pytest.raises(ValueError, match="fwd_tiles"):
        ft.FlashConfig(forward_kernel="gluon", fwd_tiles=(64, 64, 4, 3))
    with pytest.raises(ValueError, match="forward_kernel"):
        ft.FlashConfig(forward_kernel="cudnn")


def test_the_interpreter_always_runs_the_portable_forward():
    """On this machine's Triton as it is (the interpreter without a GPU): never Gluon, and asking for it says
    why, eagerly and while tracing (the op's fake)."""
    if not fd.INTERPRET:
        pytest.skip("Triton compiles here")
    q = torch.randn(1, 2, 32, 64, dtype=torch.float16)
    assert fd.which_forward(q, q, q, True) == "triton"
    assert "interpreted" in fd.gluon_refusal(q, q, q, True)
    with pytest.raises(ValueError, match="interpreted"):
        ft.FlashAttentionTriton.apply(q, q, q, True, GLUON)
    with FakeTensorMode(), pytest.raises(ValueError, match="interpreted"):
        FORWARD(*(fake((1, 2, 32, 64), torch.float16, "cpu"),) * 3, True, *GLUON.op_args())
    # auto and triton run the same kernels here, to the bit
    q, k, v = (torch.randn(2, 3, 40, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    auto = ft.FlashAttentionTriton.apply(q, k, v, True, AUTO)
    torch.testing.assert_close(auto, ft.FlashAttentionTriton.apply(q, k, v, True, TRITON), atol=0, rtol=0)


def test_config_fields_round_trip_through_the_op_schema():
    config = ft.FlashConfig(autotune=True, fp32_precision="ieee", fwd_tiles=(32, 16, 4, 1), backward_launch="fused",
                            bwd_tiles=(16, 32, 32, 16, 4, 1), compile_inline=False, split_d="on",
                            forward_kernel="triton", backward_kernel="triton")
    assert ft.FlashConfig(*config.op_args()) == config
    assert ft.FlashConfig(*GLUON.op_args()).forward_kernel == "gluon"
    # the fields in declaration order, backward_kernel last (positional uses of the older fields keep working)
    names = [a.name for a in FORWARD._schema.arguments[-2:]]
    assert names == ["forward_kernel", "backward_kernel"]
    assert all(str(a.type) == "str" for a in FORWARD._schema.arguments[-2:])
    assert ft.FlashConfig().forward_kernel == ft.FlashConfig().backward_kernel == "auto"


def test_the_benchmark_rows_say_which_forward_ran(compiled_triton):
    """``attention_impl("triton")`` carries ``kernel(q, k, v, causal)``, which ``kernel_of`` writes into the
    rows: the Gluon forward on an sm_90 GPU where it can run, the portable one elsewhere."""
    for name in ("triton", "triton_compiled_bwd"):
        fn = attention_impl(name, "cpu")
        q = torch.zeros(4, 16, 64, dtype=torch.float16)
        compiled_triton((9, 0))
        assert fn.kernel(q, q, q, True) == "triton"  # CPU tensors
        with FakeTensorMode():
            q = fake((4, 16, 64))
            assert fn.kernel(q, q, q, True) == "gluon"
            assert fn.kernel(*(fake((4, 16, 80)),) * 3, True) == "triton"
            compiled_triton((8, 0))
            assert fn.kernel(q, q, q, True) == "triton"


# ------------------------------------------------------------------------------------ the Gluon branch's layout
def _reference_gluon(calls):
    """A stand-in for ``gluon_forward`` that checks what it is given and computes attention in float64."""
    def run(q, k, v, causal, tiles=None, out=None):
        calls.append((q.shape, out.shape, out.stride()))
        assert q.dim() == k.dim() == v.dim() == out.dim() == 4 and out.stride(-1) == 1
        scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), -math.inf)
        out.copy_(torch.softmax(scores, -1) @ v.double())
        return out, torch.logsumexp(scores, -1).float()
    return run


def test_gluon_branch_keeps_the_portable_contract(monkeypatch):
    """Where the Gluon forward runs (asked for), the output comes in q's layout (a head-strided view gets a
    head-strided output, as from the portable kernel, so the fake's strides hold) and the logsumexp has shape
    ``q.shape[:-1]``, for (batch, heads, seq, d) and (batch, seq, d) inputs."""
    calls = []
    monkeypatch.setattr(fd, "INTERPRET", False)
    monkeypatch.setattr(fd, "gluon_supported", lambda q, k, v, causal: None)
    monkeypatch.setattr(fd, "gluon_forward", _reference_gluon(calls))
    gen = torch.Generator().manual_seed(0)
    heads_strided = [torch.randn(2, 40, 3, 16, generator=gen).transpose(1, 2) for _ in range(3)]
    folded = [torch.randn(6, 40, 16, generator=gen) for _ in range(3)]
    for q, k, v in (heads_strided, folded):
        out, lse = fd.forward(q, k, v, True, GLUON)
        portable_out, portable_lse = ft.flash_forward(q, k, v, True)
        assert out.shape == q.shape and out.stride() == portable_out.stride()
        assert lse.shape == portable_lse.shape == q.shape[:-1] and lse.is_contiguous()
        torch.testing.assert_close(out, portable_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, portable_lse, atol=1e-5, rtol=1e-5)
    assert calls[1][0] == (1, 6, 40, 16)  # (batch, seq, d) runs as one batch of `batch` heads


# ------------------------------------------------------------------------------------------ traced calls
def _traced_forward(config, q):
    """The graph a functionalizing trace (what AOTAutograd does under torch.compile) makes of the forward op."""
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v):
        return FORWARD(q, k, v, True, *config.op_args())

    return make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, q, q).code


def test_traced_gluon_forward_stays_one_opaque_op(monkeypatch):
    """Inductor traces the launches of Triton-language kernels, not Gluon ones: where the Gluon forward runs, the
    traced op is its opaque twin even where the portable kernels would be inlined; with the portable forward
    chosen, the same config inlines its launches."""
    monkeypatch.setattr(fd, "INTERPRET", False)
    monkeypatch.setattr(fd, "gluon_supported", lambda q, k, v, causal: None)
    monkeypatch.setattr(ops, "inlines", lambda config, device: True)
    launched = []

    def inlined_forward(q, k, v, causal, config, launcher):
        launched.append(launcher)
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    monkeypatch.setattr(ops, "flash_forward", inlined_forward)
    q = torch.randn(1, 2, 32, 64, dtype=torch.float16)
    assert "lab.flash_attention_forward_opaque" in _traced_forward(AUTO, q) and not launched
    assert "flash_attention_forward_opaque" not in _traced_forward(TRITON, q)
    assert launched == [ops.inline_launch]


# ------------------------------------------------------------------------------------------------ sm_90 GPU
def _run(q, k, v, grad, causal, config):
    out = ft.FlashAttentionTriton.apply(q, k, v, causal, config)
    (lse,) = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    return (out, lse, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + f"-{s[4]}-causal{s[5]}")
def test_gpu_gluon_forward_with_triton_backward_matches_float64_and_the_portable_path(shape):
    """FlashAttentionTriton with the Gluon forward (asked for: auto takes it on contiguous inputs, not on the
    model's strided views) and the portable backward, against float64 and against the portable forward: the
    same values, the same layouts of the output and the gradients, the logsumexp the backward reads."""
    lead, n_q, n_k, d, dtype, causal = shape
    q, k, v = gpu_inputs(*shape[:5])
    assert fd.which_forward(q, k, v, causal, AUTO) == ("triton" if lead == "model" else "gluon")
    assert fd.which_forward(q, k, v, causal, GLUON) == "gluon"
    grad = torch.randn(q.shape, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(1))
    gluon = _run(q, k, v, grad, causal, GLUON.replace(backward_kernel="triton"))
    portable = _run(q, k, v, grad, causal, TRITON.replace(backward_kernel="triton"))
    reference = float64_reference(q, k, v, grad, causal)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, other, ref in zip(names, gluon, portable, reference):
        assert got.shape == ref.shape and got.stride() == other.stride(), name
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol, msg=f"{name} against float64")
        torch.testing.assert_close(got.float(), other.float(), atol=tol, rtol=tol, msg=f"{name} against portable")
    assert (gluon[1].double() - reference[1]).abs().max().item() < 1e-3  # the logsumexp the backward reads


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout,config", [("bhsd", AUTO), ("model", GLUON)], ids=["auto-contiguous", "gluon-model"])
def test_gpu_compiled_fullgraph_runs_the_gluon_forward_opaque_and_inlines_the_backward(layout, config):
    """torch.compile(fullgraph=True): no graph break, the Gluon forward as the opaque op (the only lab op left in
    the compiled code), the portable backward's kernels launched by Inductor; equal to eager to the bit (the same
    kernels run). On contiguous inputs under the default forward, and on the model's layout where asked for."""
    from torch._inductor.utils import run_and_get_code

    config = config.replace(backward_kernel="triton")  # the Gluon backward is checked in test_flash_backward_dispatch

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 1000, 4, 128) if layout == "model" else (2, 4, 1000, 128)
    base = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3)]
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    view = (lambda t: t.transpose(1, 2)) if layout == "model" else (lambda t: t)

    def step(fn):
        out = view(fn(*(view(t) for t in base)))
        return (out, *torch.autograd.grad(out, base, dout))

    attend = lambda q, k, v: ft.flash_attention_bhsd(q, k, v, True, config=config)
    assert fd.which_forward(*(view(t) for t in base), True, config) == "gluon"
    eager = step(attend)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    got, codes = run_and_get_code(lambda: step(compiled))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    code = "\n".join(codes)
    assert "lab.flash_attention_forward_opaque" in code and "_flash_fwd_kernel" not in code
    assert "_flash_bwd_kernel" in code and "lab.flash_attention_backward" not in code
