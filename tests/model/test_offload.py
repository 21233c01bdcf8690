"""lab.model.offload: the round trip through "host" memory is exact (gradients equal bit for bit in fp32),
the byte counters equal what autograd saves (lab.measure.saved_tensors, and closed forms), and the backward
brings blocks back ahead of need."""

import json

import pytest
import torch
from torch import nn

from lab.measure.saved_tensors import saved_tensor_report
from lab.measure.step import lm_loss, random_batch
from lab.measure.traces import intersect_intervals, intervals_length, union_intervals
from lab.model.checkpointing import CheckpointedGroup, residual_stream_bytes
from lab.model.offload import ActivationOffloader, activation_offloading, offload_cost_model
from lab.model.transformer import ModelConfig, TransformerLM, config_for

CFG = config_for("tiny", context_length=16, vocab_size=64)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    return model, random_batch(CFG, 2, "cpu")


def _grads(model, batch, context=None):
    model.zero_grad(set_to_none=True)
    with context if context is not None else torch.enable_grad():
        loss = lm_loss(model, *batch)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kw", [dict(offload_blocks=None), dict(offload_blocks=[0, 1]),
                                dict(offload_blocks=[0, 1], prefetch=0), dict(offload_blocks=[1], min_bytes=8192)])
def test_gradients_equal_bit_for_bit(setup, kw):
    model, batch = setup
    ref_loss, ref = _grads(model, batch)
    loss, got = _grads(model, batch, activation_offloading(model, min_bytes=kw.pop("min_bytes", 0), **kw))
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_bytes_offloaded_equal_the_saved_tensors_of_each_block(setup):
    model, batch = setup
    report = saved_tensor_report(model, batch[0])
    per_block = report.by_module(depth=2).set_index("module")["bytes"]
    expected = 0
    for i, block in enumerate(model.blocks):
        rope = block.attn.rope  # its cos/sin tables are buffers: saved, but never offloaded
        expected += int(per_block[f"blocks.{i}"]) - rope.cos.untyped_storage().nbytes() \
            - rope.sin.untyped_storage().nbytes()
    with activation_offloading(model, offload_blocks=range(CFG.num_layers), min_bytes=0) as off:
        loss = lm_loss(model, *batch)
        assert off.host_bytes() == off.stats().bytes_offloaded  # held in "host" memory until the backward
        loss.backward()
    del loss
    assert off.host_bytes() == 0  # freed with the graph
    s = off.stats()
    assert expected > 0
    assert s.bytes_offloaded == expected
    assert s.bytes_fetched == expected  # every byte came back once
    assert s.copies == s.fetches
    # the last block's backward starts at once (on demand); the others were prefetched while the next one ran
    assert (s.on_demand, s.prefetched) == (1, CFG.num_layers - 1)


class _Mlp(nn.Module):
    """Blocks of Linear(d, h) -> tanh -> Linear(h, d): each saves its input (d floats a row) and the tanh
    output (h floats a row, also the second Linear's input); the weights are parameters."""

    def __init__(self, d=8, h=24, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, d)) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().sum()


def test_hand_made_module_closed_form_bytes_and_threshold():
    torch.manual_seed(1)
    rows, d, h, n = 5, 8, 24, 3
    # x needs no gradient: a leaf that requires one is left in place, like a parameter (the caller holds it)
    model, x = _Mlp(d, h, n), torch.randn(rows, d)
    model(x).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    # every saved storage; only the tanh output (saved twice: by tanh and by the second Linear); none
    for min_bytes, per_block in [(0, rows * (d + h) * 4), (rows * d * 4 + 1, rows * h * 4), (1 << 20, 0)]:
        model.zero_grad(set_to_none=True)
        with activation_offloading(model, offload_blocks=range(n), min_bytes=min_bytes) as off:
            model(x).backward()
        got = [p.grad for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        s = off.stats()
        assert s.bytes_offloaded == n * per_block
        assert s.bytes_kept == n * (rows * (d + h) * 4) - n * per_block
    # the measurement of what the blocks save agrees (block inputs included: block 0's is x; the loss's
    # square, outside the blocks, is not offloaded)
    by_module = saved_tensor_report(model, x).by_module(depth=2)
    assert by_module[by_module["module"].str.startswith("blocks.")]["bytes"].sum() == n * rows * (d + h) * 4


def test_composes_with_checkpointing_by_block(setup):
    """Offload block 0, checkpoint block 1: gradients unchanged, and only block 0's tensors travel."""
    model, batch = setup
    ref_loss, ref = _grads(model, batch)
    with activation_offloading(model, offload_blocks=[0], min_bytes=0) as only_first:
        _grads(model, batch)
    original = model.blocks
    model.blocks = nn.ModuleList([original[0], CheckpointedGroup([original[1]])])
    try:
        with activation_offloading(model, offload_blocks=[0, 1], min_bytes=0) as off:
            loss, got = _grads(model, batch)
    finally:
        model.blocks = original
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # the checkpointed block's own hooks take what its inside saves: offloading it moves only its input,
    # the one tensor non-reentrant checkpointing keeps
    tokens = batch[0]
    residual = residual_stream_bytes(tokens.shape[0], tokens.shape[1], CFG.d_model)
    assert off.stats().bytes_offloaded == only_first.stats().bytes_offloaded + residual


def test_bad_arguments_are_clear_errors(setup):
    model, _ = setup
    with pytest.raises(ValueError, match="offload_blocks"):
        with activation_offloading(model, offload_blocks=[5]):
            pass
    with pytest.raises(ValueError, match="min_bytes"):
        ActivationOffloader(min_bytes=-1)
    with pytest.raises(TypeError, match="ModuleList"):
        with activation_offloading(nn.Linear(2, 2)):
            pass


def test_cost_model():
    gb = 1e9
    # 1 GB a block over 50 GB/s: 20 ms each way; a 30 ms forward hides it, a 15 ms backward leaves 5 ms
    m = offload_cost_model(1 * gb, 0.030, 0.015, 50 * gb, blocks=4)
    assert m["transfer_s"] == pytest.approx(0.08)
    assert m["exposed_forward_s"] == 0
    assert m["exposed_backward_s"] == pytest.approx(4 * 0.005)
    assert m["hidden_s"] == pytest.approx(0.16 - 0.02)
    assert m["bytes_moved"] == 8 * gb and m["freed_bytes"] == 4 * gb


class _HostScale(nn.Module):
    """``x * s`` with ``s`` a 0-dim tensor made on the host inside the forward: the product saves ``s`` for the
    backward, as SDPA's efficient and flash kernels save their host-side seed and offset."""

    def forward(self, x):
        return x * torch.tensor(0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_only_the_blocks_own_device_is_offloaded(device):
    """A block on the GPU that saves a host tensor keeps it where it is (it frees no device memory, and its
    copy back would go to the wrong device); on the CPU the same tensor is the block's and travels. Closed
    form: each block saves its input (d floats a row), the tanh output (h floats a row) and the 4-byte scale."""
    torch.manual_seed(1)
    rows, d, h, n = 5, 8, 24, 3
    model = _Mlp(d, h, n).to(device)
    for block in model.blocks:
        block.append(_HostScale())
    x = torch.randn(rows, d, device=device)
    model(x).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with activation_offloading(model, offload_blocks=range(n), min_bytes=0) as off:
        model(x).backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    s = off.stats()
    on_gpu = device == "cuda"
    assert s.bytes_offloaded == s.bytes_fetched == n * (rows * (d + h) * 4 + (0 if on_gpu else 4))
    assert s.bytes_kept == (n * 4 if on_gpu else 0)
    assert s.bytes_pinned == (s.bytes_offloaded if on_gpu else 0)


def _cuda_grads(model, batch, context=None):
    loss, grads = _grads(model, batch, context)
    torch.cuda.synchronize()
    return loss, grads


def _assert_same_grads(got, ref, again):
    """Bit for bit where two runs without offloading (``ref``, ``again``) agree bit for bit; otherwise (a
    kernel that adds with atomics) within fp32 rounding."""
    deterministic = all(torch.equal(a, b) for a, b in zip(again, ref))
    for a, b in zip(got, ref):
        if deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_offload_on_cuda_is_exact_and_moves_the_bytes_through_pinned_host_memory():
    """On a GPU the copies run on a side stream into pinned host memory and come back by prefetch: the
    gradients still equal those without offloading (fp32; bit for bit where the step without offloading is
    itself deterministic: SDPA's efficient backward may add with atomics), and every offloaded byte comes
    back from pinned host memory. (SDPA saves host-side seeds among the blocks' device tensors: they stay.)"""
    torch.manual_seed(0)
    cfg = config_for("tiny", context_length=256, vocab_size=512)
    model = TransformerLM(cfg).cuda()
    batch = random_batch(cfg, 4, "cuda")
    ref_loss, ref = _cuda_grads(model, batch)
    _, again = _cuda_grads(model, batch)
    model.zero_grad(set_to_none=True)  # the gradients below are this backward's alone
    with activation_offloading(model, offload_blocks=None, min_bytes=0) as off:
        loss = lm_loss(model, *batch)
        held = off.host_bytes()
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.cuda.synchronize()
    s = off.stats()
    assert torch.equal(loss.detach(), ref_loss)
    _assert_same_grads(grads, ref, again)
    assert held == s.bytes_offloaded > 0 and s.bytes_fetched == s.bytes_offloaded == s.bytes_pinned
    assert s.wait_s >= 0 and s.on_demand + s.prefetched == cfg.num_layers - 1


def _memcpys(trace: dict, kind: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"
            and kind in e.get("name", "")]


@pytest.mark.gpu
def test_copies_go_through_pinned_memory_on_a_side_stream_and_overlap_the_compute(tmp_path):
    """Profiled: every offloaded storage is one device-to-pinned copy and every fetch one pinned-to-device
    copy, all on a stream no compute kernel runs on, and the copies run while kernels compute (the blocks'
    activations, tens of MB, take milliseconds over the host link)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=256, d_ff=1024, num_layers=4, num_heads=4, vocab_size=512, context_length=1024,
                      attention="naive")
    model = TransformerLM(cfg).cuda()
    batch = random_batch(cfg, 4, "cuda")
    ref_loss, ref = _cuda_grads(model, batch)
    _, again = _cuda_grads(model, batch)
    with activation_offloading(model, min_bytes=1 << 16) as off:
        _cuda_grads(model, batch)  # the first use pins host buffers and makes the side stream
        off.reset_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            loss, grads = _cuda_grads(model, batch)
    assert torch.equal(loss, ref_loss)
    _assert_same_grads(grads, ref, again)
    s = off.stats()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    out, back = _memcpys(trace, "Device -> Pinned"), _memcpys(trace, "Pinned -> Device")
    assert (len(out), len(back)) == (s.copies, s.fetches) and s.copies > 0
    assert s.bytes_pinned == s.bytes_offloaded == s.bytes_fetched
    sizes = [(e.get("args") or {}).get("bytes") for e in out]
    if None not in sizes:  # where the profiler gives the copies' sizes
        assert sum(sizes) == s.bytes_offloaded
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
    copy_streams = {(e.get("args") or {}).get("stream") for e in out + back}
    assert None not in copy_streams and not copy_streams & {(e.get("args") or {}).get("stream") for e in kernels}
    copying = union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in out + back])
    computing = union_intervals([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    overlapped = intervals_length(intersect_intervals(copying, computing))
    print(f"offload: {s.bytes_offloaded / 2**20:.1f} MiB out and back, copies {intervals_length(copying) / 1e3:.2f} "
          f"ms, {overlapped / 1e3:.2f} ms of them beside kernels, compute waited {s.wait_s * 1e3:.2f} ms")
    assert overlapped > 0


def test_later_steps_copy_into_the_host_buffers_of_earlier_ones(setup):
    """Once a step's graph is freed its host buffers wait in the offloader's pool; the next step copies into
    them (none newly allocated) and its gradients are still those of the model without offloading."""
    model, batch = setup
    _, ref = _grads(model, batch)
    with activation_offloading(model, offload_blocks=[0, 1], min_bytes=0) as off:
        _grads(model, batch)
        first = off.stats()
        assert first.reused == 0 and off.host_bytes() == 0 and off.pooled_bytes() == first.bytes_offloaded
        off.reset_stats()
        _, got = _grads(model, batch)
        second = off.stats()
    assert second.reused == second.copies == first.copies > 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert off.pooled_bytes() == first.bytes_offloaded
    off.release_host_buffers()
    assert off.pooled_bytes() == 0
