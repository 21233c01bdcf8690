"""The fused LM head + cross-entropy against float64 PyTorch, under torch.compile, in the model and inside FSDP.

Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before this module is imported, so the kernels run
interpreted on CPU tensors (16x16x16 tiles): shapes stay tiny and odd (token counts, vocabularies and widths
that are not multiples of the tile). GPU-marked tests run realistic sizes against an fp32 reference.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

fce = pytest.importorskip("lab.kernels.fused_cross_entropy")
kernels = pytest.importorskip("lab.kernels.fused_cross_entropy_kernels")

from lab.kernels.sm90_compile import call_without_interpreter  # noqa: E402
from lab.model.transformer import ModelConfig, TransformerLM  # noqa: E402
from lab.parallel import launcher as distributed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# largest |error| / largest |reference| allowed for the gradients: fp32 accumulation everywhere, so the error
# is that of rounding dZ and the results to the input dtype (2**-11 fp16, 2**-8 bf16) plus slack
GRAD_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2}
# the loss from logits rounded to the input dtype (gradients in the forward), against float64
LOSS_TOL_ROUNDED = {"fp16": 1e-3, "bf16": 8e-3}


def inputs(n, d, v, dtype=torch.float32, scale=1.0, seed=0, ignore_every=0, device=DEVICE):
    """hidden (n, d), weight (v, d) (logits of std ~ ``scale``), targets (n,) with every ``ignore_every``-th
    target set to -100. The 16-bit tensors are the rounded fp32 ones (the reference starts from them)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) * (scale / d**0.5)
    targets = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        targets[::ignore_every] = -100
    return (hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_(), targets.to(device))


def reference64(hidden, weight, targets, reduction="mean", ignore_index=-100, grad_out=None):
    """Loss and (d_hidden, d_weight) of the materialized loss in float64 on the CPU."""
    h = hidden.detach().cpu().double().requires_grad_()
    w = weight.detach().cpu().double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, targets.cpu(), reduction=reduction, ignore_index=ignore_index)
    grads = torch.autograd.grad(loss, (h, w), grad_out.cpu().double() if grad_out is not None else None)
    return loss.detach(), grads


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.detach().cpu().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def materialized_loss(hidden, weight, targets, reduction="mean", ignore_index=-100):
    """The materialized loss in the inputs' dtype: logits rounded to it, cross-entropy in fp32."""
    return F.cross_entropy((hidden.detach() @ weight.detach().T).float(), targets, reduction=reduction,
                           ignore_index=ignore_index)


def check(hidden, weight, targets, dtype_name, reduction="mean", ignore_index=-100, grad_out_scale=1.0, **kwargs):
    """Run the fused loss forward and backward (upstream gradient ``grad_out_scale``, random per token for
    "none") and compare loss and gradients with float64."""
    loss = fce.fused_linear_cross_entropy(hidden, weight, targets, reduction, ignore_index, **kwargs)
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)) if reduction == "none" else \
        torch.tensor(grad_out_scale)
    grads = torch.autograd.grad(loss, (hidden, weight), grad_out.to(loss.device))
    ref_loss, ref_grads = reference64(hidden, weight, targets, reduction, ignore_index, grad_out)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    in_forward = reduction != "none" and kwargs.get("grad_in_forward") is not False and \
        kwargs.get("softmax_skip_threshold") is None
    if in_forward and dtype_name != "fp32":
        # cuBLAS rounds the logits to the input dtype, as the materialized loss does: equal to that loss ...
        torch.testing.assert_close(loss.detach(), materialized_loss(hidden, weight, targets, reduction, ignore_index),
                                   rtol=2e-5, atol=2e-5)
        # ... and off float64 by the rounding of the logits (relative 2**-9 in bf16, 2**-12 in fp16)
        torch.testing.assert_close(loss.detach().cpu().double(), ref_loss, rtol=LOSS_TOL_ROUNDED[dtype_name],
                                   atol=LOSS_TOL_ROUNDED[dtype_name])
    else:  # fp32 logits: fp32-accurate in any input dtype
        torch.testing.assert_close(loss.detach().cpu().double(), ref_loss, rtol=2e-5, atol=2e-5)
    for name, g, r, x in zip(("d_hidden", "d_weight"), grads, ref_grads, (hidden, weight)):
        assert g.dtype == x.dtype and g.shape == x.shape
        assert rel_err(g, r) < GRAD_TOL[dtype_name], f"{name}: {rel_err(g, r):.2e}"
    return loss, grads


# ------------------------------------------------------------------------------------- loss and gradients
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(37, 40, 100), (64, 80, 48)], ids=["ragged", "even"])
def test_matches_float64(shape, reduction, dtype):
    """Default path (gradients in the forward for mean/sum, recompute for none). Odd token count, vocabulary
    and width not multiples of the 16-wide tiles (ragged), or exact (even); some targets ignored; V = 100
    streams the rows kernel's blocks, V = 48 holds each row in registers."""
    n, d, v = shape
    check(*inputs(n, d, v, DTYPES[dtype], scale=3.0, ignore_every=7), dtype, reduction, grad_out_scale=0.7)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_recompute_backward_matches_float64(reduction, dtype):
    check(*inputs(37, 40, 100, DTYPES[dtype], scale=3.0, ignore_every=7), dtype, reduction, grad_in_forward=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_many_vocabulary_chunks_in_the_recompute_backward(monkeypatch, dtype):
    """Several vocabulary chunks (the fp32 d_hidden accumulator: first, middle and last chunk). Sizes follow
    the tile configs in use (16 interpreted, 64-128 compiled)."""
    dt = DTYPES[dtype]
    align = max(kernels.config("dlogits", dt)["BLOCK_N"], kernels.config("matmul", dt)["BLOCK_K"])
    n, v = 45, 5 * align + 7  # 3 vocabulary chunks of 2, 2, 1+ tiles
    element = 4 if dt == torch.float32 or kernels.interpreter_needs_fp32(dt) else 2
    monkeypatch.setattr(fce, "SCRATCH_BYTES", n * element * 2 * align)
    assert fce.chunk_columns(n, v, torch.float32 if element == 4 else dt) == 2 * align
    hidden, weight, targets = inputs(n, 24, v, dt, scale=3.0, ignore_every=5)
    for reduction in ("mean", "sum"):
        check(hidden, weight, targets, dtype, reduction, grad_in_forward=False)


@pytest.mark.parametrize("fp32_accumulator", [False, True], ids=["dw_in_weight_dtype", "dw_in_fp32"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_many_token_chunks(monkeypatch, dtype, fp32_accumulator):
    """Token chunks of 16 rows (3 of them, the last ragged), dW summed in the weight's dtype or, where the
    budget is made to hold it, in fp32."""
    if fp32_accumulator:  # a budget that holds the V x D accumulator beside a full-size chunk
        monkeypatch.setattr(fce, "EXTRA_MEMORY_SHARE", 100.0)
        monkeypatch.setattr(fce, "MAX_CHUNK_TOKENS", 16)
        monkeypatch.setattr(fce, "CHUNK_ALIGN", 16)
    hidden, weight, targets = inputs(45, 24, 70, DTYPES[dtype], scale=3.0, ignore_every=5)
    plan = fce.chunk_plan(45, 24, 70, DTYPES[dtype], chunk_tokens=None if fp32_accumulator else 16)
    assert plan.rows == 16 and plan.fp32_accumulator == (fp32_accumulator and dtype != "fp32")
    for reduction in ("mean", "sum"):
        check(hidden, weight, targets, dtype, reduction, chunk_tokens=None if fp32_accumulator else 16)


def test_chunk_plan_budget():
    """At the benchmark's shapes the chunk stays within 4.5% of the eager materialized loss's 12 N V bytes (4
    chunks: 8192 and 4096 tokens) and dW is summed in bf16; a long batch affords the fp32 accumulator; a
    short one is one chunk."""
    bf16 = torch.bfloat16
    for (n, d, v), rows in (((32768, 4096, 151936), 8192), ((16384, 2560, 10000), 4096)):
        plan = fce.chunk_plan(n, d, v, bf16)
        assert plan == (rows, False) and rows * v * 2 <= 0.045 * 12 * n * v
    uneven = fce.chunk_plan(30000, 4096, 151936, bf16)  # evened out: no small last chunk
    chunks = -(-30000 // uneven.rows)
    assert uneven.rows % fce.CHUNK_ALIGN == 0 and chunks * uneven.rows - 30000 < chunks * fce.CHUNK_ALIGN
    long = fce.chunk_plan(131072, 4096, 151936, bf16)
    assert long.fp32_accumulator and long.rows == fce.MAX_CHUNK_TOKENS
    assert 4 * 151936 * 4096 + long.rows * 151936 * 2 <= 0.045 * 12 * 131072 * 151936
    assert not fce.chunk_plan(131072, 4096, 151936, bf16, need_weight=False).fp32_accumulator
    assert not fce.chunk_plan(131072, 4096, 151936, torch.float32).fp32_accumulator  # already fp32
    assert fce.chunk_plan(700, 64, 1000, bf16) == (700, False)  # one chunk (the floor of 1024 rows)
    assert fce.chunk_plan(700, 64, 1000, bf16, chunk_tokens=300) == (300, False)


def test_backward_allocates_nothing_of_the_gradients_size():
    """The backward scales the gradients held from the forward in place and gets no zero-filled gradients
    for the op's gradient outputs: no allocation as large as d_hidden (N x D) during it."""
    hidden, weight, targets = inputs(64, 32, 300)
    loss = fce.fused_linear_cross_entropy(hidden, weight, targets)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.autograd.grad(3 * loss, (hidden, weight))
    allocated = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(allocated, default=0) < 64 * 32 * 4
    # the same profile sees the forward's allocations: the check can fail
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fce.fused_linear_cross_entropy(hidden, weight, targets)
    assert max(e.cpu_memory_usage for e in prof.events()) >= 300 * 32 * 4


def test_d_weight_rounding_bounds(monkeypatch):
    """dW from 8 token chunks in bf16 against float64 from the same dZ (the rows kernel's, rounded to bf16):
    summed in fp32 it is off by one rounding of the result (2**-8 relative); summed in bf16 by at most one
    rounding of each of the 8 partial sums, and by more than the fp32 sum."""
    n, d, v, rows = 512, 32, 64, 64
    hidden, weight, targets = (x.detach() for x in inputs(n, d, v, torch.bfloat16, scale=3.0))
    dz = hidden @ weight.T  # the logits as the op stores them, then dZ written over them by the same kernel
    lse, target_logit = torch.empty(n), torch.empty(n)
    kernels.launch_rows(dz, targets, torch.tensor([1.0 / n]), lse, target_logit, -100, write_grad=True)
    h64 = hidden.double()
    partials = torch.stack([dz[:r].double().T @ h64[:r] for r in range(rows, n + 1, rows)])
    exact, u = partials[-1], 2.0**-8
    errors = {}
    for fp32 in (False, True):
        monkeypatch.setattr(fce, "chunk_plan", lambda *a, plan=fce.ChunkPlan(rows, fp32), **k: plan)
        d_weight = fce.loss_and_gradients(hidden, weight, targets, -100, True)[2]
        errors[fp32] = (d_weight.double() - exact).abs().max().item()
    assert errors[True] <= 1.01 * u * exact.abs().max().item()  # one final rounding
    assert errors[False] <= (n // rows) * u * partials.abs().max().item()
    assert errors[False] > errors[True]


@pytest.mark.parametrize("grad_in_forward", [False, None], ids=["recompute", "grad_in_forward"])
def test_ignored_targets(grad_in_forward):
    hidden, weight, targets = inputs(21, 16, 40)
    # every target ignored: sum is 0, mean is NaN (as torch), and the gradients are 0 either way
    ignored = torch.full_like(targets, -100)
    for reduction, expected in (("sum", 0.0), ("mean", float("nan"))):
        loss = fce.fused_linear_cross_entropy(hidden, weight, ignored, reduction, grad_in_forward=grad_in_forward)
        torch_loss = F.cross_entropy((hidden @ weight.T).float(), ignored, reduction=reduction)
        torch.testing.assert_close(loss, torch_loss, equal_nan=True)
        assert loss.item() == expected or (loss.isnan().item() and expected != expected)
        for g in torch.autograd.grad(loss, (hidden, weight)):
            assert torch.equal(g, torch.zeros_like(g))
    # an ignore_index inside the vocabulary
    check(hidden, weight, torch.where(targets % 3 == 0, 5, targets), "fp32", "mean", ignore_index=5,
          grad_in_forward=grad_in_forward)


def test_out_of_range_target_gives_nan_and_empty_input_works():
    hidden, weight, targets = inputs(9, 16, 20)
    targets[2] = 20
    assert fce.fused_linear_cross_entropy(hidden, weight, targets, "sum").isnan()
    losses = fce.fused_linear_cross_entropy(hidden, weight, targets, "none")
    assert losses.isnan().tolist() == [i == 2 for i in range(9)]
    empty = fce.fused_linear_cross_entropy(hidden[:0], weight, targets[:0], "sum")
    assert empty.item() == 0.0
    assert torch.equal(torch.autograd.grad(empty, weight)[0], torch.zeros_like(weight))


def test_leading_dims_and_frozen_weight():
    """(batch, seq, D) hidden and (batch, seq) targets; a weight without gradient gets no d_weight GEMM."""
    hidden, weight, targets = inputs(24, 16, 30)
    weight = weight.detach()
    loss = fce.fused_linear_cross_entropy(hidden.reshape(2, 12, 16), weight, targets.reshape(2, 12), "none")
    assert loss.shape == (2, 12)
    ref_loss, (ref_dh, _) = reference64(hidden, weight, targets, "sum")
    (dh,) = torch.autograd.grad(loss.sum(), hidden)
    assert rel_err(dh, ref_dh) < 1e-5
    torch.testing.assert_close(loss.sum().double(), ref_loss, rtol=1e-5, atol=1e-5)


def test_no_grad_runs_forward_only(monkeypatch):
    """Without gradients the default path runs the logits GEMM and the lse only: no dZ, no gradient GEMM."""
    hidden, weight, targets = inputs(10, 16, 20)
    calls = []
    launch = kernels.launch_rows
    monkeypatch.setattr(kernels, "launch_rows", lambda *a, **k: calls.append(k["write_grad"]) or launch(*a, **k))
    with torch.no_grad():
        loss = fce.fused_linear_cross_entropy(hidden, weight, targets)
    assert calls == [False]
    torch.testing.assert_close(loss.double(), reference64(hidden, weight, targets)[0], rtol=1e-5, atol=1e-5)
    _, d_hidden, d_weight = fce._loss_and_grads_op(hidden.detach(), weight.detach(), targets, -100, True, False,
                                                   False, 0)
    assert d_hidden.numel() == d_weight.numel() == 0


def test_second_backward_through_held_gradients_is_refused():
    """The backward scales the gradients held from the forward in place: a second backward through the same
    graph would scale them twice, and autograd refuses it (the saved tensors were modified)."""
    hidden, weight, targets = inputs(10, 16, 20)
    loss = fce.fused_linear_cross_entropy(hidden, weight, targets)
    (2 * loss).backward(retain_graph=True)
    ref = reference64(hidden, weight, targets, grad_out=torch.tensor(2.0))[1]
    assert rel_err(hidden.grad, ref[0]) < 1e-5 and rel_err(weight.grad, ref[1]) < 1e-5
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_input_errors():
    hidden, weight, targets = inputs(8, 16, 20)
    with pytest.raises(ValueError, match="reduction"):
        fce.fused_linear_cross_entropy(hidden, weight, targets, "avg")
    with pytest.raises(TypeError, match="share"):
        fce.fused_linear_cross_entropy(hidden, weight.detach().half(), targets)
    with pytest.raises(ValueError, match="shapes"):
        fce.fused_linear_cross_entropy(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match="grad_in_forward"):
        fce.fused_linear_cross_entropy(hidden, weight, targets, "none", grad_in_forward=True)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fce.fused_linear_cross_entropy(hidden, weight, targets, chunk_tokens=0)


def test_autocast_casts_both_operands():
    hidden, weight, targets = inputs(12, 16, 20)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = fce.fused_linear_cross_entropy(hidden, weight, targets)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert dh.dtype == dw.dtype == torch.float32  # back through the casts to the fp32 leaves
    # ours keeps fp32 logits, torch rounds them to bf16: agree to bf16 rounding of the logits
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------- skip threshold
def skipped_reference(hidden, weight, targets, threshold, tile_m, tile_n):
    """float64 gradients of the mean loss with dZ zeroed on every (tile_m x tile_n) tile whose softmax entries
    are all below ``threshold`` and which holds no target: what skipping those tiles means."""
    h, w = hidden.detach().cpu().double(), weight.detach().cpu().double()
    probs = torch.softmax(h @ w.T, dim=1)
    onehot = F.one_hot(targets.cpu(), w.shape[0]).double()
    dz = (probs - onehot) / len(targets)
    for i in range(0, dz.shape[0], tile_m):
        for j in range(0, dz.shape[1], tile_n):
            if probs[i:i + tile_m, j:j + tile_n].max() < threshold and not onehot[i:i + tile_m, j:j + tile_n].any():
                dz[i:i + tile_m, j:j + tile_n] = 0
    return dz @ w, dz.T @ h, (dz == 0).double().mean().item()


@pytest.mark.skipif(DEVICE != "cpu", reason="uses the interpreter's fixed tile size")
def test_skip_threshold(monkeypatch):
    monkeypatch.setattr(fce, "SCRATCH_BYTES", 20 * 4 * 64)  # two vocabulary chunks: the flags are reused
    hidden, weight, targets = inputs(20, 32, 100, scale=4.0)
    with torch.no_grad():  # the first 16 columns carry most of the mass and all the targets
        weight[16:] *= 0.05
    targets = targets % 16
    exact = check(hidden, weight, targets, "fp32", grad_in_forward=False)[1]  # the recompute path, flags off
    # threshold 0: every tile is kept, through the flag path: bitwise the exact result
    zero = torch.autograd.grad(fce.fused_linear_cross_entropy(hidden, weight, targets, softmax_skip_threshold=0.0),
                               (hidden, weight))
    assert all(torch.equal(a, b) for a, b in zip(zero, exact))
    # a threshold large enough that the skipped part is visible (in real use it is ~2**-12)
    tile = kernels._INTERPRET_CONFIG
    ref_dh, ref_dw, skipped = skipped_reference(hidden, weight, targets, 0.02, tile["BLOCK_M"], tile["BLOCK_N"])
    assert skipped > 0.5  # most tiles are skipped
    loss = fce.fused_linear_cross_entropy(hidden, weight, targets, softmax_skip_threshold=0.02)
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert rel_err(dh, ref_dh) < 1e-5 and rel_err(dw, ref_dw) < 1e-5  # exactly those tiles were skipped
    full_dh, full_dw = reference64(hidden, weight, targets)[1]
    for got, full in ((dh, full_dh), (dw, full_dw)):
        assert 1e-4 < rel_err(got, full) < 2e-2  # a visible but small error


# ------------------------------------------------------------------------------------ torch.library, compile
def test_opcheck():
    hidden, weight, targets = inputs(20, 24, 40, ignore_every=4)
    torch.library.opcheck(fce._forward_op, (hidden, weight, targets, None))
    for need in ((True, True), (False, True), (True, False), (False, False)):
        torch.library.opcheck(fce._loss_and_grads_op, (hidden, weight, targets, -100, True, *need, 8))
    lse, _ = fce._forward_op(hidden.detach(), weight.detach(), targets, None)
    g = torch.randn(20)
    for need in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(fce._backward_op, (hidden.detach(), weight.detach(), targets, lse, g, -g, 1e-3, *need))


@pytest.mark.parametrize("grad_in_forward", [False, None], ids=["recompute", "grad_in_forward"])
def test_compile_fullgraph_matches_eager(grad_in_forward):
    hidden, weight, targets = inputs(20, 24, 40, ignore_every=4)

    def loss_fn(h, w, t):
        return 2.0 * fce.fused_linear_cross_entropy(h, w, t, grad_in_forward=grad_in_forward)

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    loss = loss_fn(hidden, weight, targets)
    grads = torch.autograd.grad(loss, (hidden, weight))
    c_loss = compiled(hidden, weight, targets)
    c_grads = torch.autograd.grad(c_loss, (hidden, weight))
    # aot_eager runs the same ops: bitwise equal; Inductor may sum the per-token losses in another order
    tol = dict(rtol=0, atol=0) if backend == "aot_eager" else dict(rtol=1e-6, atol=1e-6)
    for a, b in zip((loss, *grads), (c_loss, *c_grads)):
        torch.testing.assert_close(b, a, **tol)


# ------------------------------------------------------------------------------------------------ the model
def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**dict(d_model=32, d_ff=64, num_layers=1, num_heads=4, context_length=16,
                                 vocab_size=72), **overrides})


def test_transformer_fused_loss_equals_materialized():
    torch.manual_seed(0)
    fused = TransformerLM(tiny_config(fused_loss=True)).to(DEVICE)
    plain = TransformerLM(tiny_config(fused_loss=False)).to(DEVICE)
    plain.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, 72, (2, 13), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[0, :3] = -100
    losses = []
    for model in (fused, plain):
        loss = model(x, y)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert rel_err(p.grad, q.grad.double().cpu()) < 1e-4, name


def _fsdp_worker() -> dict:
    """Rank r: the fused-loss model under lab's FSDP on its half of the batch; reference: one process running
    both halves through an unwrapped copy, gradients summed and halved (see tests/parallel/test_fsdp.py)."""
    from lab.parallel.fsdp import FSDP

    r, n = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    ref = TransformerLM(tiny_config(fused_loss=True))
    plain = TransformerLM(tiny_config(fused_loss=False))
    plain.load_state_dict(ref.state_dict())
    model = FSDP(copy.deepcopy(ref))
    tokens = torch.randint(0, 72, (2 * n, 17), generator=torch.Generator().manual_seed(1))
    xs, ys = tokens[:, :-1].chunk(n), tokens[:, 1:].chunk(n)
    loss = model(xs[r], ys[r])
    loss.backward()
    grads = model.gather_full_grads()
    out = {"loss": loss.item(), "ref_loss": None, "rel_err": {}, "plain_rel_err": {}}
    for single in (ref, plain):
        for x, y in zip(xs, ys):
            single(x, y).backward()
    with torch.no_grad():
        out["ref_loss"], out["plain_loss"] = ref(xs[r], ys[r]).item(), plain(xs[r], ys[r]).item()
    for (name, p), q in zip(ref.named_parameters(), plain.parameters()):
        scale = p.grad.abs().max() * n
        out["rel_err"][name] = ((grads[name] - p.grad / n).abs().max() / scale).item()
        out["plain_rel_err"][name] = ((grads[name] - q.grad / n).abs().max() / scale).item()
    return out


@pytest.mark.slow
@pytest.mark.skipif(not kernels.INTERPRET, reason="gloo ranks on the CPU need the Triton interpreter")
def test_fused_loss_inside_fsdp_matches_single_process():
    for res in distributed.launch(_fsdp_worker, 2, device="cpu", timeout_s=120):
        assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-6)
        assert res["loss"] == pytest.approx(res["plain_loss"], rel=1e-5)
        assert max(res["rel_err"].values()) < 1e-6, res["rel_err"]  # same kernels, same inputs
        assert max(res["plain_rel_err"].values()) < 1e-4, res["plain_rel_err"]  # and the materialized loss
        assert "lm_head.weight" in res["rel_err"]


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_spills():
    """Compile every kernel variant with the default configs for sm_90a (Triton's bundled ptxas; no GPU
    needed): catches what the interpreter cannot (compile errors, register spills, shared memory)."""
    try:
        rows = call_without_interpreter("lab.kernels.fused_cross_entropy_kernels:compile_report")
    except FileNotFoundError:
        pytest.skip("this Triton build ships no ptxas")
    assert len(rows) == 16 and not [r for r in rows if "error" in r], rows
    assert [r["kernel"] for r in rows if r["spill_bytes"] != 0] == []
    assert all(r["wgmma"] for r in rows if not r["kernel"].startswith("rows"))


# ------------------------------------------------------------------------------------------------------ GPU
def fp32_reference(hidden, weight, targets, reduction="mean"):
    """Loss and gradients of the materialized loss in fp32 (no TF32) on the GPU."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        loss = F.cross_entropy(h @ w.T, targets, reduction=reduction)
        return loss.detach(), torch.autograd.grad(loss, (h, w))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow


@pytest.mark.gpu
@pytest.mark.parametrize("grad_in_forward", [False, None], ids=["recompute", "grad_in_forward"])
@pytest.mark.parametrize("shape", [(2048, 4096, 151936), (1999, 8192, 32003), (4096, 768, 10000)])
def test_gpu_realistic_sizes_match_fp32(shape, grad_in_forward):
    n, d, v = shape
    hidden, weight, targets = inputs(n, d, v, torch.bfloat16, scale=4.0, ignore_every=11)
    loss = fce.fused_linear_cross_entropy(hidden, weight, targets, grad_in_forward=grad_in_forward)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref_loss, ref_grads = fp32_reference(hidden, weight, targets)
    # recompute mode keeps fp32 logits; gradients-in-forward rounds them to bf16 (as the materialized loss does)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4 if grad_in_forward is False else 3e-3, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        err = ((g.float() - r).norm() / r.norm()).item()
        assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_skip_threshold_is_close_and_compile_works():
    hidden, weight, targets = inputs(4096, 2048, 50000, torch.bfloat16, scale=30.0)
    # the skip applies to the recompute mode (fp32 logits): compared with that mode exact, not with the
    # default's bf16 logits, whose rounding at logits this large is itself larger than the skip's error
    exact = torch.autograd.grad(fce.fused_linear_cross_entropy(hidden, weight, targets, grad_in_forward=False),
                                (hidden, weight))
    skip = torch.autograd.grad(fce.fused_linear_cross_entropy(hidden, weight, targets, softmax_skip_threshold=2**-12),
                               (hidden, weight))
    for a, b in zip(skip, exact):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2
    compiled = torch.compile(fce.fused_linear_cross_entropy, fullgraph=True)
    eager = fce.fused_linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(compiled(hidden, weight, targets), eager)
