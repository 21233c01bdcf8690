"""The one phased training step: phase names in the profiler, what each mode runs, per-mode peaks."""

import math

import pytest
import torch
from torch import nn

from lab.measure.step import (
    MODES,
    PHASES,
    TrainStep,
    lm_loss,
    make_optimizer,
    measure_mode,
    measure_modes,
    random_batch,
)
from lab.model import ModelConfig, TransformerLM

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, context_length=16, vocab_size=64)


def _step(optimizer=True, dtype="fp32"):
    torch.manual_seed(0)
    model = TransformerLM(TINY)
    opt = make_optimizer(model, "cpu") if optimizer else None
    return TrainStep(model, opt, *random_batch(TINY, 2, "cpu"), dtype=dtype)


def test_train_step_equals_a_hand_written_step():
    step = _step()
    torch.manual_seed(0)
    reference = TransformerLM(TINY)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-4, weight_decay=0.01)
    loss = torch.nn.functional.cross_entropy(reference(step.tokens).reshape(-1, 64), step.targets.reshape(-1))
    loss.backward()
    opt.step()
    step()
    for a, b in zip(step.model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(p.grad is None for p in step.model.parameters())  # zero_grad(set_to_none) ends the step


def test_phases_are_profiler_ranges_with_fixed_names():
    step = _step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events() if e.name in PHASES]
    assert names == list(PHASES)


def test_forward_backward_starts_from_fresh_gradients():
    step = _step(optimizer=False)
    step.forward_backward()
    first = [p.grad.clone() for p in step.model.parameters()]
    step.forward_backward()  # not accumulated onto the previous gradients
    for a, p in zip(first, step.model.parameters()):
        torch.testing.assert_close(p.grad, a)


def test_wrappers_finish_their_gradient_synchronization_in_backward():
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module, self.finished = module, 0

        def forward(self, *args):
            return self.module(*args)

        def finish_gradient_synchronization(self):
            self.finished += 1

    torch.manual_seed(0)
    wrapper = Wrapper(TransformerLM(TINY))
    step = TrainStep(wrapper, None, *random_batch(TINY, 2, "cpu"))
    step.forward_backward()
    assert wrapper.finished == 1


def test_measure_mode_times_and_peaks():
    step = _step()
    for mode in MODES:
        timings, peak = measure_mode(step, mode, warmup=1, steps=2)
        assert all(len(t.samples_ms) == 2 for t in timings.values())
        assert math.isnan(peak)  # no allocator statistics on the CPU
    timings, _ = measure_mode(step, "forward_backward", warmup=0, steps=3)
    assert set(timings) == {"fwdbwd", "bwd"}
    assert all(b <= fb for b, fb in zip(timings["bwd"].samples_ms, timings["fwdbwd"].samples_ms))
    with pytest.raises(ValueError, match="unknown mode"):
        measure_mode(step, "inference")
    with pytest.raises(ValueError, match="steps"):
        measure_mode(step, "forward", steps=0)


def test_lm_loss_is_the_models_own_loss_and_an_unknown_dtype_fails_early():
    step = _step()
    logits = step.model(step.tokens)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 64).float(), step.targets.reshape(-1))
    torch.testing.assert_close(lm_loss(step.model, step.tokens, step.targets), expected)
    with pytest.raises(ValueError, match="unknown training dtype"):
        TrainStep(step.model, None, step.tokens, step.targets, dtype="fp8")


class _FakeClock:
    """A clock (seconds) that only the fake model and optimizer move: forward costs ``forward_ms``, backward
    ``backward_ms``, the optimizer step ``optimizer_ms``, each times ``speed`` (which ``drift`` multiplies
    after every phase: below 1, a machine that speeds up as it warms)."""

    def __init__(self, forward_ms=3.0, backward_ms=5.0, optimizer_ms=1.0, drift=1.0):
        self.now, self.speed, self.drift, self.log = 0.0, 1.0, drift, []
        self.cost = dict(forward=forward_ms, backward=backward_ms, optimizer=optimizer_ms)

    def __call__(self):
        return self.now

    def spend(self, phase):
        self.log.append(phase[0])
        self.now += self.cost[phase] * self.speed / 1e3
        self.speed *= self.drift


class _Spend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        clock.spend("forward")
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.spend("backward")
        return grad, None


class _ClockedModel(nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.w, self.clock = nn.Parameter(torch.ones(3)), clock

    def forward(self, tokens, targets):
        return _Spend.apply(self.w, self.clock).sum()


class _ClockedSGD(torch.optim.SGD):
    def __init__(self, params, clock):
        super().__init__(params, lr=0.0)
        self.clock = clock

    def step(self, closure=None):
        self.clock.spend("optimizer")
        return super().step(closure)


def _clocked_step(clock):
    model = _ClockedModel(clock)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    return TrainStep(model, _ClockedSGD(model.parameters(), clock), tokens, tokens)


def test_modes_are_timed_by_one_clock_with_exact_costs():
    clock = _FakeClock()
    timings, peaks = measure_modes(_clocked_step(clock), MODES, warmup=1, steps=4, clock=clock)
    assert set(timings) == {"fwd", "fwdbwd", "bwd", "step"} and all(math.isnan(p) for p in peaks.values())
    for column, ms in dict(fwd=3.0, fwdbwd=8.0, bwd=5.0, step=9.0).items():
        assert timings[column].samples_ms == pytest.approx([ms] * 4)


def test_interleaving_keeps_a_step_no_faster_than_its_forward_backward_on_a_drifting_machine():
    """A machine that speeds up 3% a phase: measured one mode after the other, the later train step comes out
    faster than the earlier forward+backward (the impossible row); interleaved, never."""
    clock = _FakeClock(drift=0.97)
    step = _clocked_step(clock)
    apart = {col: t for m in ("forward_backward", "train_step")
             for col, t in measure_mode(step, m, 2, 5, clock)[0].items()}
    assert apart["step"].median_ms < apart["fwdbwd"].median_ms  # the artifact the interleaving removes
    clock = _FakeClock(drift=0.97)
    together, _ = measure_modes(_clocked_step(clock), ["forward_backward", "train_step"], 2, 5, clock)
    assert together["step"].median_ms > together["fwdbwd"].median_ms
    with pytest.raises(ValueError, match="warmup"):
        measure_modes(_clocked_step(clock), ["forward"], warmup=-1, clock=clock)


def test_warm_ups_run_each_mode_alone_in_order_before_the_interleaved_rounds():
    """Each mode's warm-up (where its peak memory is read) runs before any later mode has run, so a forward's
    peak holds no optimizer state; the timed rounds then rotate the order."""
    clock = _FakeClock()
    measure_modes(_clocked_step(clock), MODES, warmup=1, steps=3, clock=clock)
    runs = "".join(clock.log).replace("fbo", "S").replace("fb", "B")  # a train step, a forward+backward
    assert runs == "fBS" + "fBS" + "BSf" + "SfB"
