"""The Triton FlashAttention kernels under torch.compile: the torch.library ops (schema, fake shapes,
autograd), and whole graphs with no graph break.

On the CPU the kernels run interpreted and ``torch.compile`` uses the ``aot_eager`` backend (dynamo and
AOTAutograd trace exactly as they would for Inductor, the kernels run as registered ops). GPU-marked tests
use the default Inductor backend, including the course's test at (16, 16384, 64).
"""

import pytest
import torch

ft = pytest.importorskip("lab.kernels.flash_triton")
ops = pytest.importorskip("lab.kernels.flash_triton_ops")

from lab.model import ModelConfig, TransformerLM  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
BACKEND = "inductor" if ON_GPU else "aot_eager"
FORWARD = torch.ops.lab.flash_attention_forward.default
BACKWARD = torch.ops.lab.flash_attention_backward.default


def random_qkv(shape_q, n_k, dtype=torch.float32, seed=0, device=DEVICE):
    *lead, n_q, d = shape_q
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, n, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                 for n in (n_q, n_k, n_k))


def forward_backward(fn, q, k, v, seed=1):
    out = fn(q, k, v)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


# ---------------------------------------------------------------------------------------------- ops
def test_op_schema_carries_the_config_fields_in_order():
    names = [a.name for a in FORWARD._schema.arguments]
    fields = [f.name for f in ft.FlashConfig.__dataclass_fields__.values()]
    assert names == ["q", "k", "v", "causal", *fields]
    assert [a.name for a in BACKWARD._schema.arguments] == ["grad_out", "q", "k", "v", "out", "lse", "causal", *fields]


@pytest.mark.parametrize("shape_q,n_k", [((2, 20, 24), 33), ((1, 2, 19, 16), 19)])
def test_opcheck_forward_and_backward(shape_q, n_k):
    """torch.library.opcheck: schema, fake-tensor implementation, autograd registration and AOT dispatch
    of both ops agree with the real kernels."""
    q, k, v = (t.detach() for t in random_qkv(shape_q, n_k))
    args = ft.FlashConfig().op_args()
    torch.library.opcheck(FORWARD, (q, k, v, True, *args))
    torch.library.opcheck(FORWARD, (*(t.clone().requires_grad_() for t in (q, k, v)), False, *args))
    out, lse = ft.flash_forward(q, k, v, True)
    torch.library.opcheck(BACKWARD, (torch.randn_like(out), q, k, v, out, lse, True, *args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_tensor_shapes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for shape_q, n_k in [((3, 70, 80), 50), ((2, 5, 70, 96), 90)]:
            *lead, n_q, d = shape_q
            q = torch.empty(*lead, n_q, d, dtype=dtype, device=DEVICE)
            k = v = torch.empty(*lead, n_k, d, dtype=dtype, device=DEVICE)
            out, lse = FORWARD(q, k, v, True, *ft.FlashConfig().op_args())
            assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
            assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
            dq, dk, dv = BACKWARD(out, q, k, v, out, lse, True, *ft.FlashConfig().op_args())
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dk.dtype == dtype
        with pytest.raises(ValueError, match="multiple of 8"):
            FORWARD(*(torch.empty(1, 4, 12, device=DEVICE),) * 3, True, *ft.FlashConfig().op_args())


def test_a_dispatch_mode_sees_the_ops_by_name():
    """Eager calls on plain tensors skip the dispatcher (the host functions directly) only where no dispatch
    mode is active: inside one (selective activation checkpointing keeps an op's outputs by seeing it) the
    forward and the backward arrive as the registered ops, and compute the same values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = random_qkv((2, 37, 40), 29)
    plain = forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True), q, k, v)
    assert not ops.dispatch_mode_active()
    with Record():
        assert ops.dispatch_mode_active()
        recorded = forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True), q, k, v)
    assert seen.count(FORWARD) == 1 and seen.count(BACKWARD) == 1
    for a, b in zip(recorded, plain):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_forward_op_is_differentiable_like_the_function():
    """The forward op's registered autograd (backward = the backward op) and FlashAttentionTriton (which
    calls the host functions directly in eager mode) give the same output and gradients."""
    q, k, v = random_qkv((2, 37, 40), 29)
    args = ft.FlashConfig().op_args()
    by_op = forward_backward(lambda *t: FORWARD(*t, True, *args)[0], q, k, v)
    by_function = forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True), q, k, v)
    for a, b in zip(by_op, by_function):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------- compile
@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")  # the recording backend's
@pytest.mark.parametrize("config", [None, ft.FlashConfig(backward_launch="two_pass")], ids=["default", "two_pass"])
def test_compiled_apply_fullgraph_matches_eager(config):
    """torch.compile(FlashAttentionTriton.apply, fullgraph=True): a forward graph holding the forward op and
    a backward graph holding the backward op, with the config's fields as their arguments; the same values
    and gradients as eager (the same kernels run, so equal to the bit)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    q, k, v = random_qkv((2, 45, 24), 33)
    backend = BACKEND if ON_GPU else AotEagerAndRecordGraphs()
    compiled = torch.compile(ft.FlashAttentionTriton.apply, fullgraph=True, backend=backend)
    eager = forward_backward(lambda *t: ft.FlashAttentionTriton.apply(*t, True, config), q, k, v)
    got = forward_backward(lambda *t: compiled(*t, True, config), q, k, v)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    if not ON_GPU:
        (fw,), (bw,) = backend.fw_graphs, backend.bw_graphs
        # interpreted launches cannot be traced: each op decomposes into its opaque twin
        assert "lab.flash_attention_forward_opaque" in fw.code and "lab.flash_attention_backward_opaque" in bw.code
        expected = "[], 'two_pass', []" if config else "[], 'auto', []"  # backward_launch between the tiles
        assert expected in bw.code


def _model_and_batch(dtype=torch.float32):
    cfg = ModelConfig(d_model=64, d_ff=128, num_layers=1, num_heads=4, vocab_size=50, context_length=32,
                      attention="flash_triton")
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(device=DEVICE, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    tokens, targets = (torch.randint(0, 50, (2, 32), generator=gen).to(DEVICE) for _ in range(2))
    return model, tokens, targets


def _loss_and_grads(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_model_traces_without_graph_breaks_and_matches_eager(monkeypatch):
    from lab.model import attention

    # as in a fresh process: the registry has not imported the kernels' module yet (the model must, when built)
    monkeypatch.delitem(attention.ATTENTION, "flash_triton", raising=False)
    model, tokens, targets = _model_and_batch()
    explained = torch._dynamo.explain(model)(tokens, targets)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    eager = _loss_and_grads(model, tokens, targets)
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    loss, grads = _loss_and_grads(compiled, tokens, targets)
    tol = 1e-4 if ON_GPU else 1e-6  # Inductor fuses the model's other fp32 ops in its own order
    torch.testing.assert_close(loss, eager[0], atol=tol, rtol=tol)
    for g, e in zip(grads, eager[1]):
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
def test_gpu_inductor_model_bf16_matches_eager():
    model, tokens, targets = _model_and_batch(torch.bfloat16)
    eager = _loss_and_grads(model, tokens, targets)
    loss, grads = _loss_and_grads(torch.compile(model, fullgraph=True), tokens, targets)
    torch.testing.assert_close(loss, eager[0], atol=2e-2, rtol=2e-2)
    for g, e in zip(grads, eager[1]):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_course_compile_test():
    """The course's test: torch.compile(FlashAttentionTriton.apply) at (16, 16384, 64), bf16, causal,
    forward, o.sum(), backward; runs and matches eager."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(16, 16384, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    compiled = torch.compile(ft.FlashAttentionTriton.apply)
    results = []
    for fn in (ft.FlashAttentionTriton.apply, compiled):
        o = fn(q, k, v, True)
        o.sum().backward()
        results.append((o.detach().clone(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------- inlined kernels (GPU)
def test_inlines_only_compiled_kernels_without_data_dependent_setup(monkeypatch):
    """compile_inline decomposes the ops only where tracing can: compiled (not interpreted) kernels on a
    CUDA device, no autotuning; the interpreter always keeps the opaque op."""
    import lab.kernels.flash_config as fc

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on = ft.FlashConfig(compile_inline=True)
    monkeypatch.setattr(fc, "INTERPRET", True)
    assert not fc.inlines(on, cuda)
    monkeypatch.setattr(fc, "INTERPRET", False)
    assert fc.inlines(on, cuda) and not fc.inlines(on, cpu) and not fc.inlines(on.replace(compile_inline=False), cuda)
    assert fc.inlines(ft.FlashConfig(), cuda)  # the default
    assert fc.inlines(on.replace(backward_launch="two_pass"), cuda)
    assert not fc.inlines(on.replace(autotune=True), cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("launch_mode", ["fused", "two_pass"])
def test_gpu_inlined_kernels_in_the_compiled_code(inline, launch_mode):
    """Under Inductor with compile_inline the compiled code launches the Triton kernels itself (no call of
    the lab ops left), without it it calls the ops; both equal eager to the bit (the same kernels on the
    same tiles), in the model's head-strided layout."""
    from torch._inductor.utils import run_and_get_code

    config = ft.FlashConfig(compile_inline=inline, backward_launch=launch_mode)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(2, 300, 4, 80, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
            for _ in range(3)]
    dout = torch.randn(2, 300, 320, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step(fn):
        out = fn(*(t.transpose(1, 2) for t in base)).transpose(1, 2).reshape(2, 300, 320)
        return (out, *torch.autograd.grad(out, base, dout))

    attend = lambda q, k, v: ft.flash_attention_bhsd(q, k, v, True, config=config)
    eager = step(attend)
    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True)
    got, codes = run_and_get_code(lambda: step(compiled))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    code = "\n".join(codes)
    assert ("lab.flash_attention_forward" in code) != inline and ("lab.flash_attention_backward" in code) != inline
    assert ("_flash_fwd_kernel" in code and "_flash_bwd_kernel" in code) == inline
