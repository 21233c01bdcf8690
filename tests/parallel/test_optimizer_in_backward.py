"""lab.parallel.optimizer_in_backward: updates inside the backward equal the plain step bit for bit (fp32,
CPU), single process, under lab.DDPBucketed and under lab.FSDP on 2 gloo ranks, with and without clipping by
the global norm; gradients are freed; schedules, checkpoints and misuse behave."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.measure.step import lm_loss, random_batch
from lab.model.transformer import ModelConfig, TransformerLM, config_for
from lab.parallel import launcher as distributed
from lab.parallel.ddp import DDPBucketed
from lab.parallel.fsdp import FSDP
from lab.parallel.optimizer_in_backward import OptimizerInBackward, block_buckets

CFG = config_for("tiny", context_length=16, vocab_size=64)
HYPER = dict(lr=1e-2, weight_decay=0.1)


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = TransformerLM(CFG)
    return ref, copy.deepcopy(ref)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("device,side_stream", [("cpu", None), pytest.param("cuda", None, marks=pytest.mark.gpu),
                                                pytest.param("cuda", False, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bucketing", ["per_parameter", "per_block"])
def test_matches_the_plain_step_bit_for_bit(bucketing, device, side_stream):
    """fp32, several steps: on the CPU the for-loop AdamW, on a GPU the fused kernel (one per bucket against one
    for all; its arithmetic per element does not depend on its neighbours), on a side stream (the default on
    CUDA) or on the compute stream."""
    ref, model = (m.to(device) for m in _pair())
    flags = dict(fused=True) if device == "cuda" else {}
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, **flags)
    buckets = block_buckets(model) if bucketing == "per_block" else None
    opt = OptimizerInBackward(model.parameters(), buckets=buckets, side_stream=side_stream, **HYPER, **flags)
    assert (opt._stream is not None) == (device == "cuda" and side_stream is None)
    for step in range(4):
        batch = random_batch(CFG, 2, device, seed=step)
        ref_opt.zero_grad()
        lm_loss(ref, *batch).backward()
        ref_opt.step()
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        lm_loss(model, *batch).backward()
        if device == "cuda":  # the side stream's updates, queued in the backward, have run
            torch.cuda.synchronize()
        # the updates ran inside the backward, and no gradient is left
        assert all(p.grad is None for p in model.parameters())
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        opt.step()
        assert _same(ref, model), step


class _Branchy(nn.Module):
    """``b`` is used only on odd steps: its bucket (shared with ``a``) gets a partial set of gradients."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b):
        x = self.blocks[1](self.blocks[0](x))
        return (self.b(x) if use_b else x).square().mean()


def test_parameters_without_gradient_are_skipped_like_the_plain_step():
    torch.manual_seed(0)
    ref = _Branchy()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    buckets = [list(model.blocks.parameters()) + list(model.b.parameters())]  # one bucket for all
    opt = OptimizerInBackward(model.parameters(), buckets=buckets, **HYPER)
    for step in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        ref_opt.zero_grad()
        ref(x, step % 2).backward()
        ref_opt.step()
        model(x, step % 2).backward()  # the end-of-backward callback steps the incomplete bucket
        opt.step()
        assert _same(ref, model), step


def test_lr_schedule_and_state_dict_round_trip():
    ref, model = _pair()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = OptimizerInBackward(model.parameters(), **HYPER)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ref_opt, opt)]
    for step in range(3):
        batch = random_batch(CFG, 2, "cpu", seed=step)
        ref_opt.zero_grad()
        lm_loss(ref, *batch).backward()
        ref_opt.step()
        lm_loss(model, *batch).backward()
        opt.step()
        for s in schedules:
            s.step()
        assert _same(ref, model), step
    # the scheduled lr (which changed every step, so equal parameters above mean it reached the updates)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == HYPER["lr"] / 4
    # the checkpoint is the plain optimizer's: same state, and it loads both ways
    mine, plain = opt.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == plain["state"].keys()
    assert all(torch.equal(mine["state"][i][k], plain["state"][i][k])
               for i in plain["state"] for k in plain["state"][i])
    assert mine["param_groups"][0]["lr"] == plain["param_groups"][0]["lr"]
    restored = copy.deepcopy(model)
    restored_opt = OptimizerInBackward(restored.parameters(), **HYPER)
    restored_opt.load_state_dict(plain)
    plain_again = torch.optim.AdamW(ref.parameters(), **HYPER)
    plain_again.load_state_dict(mine)
    batch = random_batch(CFG, 2, "cpu", seed=10)
    for m, o in ((ref, plain_again), (restored, restored_opt)):
        o.zero_grad()
        lm_loss(m, *batch).backward()
        o.step()
    assert _same(ref, restored)


def test_accumulation_and_bad_arguments_are_clear_errors():
    _, model = _pair()
    opt = OptimizerInBackward(model.parameters(), **HYPER)
    batch = random_batch(CFG, 2, "cpu")
    lm_loss(model, *batch).backward()
    with pytest.raises(RuntimeError, match="accumulation"):
        lm_loss(model, *batch).backward()  # a second backward before step()
    with pytest.raises(ValueError, match="exactly once"):
        OptimizerInBackward(model.parameters(), buckets=[list(model.parameters())[:2]], **HYPER)
    with pytest.raises(ValueError, match="one group"):
        OptimizerInBackward([{"params": list(model.parameters())}], **HYPER)
    with pytest.raises(TypeError, match="Optimizer subclass"):
        OptimizerInBackward(model.parameters(), optimizer_cls=dict)
    opt.remove_hooks()


# ----------------------------------------------------------------------------------------------------------
# with lab.FSDP (2 gloo ranks); the reference runs each rank's half of the batch through one full model,
# sums the two gradients and halves them (the same arithmetic as FSDP's reduce-scatter; see test_fsdp)

VOCAB = 64


def _fsdp_config() -> ModelConfig:
    return ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=VOCAB)


def _fsdp_worker(steps: int) -> dict:
    torch.use_deterministic_algorithms(True)
    r, n = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    ref = TransformerLM(_fsdp_config())
    model = FSDP(copy.deepcopy(ref))
    opt = OptimizerInBackward(model.parameters(), fsdp=model, **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    rows = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (2 * n, 17), generator=g)
        xs, ys = tokens[:, :-1].chunk(n), tokens[:, 1:].chunk(n)
        opt.zero_grad()
        F.cross_entropy(model(xs[r]).reshape(-1, VOCAB), ys[r].reshape(-1)).backward()
        grads_left = sum(p.grad is not None for p in model.parameters())
        opt.step()
        ref_opt.zero_grad()
        for x, y in zip(xs, ys):
            F.cross_entropy(ref(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        for p in ref.parameters():
            p.grad.div_(n)
        ref_opt.step()
        full, ref_params = model.gather_full_params(), dict(ref.named_parameters())
        rows.append({"grads_left": grads_left, "params_equal": all(torch.equal(full[k], ref_params[k]) for k in full),
                     "max_diff": max((full[k] - ref_params[k]).abs().max().item() for k in full)})
    return {"rows": rows, "buckets": len(opt.buckets), "layers": len(model.gradient_groups())}


def test_fsdp_updates_after_each_reduce_scatter_match_single_process_exactly():
    out = distributed.launch(_fsdp_worker, 2, 3, device="cpu", timeout_s=120)
    for rank, res in enumerate(out):
        # embedding, two blocks, LM head, and the replicated norms: one inner optimizer each
        assert res["buckets"] == res["layers"] == 5
        for step, row in enumerate(res["rows"]):
            assert row["grads_left"] == 0
            assert row["params_equal"], f"rank {rank} step {step}: max diff {row['max_diff']}"


def test_the_full_gradient_set_never_exists():
    """Gradients alive during the backward: at most one bucket's (a plain backward ends holding all)."""
    _, model = _pair()
    buckets = block_buckets(model)
    opt = OptimizerInBackward(model.parameters(), buckets=buckets, **HYPER)  # hooks hold it weakly: keep it
    params = list(model.parameters())
    alive = []
    for p in params:  # registered after the optimizer's hooks: runs after each parameter's update
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in params)))
    lm_loss(model, *random_batch(CFG, 2, "cpu")).backward()
    assert len(alive) == len(params)
    assert max(alive) == max(len(b) for b in buckets) - 1 < len(params)
    opt.step()


def test_a_side_stream_needs_cuda_parameters():
    model = TransformerLM(CFG)
    with pytest.raises(ValueError, match="CUDA"):
        OptimizerInBackward(model.parameters(), side_stream=True, **HYPER)
    assert OptimizerInBackward(model.parameters(), **HYPER)._stream is None  # the CPU: the plain path


# ----------------------------------------------------------------------------------------------------------
# clipping by the global norm


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bucketing", ["per_parameter", "per_block"])
def test_clipping_matches_clip_grad_norm_then_the_plain_step(bucketing, device):
    """max_grad_norm: the global norm formed from each bucket's norms has clip_grad_norm_'s bits, and the
    clipped updates give the plain step's weights (fp32, several steps, the norm above the limit in most); on a
    GPU with the multi-tensor norms and the fused AdamW, the updates on the side stream."""
    ref, model = (m.to(device) for m in _pair())
    flags = dict(fused=True) if device == "cuda" else {}
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER, **flags)
    buckets = block_buckets(model) if bucketing == "per_block" else None
    opt = OptimizerInBackward(model.parameters(), buckets=buckets, max_grad_norm=0.5, **HYPER, **flags)
    clipped = 0
    for step in range(4):
        batch = random_batch(CFG, 2, device, seed=step)
        ref_opt.zero_grad()
        lm_loss(ref, *batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        lm_loss(model, *batch).backward()
        assert all(p.grad is None for p in model.parameters())  # updated at the end of the backward
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(opt.grad_norm, norm), step
        assert _same(ref, model), step
        clipped += bool(norm > 0.5)
    assert clipped >= 3


def test_clipping_keeps_every_gradient_until_the_end_of_the_backward():
    """The price of clipping: no update before the global norm, so the full gradient set exists at the end."""
    _, model = _pair()
    opt = OptimizerInBackward(model.parameters(), buckets=block_buckets(model), max_grad_norm=1.0, **HYPER)
    params = list(model.parameters())
    alive = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: alive.append(sum(q.grad is not None for q in params)))
    lm_loss(model, *random_batch(CFG, 2, "cpu")).backward()
    assert alive[-1] == len(params)
    opt.step()
    with pytest.raises(ValueError, match="fsdp"):
        OptimizerInBackward(model.parameters(), fsdp=object(), max_grad_norm=1.0, **HYPER)


# ----------------------------------------------------------------------------------------------------------
# with lab.DDPBucketed (2 gloo ranks): the reference sums each rank's shard gradients and halves them, as
# test_ddp does (exact for two ranks)


def _ddp_worker(steps: int, max_grad_norm: float | None, micro: int) -> list[dict]:
    torch.use_deterministic_algorithms(True)
    r, n = distributed.rank(), distributed.world_size()
    torch.manual_seed(0)
    ref = TransformerLM(CFG)
    model = DDPBucketed(copy.deepcopy(ref), bucket_size_mb=0.01)  # several buckets per block
    opt = OptimizerInBackward(model.module.parameters(), ddp=model, max_grad_norm=max_grad_norm, **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    rows = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, CFG.vocab_size, (n, micro, 2, CFG.context_length + 1), generator=g)
        x, y = tokens[..., :-1], tokens[..., 1:]
        buckets = len(model.buckets)
        for m in range(micro):
            with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                lm_loss(model, x[r, m], y[r, m]).backward()
        grads_left = sum(p.grad is not None for p in model.parameters())
        opt.step()
        shard_grads = []
        for shard in range(n):
            ref_opt.zero_grad()
            for m in range(micro):
                lm_loss(ref, x[shard, m], y[shard, m]).backward()
            shard_grads.append([p.grad.clone() for p in ref.parameters()])
        for p, g0, g1 in zip(ref.parameters(), *shard_grads):
            p.grad = (g0 + g1) / n
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm) if max_grad_norm else None
        ref_opt.step()
        rows.append({"grads_left": grads_left, "buckets": buckets, "groups": len(opt.buckets),
                     "same": _same(ref, model.module),
                     "norm_same": norm is None or torch.equal(norm, opt.grad_norm)})
    return rows


@pytest.mark.parametrize("max_grad_norm,micro", [(None, 1), (None, 2), (0.5, 1)],
                         ids=["plain", "no_sync_accumulation", "clipped"])
def test_ddp_updates_after_each_all_reduce_match_single_process_exactly(max_grad_norm, micro):
    """One inner optimizer per block, each stepped once its gradients' buckets are reduced: the weights of a
    single process after every step, while the buckets are rebuilt in the backward's order after the first
    step, with gradient accumulation under no_sync, and with clipping."""
    out = distributed.launch(_ddp_worker, 2, 3, max_grad_norm, micro, device="cpu", timeout_s=180)
    for rank, rows in enumerate(out):
        for step, row in enumerate(rows):
            assert row["same"] and row["norm_same"], f"rank {rank} step {step}"
            assert row["grads_left"] == 0
            assert row["buckets"] > row["groups"]  # buckets smaller than blocks: a block waits for several
        assert rows[0]["groups"] == CFG.num_layers + 3  # the blocks, the embedding, the final norm, the LM head
