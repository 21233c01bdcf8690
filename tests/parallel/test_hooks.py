"""Wrappers with gradient hooks are freed when dropped: a tensor's hooks are held from C++, where the cycle
collector cannot see them, so a hook holding its wrapper strongly would keep the wrapper, its buffers and the
model alive for good (notebook 08's first GPU render ran out of memory that way)."""

import gc
import weakref

import torch

from lab.model import ModelConfig, TransformerLM
from lab.parallel import launcher as distributed
from lab.parallel.hooks import weak_hook


class _Owner:
    def __init__(self):
        self.param = torch.nn.Parameter(torch.ones(3))
        self.calls = 0
        self.param.register_post_accumulate_grad_hook(weak_hook(self.on_grad))

    def on_grad(self, p):
        self.calls += 1


def test_weak_hook_calls_while_alive_and_frees_its_owner():
    owner = _Owner()
    param = owner.param
    (param * 2).sum().backward()
    assert owner.calls == 1
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None
    (param * 2).sum().backward()  # the owner is gone: the hook does nothing
    assert torch.equal(param.grad, torch.full((3,), 4.0))


def _dropped_wrappers_are_freed() -> dict:
    from lab.bench.sharding import build_impl
    from lab.measure.step import TrainStep, random_batch
    from lab.parallel.ddp import DDPBucketed, DDPIndividualParameters

    cfg = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=2, context_length=16, vocab_size=64)
    device = torch.device("cpu")
    tokens, targets = random_batch(cfg, 2, device, seed=0)
    builds = {impl: (lambda m, impl=impl: build_impl(impl, m, device, "fp32")[:2]) for impl in ("zero1", "fsdp")}
    for cls in (DDPIndividualParameters, DDPBucketed):
        builds[cls.__name__] = lambda m, cls=cls: (lambda w: (w, torch.optim.AdamW(w.parameters())))(cls(m))
    alive = {}
    for name, build in builds.items():
        model = TransformerLM(cfg)
        wrapped, opt = build(model)
        step = TrainStep(wrapped, opt, tokens, targets)
        step()
        step()
        # the model, the wrapper, the optimizer, and a parameter (ZeRO-1's: a view of its flat buffer)
        refs = [weakref.ref(x) for x in (model, wrapped, opt, next(model.parameters()))]
        del model, wrapped, opt, step  # dropped without closing
        gc.collect()
        alive[name] = [r() is not None for r in refs]
    return alive


def test_dropped_wrappers_are_freed():
    """Our ZeRO-1, FSDP and hook-driven DDPs, dropped after two training steps without any close: the model,
    the wrapper, the optimizer and the parameters are all freed by the collector."""
    alive = distributed.launch(_dropped_wrappers_are_freed, 1, device="cpu")[0]
    assert alive == {name: [False] * 4 for name in alive} and len(alive) == 4
