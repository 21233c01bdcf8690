"""Data-parallel wrappers against single-process training, bit for bit (gloo, 2 processes, fp32, CPU).

Why exact equality is meaningful here: with two ranks, rank r computes the gradient g_r of the mean loss
over its shard, the all-reduce returns g_0 + g_1 (one IEEE addition, which is commutative, so both ranks
and any ring order get the same bits), and the wrapper divides by 2 (exact). The single-process reference
computes g_0 and g_1 with the same code on the same shards, in the same process (same thread count),
adds them and halves them. Any mistake (a parameter reduced twice, a gradient not reduced, a bucket copied
back into the wrong parameter, a stale gradient, replicas that did not start from rank 0's weights,
averaging the wrong accumulation) changes the weights, and AdamW over several steps makes that visible.
"""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lab.parallel import ddp as ddp_module
from lab.parallel import launcher as distributed

WRAPPERS = {
    "naive": lambda m: ddp_module.NaiveDDP(m),
    "flat": lambda m: ddp_module.FlatDDP(m),
    "individual": lambda m: ddp_module.DDPIndividualParameters(m),
    # 1e-5 MiB = 10 bytes: smaller than every parameter, so each parameter gets a bucket of its own
    "bucketed_tiny": lambda m: ddp_module.DDPBucketed(m, bucket_size_mb=1e-5),
    "bucketed_small": lambda m: ddp_module.DDPBucketed(m, bucket_size_mb=0.002),
    "bucketed_big": lambda m: ddp_module.DDPBucketed(m, bucket_size_mb=100),
    # the buckets of the default (above) follow the first backward's order from the second step on; these never
    "bucketed_reverse": lambda m: ddp_module.DDPBucketed(m, bucket_size_mb=0.002, bucket_order="reverse"),
}


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 24)
        self.fc2 = nn.Linear(24, 16)
        self.fc3 = nn.Linear(16, 5)
        self.register_buffer("shift", torch.randn(24))  # different per rank until broadcast

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x) + self.shift))))


class TiedFrozenModel(nn.Module):
    """Embedding tied to the output head (one Parameter, two names) and a frozen projection."""

    def __init__(self, vocab=32, d=12):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens):
        x = self.embedding(tokens)
        x = x + torch.tanh(self.mix(self.frozen(x)))
        return self.head(self.norm(x))


class InterleavedModel(nn.Module):
    """Four equal layers registered in another order than they run (l1, l4, l2, l3; applied l1 to l4): reverse
    registration order pairs a layer the backward reaches early with one it reaches late."""

    def __init__(self, d=8):
        super().__init__()
        self.l1 = nn.Linear(d, d)
        self.l4 = nn.Linear(d, d)
        self.l2 = nn.Linear(d, d)
        self.l3 = nn.Linear(d, d)

    def forward(self, x):
        return self.l4(torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))))


def _make(model_name):
    if model_name == "toy":
        return ToyModel()
    if model_name == "interleaved":
        return InterleavedModel()
    if model_name == "tied":
        return TiedFrozenModel()
    from lab.model.transformer import TransformerLM, config_for

    return TransformerLM(config_for("tiny", context_length=8, vocab_size=64))


def _global_batch(model_name, step, world, micro, per_rank=3):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name in ("toy", "interleaved"):
        features, classes = (10, 5) if model_name == "toy" else (8, 8)
        x = torch.randn(world, micro, per_rank, features, generator=g)
        y = torch.randint(0, classes, (world, micro, per_rank), generator=g)
    else:
        vocab, seq = (32, 6) if model_name == "tied" else (64, 8)
        x = torch.randint(0, vocab, (world, micro, per_rank, seq), generator=g)
        y = torch.randint(0, vocab, (world, micro, per_rank, seq), generator=g)
    return x, y


def _torch_ddp(module):
    """:func:`lab.parallel.ddp.torch_ddp` with the book's wrappers' interface: its reduction ends inside the
    backward, so there is nothing to finish."""
    model = ddp_module.torch_ddp(module)
    model.finish_gradient_synchronization = lambda: None
    return model


#: wrappers that train next to the reference only (torch DDP's own errors and call counts are not ours)
REFERENCE_ONLY = {"torch_ddp": _torch_ddp}


def _loss(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def train_next_to_reference(wrapper, model_name, steps=4, micro=1, set_to_none=True):
    """Worker: train a wrapped model and a single-process reference on the same global batches."""
    torch.use_deterministic_algorithms(True)
    r, n = distributed.rank(), distributed.world_size()
    assert n == 2, "exactness argument holds for two ranks"
    torch.manual_seed(0)
    reference = _make(model_name)
    torch.manual_seed(1 + r)  # replicas start different: only the broadcast makes them equal to rank 0's
    local = _make(model_name)
    if r == 0:
        local.load_state_dict(reference.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = {**WRAPPERS, **REFERENCE_ONLY}[wrapper](local)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        start = [p.detach().clone() for p in reference.parameters()]
        for step in range(steps):
            x, y = _global_batch(model_name, step, n, micro)
            opt.zero_grad(set_to_none=set_to_none)
            for m in range(micro):
                ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
                with ctx:
                    _loss(model, x[r, m], y[r, m]).backward()
            model.finish_gradient_synchronization()
            opt.step()

            # reference: per-shard gradients (accumulated over micro-batches), summed, halved
            shard_grads = []
            for shard in range(n):
                ref_opt.zero_grad()
                for m in range(micro):
                    _loss(reference, x[shard, m], y[shard, m]).backward()
                shard_grads.append([None if p.grad is None else p.grad.clone() for p in reference.parameters()])
            for p, g0, g1 in zip(reference.parameters(), *shard_grads):
                p.grad = None if g0 is None else (g0 + g1) / n
            ref_opt.step()
    return {
        "ddp": [p.detach().clone() for p in local.parameters()],
        "ref": [p.detach().clone() for p in reference.parameters()],
        "start": start,
        "buffers": [b.clone() for b in local.buffers()],
        "ref_buffers": [b.clone() for b in reference.buffers()],
        "grads_none": [p.grad is None for p in local.parameters()],
        "trainable": [p.requires_grad for p in local.parameters()],
        "warnings": [str(w.message) for w in caught],
    }


def _assert_matches(out):
    for rank_out in out:
        assert rank_out["warnings"] == []
        assert len(rank_out["ddp"]) == len(rank_out["ref"])
        for got, want in zip(rank_out["ddp"], rank_out["ref"]):
            assert torch.equal(got, want), f"max diff {(got - want).abs().max().item():.3g}"
        for got, want in zip(rank_out["buffers"], rank_out["ref_buffers"]):
            assert torch.equal(got, want)
    # training moved the trainable weights, so equality is not the trivial "nothing happened"
    for got, start, trainable in zip(out[0]["ref"], out[0]["start"], out[0]["trainable"]):
        assert torch.equal(got, start) != trainable


def check_wrapper(wrapper):
    """Worker: everything checked per wrapper, in one launch (each launch starts two interpreters)."""
    return {"toy": train_next_to_reference(wrapper, "toy"),
            "tied": train_next_to_reference(wrapper, "tied"),
            # gradient accumulation: 3 micro-batches per step, the first two under no_sync()
            "toy_no_sync": train_next_to_reference(wrapper, "toy", steps=3, micro=3),
            # gradients zeroed in place (they may live in the wrapper's buckets) rather than dropped
            "toy_zeroed": train_next_to_reference(wrapper, "toy", steps=3, micro=2, set_to_none=False),
            "counts": count_all_reduce(wrapper),
            "unused_error": unused_parameter_error(wrapper)}


def unused_parameter_error(wrapper):
    """Worker: a trainable parameter that gets no gradient must be a clear error on every rank, not a hang."""
    toy = ToyModel()
    toy.unused = nn.Linear(3, 3)
    model = WRAPPERS[wrapper](toy)
    x, y = _global_batch("toy", 0, 2, 1)
    try:
        _loss(model, x[distributed.rank(), 0], y[distributed.rank(), 0]).backward()
        model.finish_gradient_synchronization()
    except RuntimeError as exc:
        return str(exc)
    return None


def check_reference_only(wrapper):
    """Worker: training next to the single-process reference, gradients dropped, zeroed and accumulated."""
    model = REFERENCE_ONLY[wrapper](_make("toy"))
    x, y = _global_batch("toy", 0, 2, 1)
    _loss(model, x[distributed.rank(), 0], y[distributed.rank(), 0]).backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    return [train_next_to_reference(wrapper, "tied"), train_next_to_reference(wrapper, "toy", steps=3, micro=3),
            train_next_to_reference(wrapper, "toy", steps=3, micro=2, set_to_none=False), len(storages)]


def test_torch_ddp_as_the_book_builds_it_matches_single_process():
    """Gradients as views of its buckets, dropped (``set_to_none``) or zeroed between steps, accumulated under
    ``no_sync``: the same bits as one process training on the whole batch."""
    out = distributed.launch(check_reference_only, 2, "torch_ddp", device="cpu", timeout_s=120)
    for case in range(3):
        _assert_matches([o[case] for o in out])
    assert out[0][3] == 1  # every gradient of the small model lives in its one bucket


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_matches_single_process(wrapper):
    out = distributed.launch(check_wrapper, 2, wrapper, device="cpu", timeout_s=120)
    for case in ("toy", "tied", "toy_no_sync", "toy_zeroed"):
        _assert_matches([o[case] for o in out])
    tied = out[0]["tied"]
    # the frozen projection never gets a gradient and ends equal to rank 0's initial weights
    names = [n for n, _ in TiedFrozenModel().named_parameters()]
    frozen = names.index("frozen.weight")
    assert tied["grads_none"][frozen]
    assert torch.equal(tied["ddp"][frozen], tied["start"][frozen])
    _assert_each_trainable_parameter_reduced_once(wrapper, out[0]["counts"])
    for o in out:
        assert o["unused_error"] is not None and "got no gradient" in o["unused_error"]
        assert "unused." in o["unused_error"] and "fc1" not in o["unused_error"]


@pytest.mark.slow
def test_bucketed_transformer_and_repeated_runs():
    """The lab's TransformerLM (RoPE buffers, RMSNorm, many parameters), twice: runs are reproducible."""
    first = distributed.launch(train_next_to_reference, 2, "bucketed_small", "lm", 2, device="cpu", timeout_s=120)
    second = distributed.launch(train_next_to_reference, 2, "bucketed_small", "lm", 2, device="cpu", timeout_s=120)
    _assert_matches(first)
    _assert_matches(second)
    for a, b in zip(first[0]["ddp"], second[0]["ddp"]):
        assert torch.equal(a, b)


def count_all_reduce(wrapper):
    """Worker: one training step with ``dist.all_reduce`` wrapped to count calls and reduced elements."""
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        model = WRAPPERS[wrapper](TiedFrozenModel())
        buckets = len(model.buckets) if hasattr(model, "buckets") else None  # the buckets this step reduces
        x, y = _global_batch("tied", 0, 2, 1)
        calls.clear()  # only the step's communication
        _loss(model, x[distributed.rank(), 0], y[distributed.rank(), 0]).backward()
        model.finish_gradient_synchronization()
    finally:
        dist.all_reduce = original
    return {"calls": calls, "buckets": buckets}


def _assert_each_trainable_parameter_reduced_once(wrapper, counts):
    m = TiedFrozenModel()
    trainable = [p for p in m.parameters() if p.requires_grad]  # tied weight once, frozen ones excluded
    numel = sum(p.numel() for p in trainable)
    calls = counts["calls"]
    assert sum(calls) == numel  # no parameter twice, no frozen one
    expected_calls = {"naive": len(trainable), "individual": len(trainable), "flat": 1,
                      "bucketed_tiny": len(trainable), "bucketed_big": 1}
    if wrapper in expected_calls:
        assert len(calls) == expected_calls[wrapper]
    if wrapper in ("bucketed_small", "bucketed_reverse"):  # 0.002 MiB = 2097 bytes = 524 floats per bucket
        assert 1 < len(calls) < len(trainable)
        assert counts["buckets"] == len(calls)


def test_bucket_layout_in_the_order_given_and_capacity():
    params = [nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 50, 400)]
    buckets = ddp_module.DDPBucketed._make_buckets(params[::-1], capacity_bytes=4 * 400)
    layout = [[p.numel() for p in b.params] for b in buckets]
    assert layout == [[400], [50, 50, 300], [100]]  # reverse order, each at most 400 floats
    big = ddp_module.DDPBucketed._make_buckets(params, capacity_bytes=4 * 10)
    assert [len(b.params) for b in big] == [1] * 5  # a parameter larger than a bucket gets its own


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        ddp_module.NaiveDDP(ToyModel())


# ----------------------------------------------------------------------------------------------------------
# DDPBucketed: buckets in the order the backward produces the gradients, and bf16 communication


def launch_order(order, steps=3):
    """Worker: ``steps`` steps of :class:`InterleavedModel` under DDPBucketed with buckets of two layers; per
    step, the layers of each bucket (before the step) and how many gradients were final when each all-reduce
    was launched."""
    torch.manual_seed(0)
    local = InterleavedModel()
    final = []
    for p in local.parameters():  # registered before the wrapper's hooks: they run first
        p.register_post_accumulate_grad_hook(lambda _: final.append(None))
    layer = {id(p): name.split(".")[0] for name, p in local.named_parameters()}
    model = ddp_module.DDPBucketed(local, bucket_size_mb=2 * 72 * 4 / 2**20, bucket_order=order)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layouts, positions = [], []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        positions[-1].append(len(final))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        for step in range(steps):
            layouts.append([sorted({layer[id(p)] for p in b.params}) for b in model.buckets])
            positions.append([])
            final.clear()
            x, y = _global_batch("interleaved", step, 2, 1)
            opt.zero_grad()
            _loss(model, x[distributed.rank(), 0], y[distributed.rank(), 0]).backward()
            opt.step()
    finally:
        dist.all_reduce = original
    return {"layouts": layouts, "positions": positions,
            "exact": train_next_to_reference("bucketed_small" if order == "ready" else "bucketed_reverse",
                                             "interleaved")}


def test_buckets_follow_the_order_the_backward_produces_gradients():
    """Reverse registration order pairs l3 with l2 and l4 with l1: the first bucket leaves after six of the eight
    gradients. After the first backward the buckets follow its order (l4 with l3, l2 with l1), and the first
    bucket leaves after four: as soon as the backward has passed it. Both orders train exactly as one process."""
    reverse = [["l2", "l3"], ["l1", "l4"]]
    ready = [["l3", "l4"], ["l1", "l2"]]
    for order, layouts, positions in (("ready", [reverse, ready, ready], [[6, 8], [4, 8], [4, 8]]),
                                      ("reverse", [reverse] * 3, [[6, 8]] * 3)):
        out = distributed.launch(launch_order, 2, order, device="cpu", timeout_s=120)
        for o in out:
            assert o["layouts"] == layouts, order
            assert o["positions"] == positions, order
        _assert_matches([o["exact"] for o in out])


BF16_STEPS = 30
#: The largest error of a gradient element reduced in bf16 over two ranks, in units of the mean of the two
#: ranks' magnitudes: two roundings at bf16's unit roundoff 2**-8 (the rank's halved gradient, the sum) and
#: the fp32 reference's own rounding (see DDPBucketed's docstring).
BF16_BOUND = 2**-7 + 2**-15
#: How far bf16 communication may move the toy model's loss, relative, over BF16_STEPS AdamW steps.
BF16_LOSS_TOLERANCE = 1e-3


def bf16_next_to_fp32(steps=BF16_STEPS):
    """Worker: two DDPBucketed copies of one model, gradients communicated in fp32 and in bf16, trained on the
    same batches. Per step: the bf16 copy's reduced gradients against the fp32 average of the shards' exact
    gradients at its own weights (largest error over the bound; whether any element differs), and the global
    loss of both copies."""
    import copy

    torch.use_deterministic_algorithms(True)
    r, n = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    base = ToyModel()
    models = {"fp32": ddp_module.DDPBucketed(copy.deepcopy(base), bucket_size_mb=0.002),
              "bf16": ddp_module.DDPBucketed(copy.deepcopy(base), bucket_size_mb=0.002, reduce_dtype=torch.bfloat16)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    teacher = torch.randn(10, 5, generator=torch.Generator().manual_seed(7))  # a task the model can learn
    rows = []
    for step in range(steps):
        x, _ = _global_batch("toy", step, n, 1, per_rank=8)
        y = (x @ teacher).argmax(-1)
        probe = copy.deepcopy(models["bf16"].module)
        shard_grads = []
        for shard in range(n):
            probe.zero_grad()
            _loss(probe, x[shard, 0], y[shard, 0]).backward()
            shard_grads.append([p.grad.clone() for p in probe.parameters()])
        row = {}
        for name, model in models.items():
            opts[name].zero_grad()
            loss = _loss(model, x[r, 0], y[r, 0])
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            row[f"{name}_loss"] = total.item() / n
        ratios, differs, dtypes = [], False, set()
        for p, g0, g1 in zip(models["bf16"].module.parameters(), *shard_grads):
            reference, scale = (g0 + g1) / n, (g0.abs() + g1.abs()) / n
            error = (p.grad - reference).abs()
            assert bool((error[scale == 0] == 0).all())
            ratios.append((error[scale > 0] / scale[scale > 0]).max().item())
            differs |= not torch.equal(p.grad, reference)
            dtypes.add(p.grad.dtype)
        row.update(worst=max(ratios), differs=differs, dtypes=dtypes,
                   bucket_dtypes={b.buffer.dtype for b in models["bf16"].buckets})
        rows.append(row)
        for o in opts.values():
            o.step()
    return rows


def test_bf16_communication_stays_within_its_rounding_bound_and_barely_moves_the_loss():
    out = distributed.launch(bf16_next_to_fp32, 2, device="cpu", timeout_s=120)
    assert out[0] == out[1]  # the ranks agree on every number
    rows = out[0]
    for row in rows:
        assert row["worst"] <= BF16_BOUND, row
        assert row["dtypes"] == {torch.float32} and row["bucket_dtypes"] == {torch.bfloat16}
    assert all(row["differs"] for row in rows)  # the roundings are there: not the fp32 result by accident
    moved = [abs(row["bf16_loss"] - row["fp32_loss"]) / row["fp32_loss"] for row in rows]
    assert moved[0] == 0  # the same weights: the first losses are equal
    assert 0 < max(moved) < BF16_LOSS_TOLERANCE, moved
    assert rows[-1]["bf16_loss"] < 0.6 * rows[0]["bf16_loss"]  # and it learns the task



def replaced_gradients(reduce_dtype):
    """Worker: DDPBucketed with gradients zeroed in place between steps, except that before the later steps'
    backwards one ``.grad`` is replaced by zeros in memory of its own and another by a second view of its slot:
    per step, the largest error of the averaged gradients against the two shards' gradients averaged in one
    process, and whether every ``.grad`` ends in its slot of a bucket."""
    import copy

    r, n = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    reference = ToyModel()
    local = copy.deepcopy(reference)
    model = ddp_module.DDPBucketed(local, bucket_size_mb=0.002, reduce_dtype=reduce_dtype)
    params = list(local.parameters())
    rows = []
    for step in range(4):
        x, y = _global_batch("toy", step, n, 1)
        local.zero_grad(set_to_none=False)
        if step > 0:
            params[0].grad = torch.zeros_like(params[0])
            params[3].grad = params[3].grad.view_as(params[3])
        _loss(model, x[r, 0], y[r, 0]).backward()
        shards = []
        for s in range(n):
            reference.zero_grad()
            _loss(reference, x[s, 0], y[s, 0]).backward()
            shards.append([p.grad.clone() for p in reference.parameters()])
        errors = [((p.grad - (g0 + g1) / n).abs() / ((g0.abs() + g1.abs()) / n + 1e-30)).max().item()
                  for p, g0, g1 in zip(params, *shards)]
        slots = {v.data_ptr(): v.shape for b in model.buckets for v in b.views}
        rows.append(dict(worst=max(errors), in_slots=all(slots.get(p.grad.data_ptr()) == p.shape for p in params)))
    return rows


@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16])
def test_bucketed_reduces_gradients_that_are_not_their_bucket_slot(reduce_dtype):
    """Accumulated in place, a gradient is its bucket slot and nothing is copied; one replaced by a tensor of
    its own memory (or by another view of the slot) must still be moved in and averaged."""
    out = distributed.launch(replaced_gradients, 2, reduce_dtype, device="cpu", timeout_s=120)
    bound = 0.0 if reduce_dtype is None else BF16_BOUND
    for rows in out:
        for row in rows:
            assert row["worst"] <= bound and row["in_slots"], row

# ----------------------------------------------------------------------------------------------------------
# on two GPUs (NCCL): the buckets' copies and launches on side streams


def gpu_grads_next_to_reference(bucket_mb: float, reduce_dtype):
    """Worker: the averaged gradients as the backward's stream reads them right after each backward (no
    synchronization but the wrapper's), against the two shards' gradients averaged in one process; gradients
    dropped, then zeroed in place, between steps."""
    import copy

    r, n, device = distributed.rank(), distributed.world_size(), distributed.device()
    torch.manual_seed(0)
    reference = _make("lm").to(device)
    local = copy.deepcopy(reference)
    model = ddp_module.DDPBucketed(local, bucket_size_mb=bucket_mb, reduce_dtype=reduce_dtype)
    worst = 0.0
    for step in range(4):
        x, y = (t.to(device) for t in _global_batch("lm", step, n, 1))
        local.zero_grad(set_to_none=step < 2)
        _loss(model, x[r, 0], y[r, 0]).backward()
        got = [p.grad.clone() for p in local.parameters()]
        shards = []
        for s in range(n):
            reference.zero_grad(set_to_none=True)
            _loss(reference, x[s, 0], y[s, 0]).backward()
            shards.append([p.grad.clone() for p in reference.parameters()])
        for g, g0, g1 in zip(got, *shards):
            # relative to the element's magnitude; a floor for the elements near zero, where the GPU's kernels
            # (not bitwise deterministic across the two models) differ in the last bits
            want, scale = (g0 + g1) / n, (g0.abs() + g1.abs()) / n
            worst = max(worst, ((g - want).abs() / (scale + 1e-6 * scale.max())).max().item())
    return dict(worst=worst, streams=model._streams is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("bucket_mb,reduce_dtype", [(1e-3, None), (100.0, None), (1e-3, torch.bfloat16)])
def test_bucketed_on_two_gpus_leaves_the_average_where_the_backward_stream_reads_it(bucket_mb, reduce_dtype):
    out = distributed.launch(gpu_grads_next_to_reference, 2, bucket_mb, reduce_dtype, device="cuda", timeout_s=180)
    for o in out:  # a stale or missing bucket is off by the size of the gradient itself
        assert o["streams"]
        assert o["worst"] <= (1e-5 if reduce_dtype is None else BF16_BOUND + 1e-5), o
