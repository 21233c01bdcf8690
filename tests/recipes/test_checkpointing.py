"""lab.recipes.checkpointing: which profiler range a checkpointed block's forward and its recomputation run in
(the recipe's own exactness, hooks and saved ops: tests/recipes/test_fastest_step.py)."""

import pytest
import torch

from lab.model import ModelConfig, TransformerLM
from lab.recipes.checkpointing import CheckpointedBlock

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=40, context_length=16)


def _ranges(run) -> list[str]:
    """The ``block``/``recompute`` ranges the profiler records while ``run()`` runs, in the order they start."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = sorted((e for e in prof.events() if e.name in ("block", "recompute")), key=lambda e: e.time_range.start)
    return [e.name for e in events]


@pytest.mark.parametrize("policy", ["block", "save_attention", "save_outputs"])
def test_the_recomputation_runs_in_its_own_range(policy):
    """The forward runs in ``block``, the checkpoint's recomputation during backward in ``recompute``, once per
    backward (without selective checkpointing, which allows one backward, a second backward through the same
    graph recomputes, and is marked, again)."""
    torch.manual_seed(0)
    wrapped = CheckpointedBlock(TransformerLM(TINY).blocks[0], policy)
    x = torch.randn(2, 16, 32, requires_grad=True)
    out = wrapped(x).square().sum()
    again = policy == "block"
    assert _ranges(lambda: out.backward(retain_graph=again)) == ["recompute"]
    if again:
        assert _ranges(lambda: out.backward()) == ["recompute"]
    assert wrapped._recomputing == 0
    assert _ranges(lambda: wrapped(x)) == ["block"]


def test_a_forward_inside_another_backward_is_not_a_recomputation():
    """What marks the recomputation is the checkpoint's own recompute context, not "autograd's engine is
    running": a block called from a backward hook (a graph task is running, nothing is recomputed) runs in
    ``block``."""
    torch.manual_seed(0)
    wrapped = CheckpointedBlock(TransformerLM(TINY).blocks[0], "block")
    x = torch.randn(2, 16, 32, requires_grad=True)
    names = []

    def hook(grad):
        with torch.enable_grad():
            names.extend(_ranges(lambda: wrapped(x.detach().requires_grad_())))
        return grad

    y = (x * 2).sum()
    x.register_hook(hook)
    y.backward()
    assert names == ["block"]
