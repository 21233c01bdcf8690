"""lab.model.checkpointing: identical gradients (torch.equal), fewer saved tensors, the expected recomputation."""

import pytest
import torch

from lab.measure.saved_tensors import saved_tensor_report
from lab.measure.step import lm_loss, random_batch
from lab.model.checkpointing import (
    activation_checkpointing,
    best_group_size,
    checkpoint_memory_table,
    nested_memory_model,
    single_level_memory_model,
)
from lab.model.transformer import ModelConfig, TransformerLM

CFG = ModelConfig(d_model=32, d_ff=64, num_layers=8, num_heads=2, context_length=16, vocab_size=50)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = TransformerLM(CFG)
    return model, random_batch(CFG, 2, "cpu")


def _grads(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    with activation_checkpointing(model, **kw) if kw else torch.enable_grad():
        loss = lm_loss(model, *batch)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kw", [dict(group_size=1), dict(group_size=3), dict(group_size=8),
                                dict(strategy="nested"), dict(strategy="nested", leaf_size=3)])
def test_identical_gradients(setup, kw):
    model, batch = setup
    ref_loss, ref = _grads(model, batch)
    loss, got = _grads(model, batch, **kw)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert isinstance(model.blocks[0], type(model.blocks[1])) and len(model.blocks) == CFG.num_layers  # restored


def _forward_calls(model, batch, **kw):
    calls = [0] * CFG.num_layers
    handles = [b.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, b in enumerate(model.blocks)]
    _grads(model, batch, **kw)
    for h in handles:
        h.remove()
    return calls


def test_recomputation_counts(setup):
    model, batch = setup
    assert _forward_calls(model, batch) == [1] * 8
    assert _forward_calls(model, batch, group_size=4) == [2] * 8
    # nested: recomputing a checkpointed segment runs its first half and stops ("early stop", on by default
    # for non-reentrant checkpoints) as soon as the second half's checkpoint has saved its input; a leaf's
    # recomputation runs its block. So a block runs 1 + (segments in whose first half it lies) + 1 times.
    def expected(lo, hi, counts, checkpointed):
        if hi - lo == 1:
            counts[lo] += 1 if checkpointed else 0
            return
        mid = (lo + hi) // 2
        if checkpointed:
            for i in range(lo, mid):
                counts[i] += 1
        expected(lo, mid, counts, True)
        expected(mid, hi, counts, True)

    counts = [1] * 8
    expected(0, 8, counts, checkpointed=False)
    assert counts == [4, 3, 3, 2, 4, 3, 3, 2]
    assert _forward_calls(model, batch, strategy="nested") == counts


def test_checkpointing_saves_only_group_inputs(setup):
    model, (tokens, _) = setup
    plain = saved_tensor_report(model, tokens)
    with activation_checkpointing(model, group_size=2):
        ckpt = saved_tensor_report(model, tokens)
    residual = 2 * 16 * 32 * 4  # batch x context x d_model fp32
    blocks_saved = ckpt.records[ckpt.records["module"].str.startswith("blocks")]
    # only the 4 group inputs remain (the first is the embedding output, saved again by no one else)
    assert blocks_saved["counted_bytes"].sum() <= 4 * residual
    assert ckpt.total_bytes < plain.total_bytes / 3


def test_memory_models():
    assert single_level_memory_model(32, 4, 1.0, 10.0) == 8 + 40
    assert nested_memory_model(32, 1.0, 10.0) == 2 * 5 + 10
    assert best_group_size(32, 1.0, 10.0) == 2  # sqrt(32 / 10) ~ 1.8: divisors 1 (42), 2 (36), 4 (48)
    table = checkpoint_memory_table(32, 1.0, 10.0)
    assert table.loc[table["strategy"] == "none", "modelled_bytes"].item() == 320
    assert sorted(table.loc[table["strategy"] == "single", "group_size"]) == [1, 2, 4, 8, 16, 32]


def test_bad_arguments(setup):
    model, _ = setup
    with pytest.raises(ValueError):
        with activation_checkpointing(model, group_size=0):
            pass
    with pytest.raises(ValueError):
        with activation_checkpointing(model, strategy="weird"):
            pass
    with pytest.raises(TypeError):
        with activation_checkpointing(model, attr="lm_head"):
            pass
