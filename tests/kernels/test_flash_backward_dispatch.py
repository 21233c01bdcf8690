"""Which FlashAttention backward runs (lab.kernels.flash_dispatch.which_backward / backward): the decision on any
machine (fake tensors, the GPU's compute capability stubbed), the config field and the op schemas that carry it,
the layout contract of the Gluon branch, what a traced backward decomposes into, and the result rows that say
which backward ran; on an sm_90 GPU, FlashAttentionTriton with the Gluon backward against float64 and the portable
backward, eager and compiled with fullgraph=True."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

ft = pytest.importorskip("lab.kernels.flash_triton")
fd = pytest.importorskip("lab.kernels.flash_dispatch")
ops = pytest.importorskip("lab.kernels.flash_triton_ops")

from lab.bench import attention_grid as ag  # noqa: E402
from lab.bench.attention import attention_impl  # noqa: E402
from tests.kernels.dispatch_support import GPU_SHAPES, fake, float64_reference, gpu_inputs, needs_hopper  # noqa: E402

AUTO, GLUON, TRITON = (ft.FlashConfig(backward_kernel=k) for k in ("auto", "gluon", "triton"))
BACKWARD = torch.ops.lab.flash_attention_backward.default


# ------------------------------------------------------------------------------------------------ decision
#: (compute capability, shape, dtype, device, config) -> the backward that runs; shape "model": (2, 256, 4, 128)
#: seen as (batch, heads, seq, d), the model's head-strided projections
DECISIONS = [
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", AUTO, "gluon"),
    ((9, 0), (2, 4, 256, 64), torch.float16, "cuda", AUTO, "gluon"),
    ((9, 0), (8, 256, 64), torch.bfloat16, "cuda", AUTO, "gluon"),  # (batch, seq, d): one batch of 8 heads
    ((9, 0), (2, 4, 256, 128), torch.float32, "cuda", AUTO, "triton"),
    ((9, 0), (2, 4, 256, 80), torch.bfloat16, "cuda", AUTO, "triton"),
    ((9, 0), (2, 4, 256, 256), torch.bfloat16, "cuda", AUTO, "triton"),
    ((8, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", AUTO, "triton"),
    ((10, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", AUTO, "triton"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cpu", AUTO, "triton"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "meta", AUTO, "triton"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", TRITON, "triton"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", GLUON, "gluon"),
    # the portable backward's launch fixed (a sweep timing it): auto keeps it
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", ft.FlashConfig(bwd_tiles=(64, 64, 64, 64, 4, 3)), "triton"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", ft.FlashConfig(backward_launch="two_pass"), "triton"),
    # the forward's settings do not enter
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", ft.FlashConfig(fwd_tiles=(64, 64, 4, 3)), "gluon"),
    ((9, 0), (2, 4, 256, 128), torch.bfloat16, "cuda", ft.FlashConfig(forward_kernel="triton"), "gluon"),
    ((9, 0), "model", torch.bfloat16, "cuda", AUTO, "triton"),  # Gluon would copy the strided views in and out
    ((9, 0), "model", torch.bfloat16, "cuda", GLUON, "gluon"),  # and does where asked to
]


@pytest.mark.parametrize("capability,shape,dtype,device,config,expected", DECISIONS)
def test_which_backward_decision_table(compiled_triton, capability, shape, dtype, device, config, expected):
    compiled_triton(capability)
    with FakeTensorMode():
        q = fake((2, 256, 4, 128), dtype, device).transpose(1, 2) if shape == "model" else fake(shape, dtype, device)
        assert fd.which_backward(q, q, q, True, config) == expected
        assert fd.which_backward(q, q, q, False, config) == expected
        refusal, declined = fd.gluon_refusal(q, q, q, True), fd.auto_declines_gluon(q, q, q, config, "bwd")
    if config.backward_kernel == "auto":
        assert (refusal is None and declined is None) == (expected == "gluon")
    for reason in (refusal, declined):
        assert reason is None or "\n" not in reason  # one line, for a table's note


def test_meta_tensors_answer_without_a_device(compiled_triton):
    compiled_triton((9, 0))
    q = fake((1, 2, 64, 128), device="meta")
    assert fd.which_backward(q, q, q, True) == "triton"
    assert fd.gluon_refusal(q, q, q, True) is not None


def test_the_forward_and_the_backward_decline_on_their_own_settings(compiled_triton):
    compiled_triton((9, 0))
    with FakeTensorMode():
        q = fake((1, 2, 64, 128))
        fwd_fixed, bwd_fixed = ft.FlashConfig(fwd_tiles=(64, 64, 4, 3)), ft.FlashConfig(backward_launch="fused")
        assert fd.auto_declines_gluon(q, q, q, fwd_fixed) is not None
        assert fd.auto_declines_gluon(q, q, q, fwd_fixed, "bwd") is None
        assert fd.auto_declines_gluon(q, q, q, bwd_fixed) is None
        assert fd.auto_declines_gluon(q, q, q, bwd_fixed, "bwd") is not None
        strided = fake((1, 64, 2, 128)).transpose(1, 2)
        assert fd.auto_declines_gluon(strided, strided, strided, AUTO, "bwd") is not None
        assert fd.which_forward(q, q, q, True, bwd_fixed) == "gluon"
        assert fd.which_backward(q, q, q, True, bwd_fixed) == "triton"


def test_forcing_the_gluon_backward_where_it_cannot_run_is_an_error(compiled_triton):
    compiled_triton((9, 0))
    with FakeTensorMode():
        d80 = fake((1, 2, 64, 80))
        with pytest.raises(ValueError, match="backward_kernel") as error:
            fd.which_backward(d80, d80, d80, True, GLUON)
        assert "\n" not in str(error.value)
        compiled_triton((8, 9))
        q = fake((1, 2, 64, 64))
        with pytest.raises(ValueError, match="sm_89"):
            fd.which_backward(q, q, q, True, GLUON)
        assert fd.which_forward(q, q, q, True, GLUON) == "triton"  # the forward's own setting is auto


def test_backward_kernel_is_validated_like_forward_kernel():
    assert ft.FlashConfig().backward_kernel == "auto"
    for kernel in ("auto", "gluon", "triton"):
        assert ft.FlashConfig(backward_kernel=kernel).backward_kernel == kernel
    with pytest.raises(ValueError, match="backward_kernel"):
        ft.FlashConfig(backward_kernel="cudnn")
    # the portable backward's launch settings cannot go with the Gluon backward
    for portable in (dict(bwd_tiles=(64, 64, 64, 64, 4, 3)), dict(backward_launch="fused")):
        with pytest.raises(ValueError, match="backward_kernel"):
            ft.FlashConfig(backward_kernel="gluon", **portable)
        assert ft.FlashConfig(backward_kernel="triton", **portable).backward_kernel == "triton"


# -------------------------------------------------------------------------------------------- op schemas
def test_the_op_schemas_carry_backward_kernel_last():
    forward = torch.ops.lab.flash_attention_forward.default
    opaque = (torch.ops.lab.flash_attention_forward_opaque.default,
              torch.ops.lab.flash_attention_backward_opaque.default)
    for op in (forward, BACKWARD, *opaque):
        assert [a.name for a in op._schema.arguments[-2:]] == ["forward_kernel", "backward_kernel"], op
        assert str(op._schema.arguments[-1].type) == "str"
    assert GLUON.op_args()[-1] == "gluon" and ft.FlashConfig(*GLUON.op_args()) == GLUON
    assert ft.FlashConfig(*TRITON.op_args()[:-1]) == ft.FlashConfig()  # positional uses without it: the default


# ------------------------------------------------------------------------------------------ interpreter
def _qkv(shape, n_k, dtype=torch.float32, seed=0):
    *lead, n_q, d = shape
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, n, d, generator=gen).to(dtype).requires_grad_() for n in (n_q, n_k, n_k))


def _forward_backward(fn, q, k, v):
    out = fn(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def test_the_interpreter_always_runs_the_portable_backward():
    """On this machine's Triton as it is (the interpreter without a GPU): never the Gluon backward, and asking for
    it is a one-line error when the backward runs, eagerly and while tracing (the op's fake); auto and triton run
    the same kernels, to the bit."""
    if not fd.INTERPRET:
        pytest.skip("Triton compiles here")
    q = torch.randn(1, 2, 32, 64, dtype=torch.float16)
    assert fd.which_backward(q, q, q, True) == "triton"
    q, k, v = _qkv((1, 2, 32, 64), 32, torch.float16)
    out = ft.FlashAttentionTriton.apply(q, k, v, True, GLUON)  # the forward runs: its own setting is auto
    with pytest.raises(ValueError, match="backward_kernel") as error:
        out.sum().backward()
    assert "\n" not in str(error.value)
    with FakeTensorMode(), pytest.raises(ValueError, match="backward_kernel"):
        t = fake((1, 2, 32, 64), torch.float16, "cpu")
        BACKWARD(t, t, t, t, t, fake((1, 2, 32), torch.float32, "cpu"), True, *GLUON.op_args())
    q, k, v = _qkv((2, 3, 40, 32), 40)
    auto = _forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True, AUTO), q, k, v)
    portable = _forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True, TRITON), q, k, v)
    for a, b in zip(auto, portable):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")  # the recording backend's
@pytest.mark.parametrize("config", [AUTO, TRITON], ids=["auto", "triton"])
def test_compiled_apply_with_backward_kernel_matches_eager(config):
    """torch.compile(FlashAttentionTriton.apply, fullgraph=True) with the new field in the config: the backward
    graph's op carries it, and values and gradients equal eager's to the bit (the same kernels run)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    q, k, v = _qkv((2, 45, 24), 33)
    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(ft.FlashAttentionTriton.apply, fullgraph=True, backend=backend)
    eager = _forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True, config), q, k, v)
    got = _forward_backward(lambda *t: compiled(*t, True, config), q, k, v)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    if fd.INTERPRET:
        (bw,) = backend.bw_graphs
        assert "lab.flash_attention_backward_opaque" in bw.code
        assert f"'auto', '{config.backward_kernel}')" in bw.code  # forward_kernel, backward_kernel: the last two


# ---------------------------------------------------------------------------------- the Gluon branch's layout
def _reference_gluon_backward(calls):
    """A stand-in for ``gluon_backward`` that checks what it is given and returns float64 gradients, contiguous,
    in q's dtype (as the kernel does)."""
    def run(q, k, v, out, lse, grad_out, causal, dq_writer=None):
        calls.append(q.shape)
        assert all(t.dim() == 4 for t in (q, k, v, out, grad_out)) and lse.shape == q.shape[:-1]
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        scores = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), -math.inf)
        grads = torch.autograd.grad(torch.softmax(scores, -1) @ v64, (q64, k64, v64), grad_out.double())
        return tuple(g.to(q.dtype).contiguous() for g in grads)
    return run


def test_gluon_branch_keeps_the_portable_contract(monkeypatch):
    """Where the Gluon backward runs (asked for), the gradients come in the layout the portable backward gives
    them (a head-strided input gets a head-strided gradient, so the op's fake strides hold) with its values, for
    (batch, heads, seq, d), head-strided and (batch, seq, d) inputs."""
    calls = []
    monkeypatch.setattr(fd, "INTERPRET", False)
    monkeypatch.setattr(fd, "gluon_supported", lambda q, k, v, causal: None)
    monkeypatch.setattr(fd, "gluon_backward", _reference_gluon_backward(calls))
    gen = torch.Generator().manual_seed(0)
    contiguous = [torch.randn(2, 3, 40, 16, generator=gen) for _ in range(3)]
    heads_strided = [torch.randn(2, 40, 3, 16, generator=gen).transpose(1, 2) for _ in range(3)]
    folded = [torch.randn(6, 40, 16, generator=gen) for _ in range(3)]
    for q, k, v in (contiguous, heads_strided, folded):
        out, lse = ft.flash_forward(q, k, v, True)
        grad_out = torch.randn(out.shape, generator=gen)
        got = fd.backward(q, k, v, out, lse, grad_out, True, GLUON)
        portable = ft.flash_backward(q, k, v, out, lse, grad_out, True)
        for g, p, t in zip(got, portable, (q, k, v)):
            assert g.shape == t.shape and g.stride() == p.stride() and g.dtype == t.dtype
            torch.testing.assert_close(g, p, atol=1e-5, rtol=1e-5)
    assert calls[-1] == (1, 6, 40, 16)  # (batch, seq, d) runs as one batch of `batch` heads


# ------------------------------------------------------------------------------------------ traced calls
def _traced_backward(config, q):
    """The graph a functionalizing trace (what AOTAutograd does under torch.compile) makes of the backward op."""
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, lse):
        return BACKWARD(q, q, q, q, q, lse, True, *config.op_args())

    lse = q.new_zeros(q.shape[:-1], dtype=torch.float32)
    return make_fx(dispatch_functionalize(f), tracing_mode="fake")(q, lse).code


def test_traced_gluon_backward_stays_one_opaque_op(monkeypatch):
    """Inductor traces the launches of Triton-language kernels, not Gluon ones: where the Gluon backward runs, the
    traced backward op is its opaque twin even where the portable kernels would be inlined; with the portable
    backward chosen, the same config inlines its launches."""
    monkeypatch.setattr(fd, "INTERPRET", False)
    monkeypatch.setattr(fd, "gluon_supported", lambda q, k, v, causal: None)
    monkeypatch.setattr(ops, "inlines", lambda config, device: True)
    launched = []

    def inlined_backward(q, k, v, out, lse, grad_out, causal, config, launcher):
        launched.append(launcher)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    monkeypatch.setattr(ops, "flash_backward", inlined_backward)
    q = torch.randn(1, 2, 32, 64, dtype=torch.float16)
    assert "lab.flash_attention_backward_opaque" in _traced_backward(AUTO, q) and not launched
    assert "flash_attention_backward_opaque" not in _traced_backward(TRITON, q)
    assert launched == [ops.inline_launch]


# ------------------------------------------------------------------------------------------ result rows
def test_the_benchmark_rows_say_which_backward_ran(compiled_triton):
    """``attention_impl("triton")`` carries ``bwd_kernel(q, k, v, causal)``, which ``kernel_of`` writes into the
    rows' ``bwd_kernel``: the Gluon backward on an sm_90 GPU where it can run, the portable one elsewhere;
    ``triton_compiled_bwd``'s backward is compiled PyTorch."""
    fn, compiled_bwd = attention_impl("triton", "cpu"), attention_impl("triton_compiled_bwd", "cpu")
    q = torch.zeros(4, 16, 64, dtype=torch.float16)
    compiled_triton((9, 0))
    assert ag.kernel_of("triton", fn, q, q, q, True, "bwd") == "triton"  # CPU tensors
    with FakeTensorMode():
        q = fake((4, 16, 64))
        assert ag.kernel_of("triton", fn, q, q, q, True, "bwd") == "gluon"
        assert ag.kernel_of("triton", fn, *(fake((4, 16, 80)),) * 3, True, "bwd") == "triton"
        assert ag.kernel_of("triton_compiled_bwd", compiled_bwd, q, q, q, True, "bwd") == "compiled"
        assert ag.kernel_of("triton_compiled_bwd", compiled_bwd, q, q, q, True) == "gluon"  # its forward
        assert ag.kernel_of("sdpa", fn, q, q, q, True, "bwd") == ""
        compiled_triton((8, 0))
        assert ag.kernel_of("triton", fn, q, q, q, True, "bwd") == "triton"


def test_grid_rows_carry_bwd_kernel():
    """A row of our implementation names its backward kernel next to its forward one, a Gluon backward's row
    says so in ``bwd_mode`` instead of the portable launch; a peer's row names none."""
    from lab.model.attention import naive_attention

    def ours(q, k, v, causal):
        return naive_attention(q, k, v, causal)

    ours.bwd_kernel = lambda q, k, v, causal: "gluon"
    df = ag.time_attention_grid({"triton": ours, "sdpa": attention_impl("sdpa", "cpu")}, [ag.Shape(1, 1, 16, 64)],
                                dtypes=("fp32",), cpu_steps=1, device="cpu", progress=False).set_index("impl")
    assert df.loc["triton", "kernel"] == "triton" and df.loc["triton", "bwd_kernel"] == "gluon"
    assert df.loc["triton", "bwd_mode"] == "gluon"
    assert df.loc["sdpa", "kernel"] == df.loc["sdpa", "bwd_kernel"] == ""


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms for one test: ``deterministic(warn_only)`` turns it on."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield lambda warn_only=False: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_algorithms_take_the_portable_backward(compiled_triton, deterministic):
    """PyTorch's deterministic switch is the backward's deterministic option: auto runs the portable backward
    (the same bits every run), forcing Gluon's is an error (a warning with warn_only); the forward, whose
    Gluon kernel adds nothing across programs, is not affected."""
    compiled_triton((9, 0))
    with FakeTensorMode():
        q = fake((1, 2, 64, 128))
        assert fd.which_backward(q, q, q, True, AUTO) == "gluon"
        deterministic()
        assert fd.which_backward(q, q, q, True, AUTO) == "triton"
        assert fd.auto_declines_gluon(q, q, q, AUTO, "bwd") == fd.DETERMINISTIC
        assert fd.which_forward(q, q, q, True, AUTO) == "gluon"
        with pytest.raises(RuntimeError, match="deterministic"):
            fd.which_backward(q, q, q, True, GLUON)
        deterministic(warn_only=True)
        with pytest.warns(UserWarning, match="deterministic"):
            assert fd.which_backward(q, q, q, True, GLUON) == "gluon"


# ------------------------------------------------------------------------------------------------ sm_90 GPU
@pytest.mark.gpu
@needs_hopper
def test_gpu_deterministic_backward_gives_the_same_bits_every_run(deterministic):
    """Under torch.use_deterministic_algorithms the model's attention call (auto config, contiguous inputs)
    returns bitwise the same gradients run after run."""
    q, k, v = gpu_inputs((2, 8), 1024, 1024, 128, torch.bfloat16)
    grad = torch.randn_like(q)
    deterministic()
    runs = [torch.autograd.grad(ft.FlashAttentionTriton.apply(q, k, v, True, AUTO), (q, k, v), grad) for _ in range(3)]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0]))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + f"-{s[4]}-causal{s[5]}")
@pytest.mark.parametrize("forward_kernel", ["gluon", "triton"])
def test_gpu_gluon_backward_matches_float64_and_the_portable_path(shape, forward_kernel):
    """FlashAttentionTriton with the Gluon backward (asked for: auto takes it on contiguous inputs, not on the
    model's strided views), after either forward, against float64 and against the portable backward: the same
    values and the same layouts of the gradients."""
    lead, n_q, n_k, d, dtype, causal = shape
    q, k, v = gpu_inputs(*shape[:5])
    assert fd.which_backward(q, k, v, causal, AUTO) == ("triton" if lead == "model" else "gluon")
    grad = torch.randn(q.shape, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(1))
    config = GLUON.replace(forward_kernel=forward_kernel)
    gluon = torch.autograd.grad(ft.FlashAttentionTriton.apply(q, k, v, causal, config), (q, k, v), grad)
    portable_config = ft.FlashConfig(forward_kernel="triton", backward_kernel="triton")
    portable = torch.autograd.grad(ft.FlashAttentionTriton.apply(q, k, v, causal, portable_config), (q, k, v), grad)
    reference = float64_reference(q, k, v, grad, causal)[2:]
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-2
    for name, got, other, ref in zip(("dq", "dk", "dv"), gluon, portable, reference):
        assert got.shape == ref.shape and got.stride() == other.stride() and got.dtype == dtype, name
        torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol, msg=f"{name} against float64")
        torch.testing.assert_close(got.float(), other.float(), atol=tol, rtol=tol, msg=f"{name} against portable")


@pytest.mark.gpu
@needs_hopper
def test_gpu_compiled_fullgraph_runs_both_gluon_kernels_opaque():
    """torch.compile(fullgraph=True) under the default config on contiguous inputs: no graph break, the Gluon
    forward and the Gluon backward as their opaque ops, no portable kernel in the compiled code; the output, dK and
    dV equal eager's to the bit (the same kernels run), dQ within rounding (the Gluon backward sums it over key
    tiles in device memory, in an order that varies from run to run)."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(3)]
    dout = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(fn):
        out = fn(*base)
        return (out, *torch.autograd.grad(out, base, dout))

    attend = lambda q, k, v: ft.flash_attention_bhsd(q, k, v, True)
    assert fd.which_forward(*base, True) == fd.which_backward(*base, True) == "gluon"
    eager = step(attend)
    torch._dynamo.reset()
    got, codes = run_and_get_code(lambda: step(torch.compile(attend, fullgraph=True)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, eager):
        tol = 1e-2 if name == "dq" else 0
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)
    code = "\n".join(codes)
    assert "lab.flash_attention_forward_opaque" in code and "lab.flash_attention_backward_opaque" in code
    assert "_flash_fwd_kernel" not in code and "_flash_bwd_kernel" not in code
