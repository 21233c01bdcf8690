"""lab.measure.saved_tensors: bytes saved for backward, by operation and module, against hand-computed counts."""

import gc
import weakref

import pytest
import torch
from torch import nn

from lab.measure.saved_tensors import expected_gradient_bytes, saved_tensor_bytes, saved_tensor_report
from lab.model.transformer import ModelConfig, RMSNorm, TransformerBlock


def test_linear_relu_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    report = saved_tensor_report(model, torch.randn(2, 4))
    # addmm saves its input (2x4 fp32 = 32 B; the weight is not needed: the input needs no grad),
    # ReLU saves its output (2x3 fp32 = 24 B)
    assert report.by_op().set_index("op")["bytes"].to_dict() == {"AddmmBackward0": 32, "ReluBackward0": 24}
    assert report.by_module().set_index("module")["bytes"].to_dict() == {"0": 32, "1": 24}
    assert report.total_bytes == 56 and report.parameter_bytes == 0


def test_input_requiring_grad_saves_weight_but_counts_it_apart():
    lin = nn.Linear(4, 3, bias=False)
    report = saved_tensor_report(lin, torch.randn(2, 4, requires_grad=True))
    rec = report.records.set_index("order")
    # mm saves the input (for dW) and the transposed weight (for dX); the weight is a parameter
    assert sorted(rec["tensor_bytes"].tolist()) == [32, 48]
    assert report.total_bytes == 32
    assert report.parameter_bytes == 4 * 3 * 4


def test_shared_storage_is_counted_once():
    class TwoUses(nn.Module):
        def forward(self, x):
            h = x * 2                       # h: 8 x 8 fp32 = 256 B, saved by both products below
            return (h * h.t()).sum() + (h.view(64) * h.view(64)).sum()

    x = torch.randn(8, 8, requires_grad=True)
    report = saved_tensor_report(TwoUses(), x)
    mul = report.records[report.records["op"] == "MulBackward0"]
    assert mul["tensor_bytes"].sum() == 4 * 256  # four saved views of h
    assert report.total_bytes == 256             # one storage
    assert (report.records["counted_bytes"] > 0).sum() == 1


def test_rmsnorm_saves_input_statistic_and_normalised_output():
    d, rows = 16, 6
    norm = RMSNorm(d)
    x = torch.randn(rows, d, requires_grad=True)
    report = saved_tensor_report(norm, x)
    # eager: x (pow's input, and again for the mul), rsqrt's output (rows x 1), the normalised x (for the
    # weight's gradient); the weight itself is a parameter
    assert report.total_bytes == 4 * (rows * d + rows + rows * d)
    assert report.parameter_bytes == 4 * d


def test_transformer_block_top_ops_cover_everything():
    cfg = ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=2, context_length=8, vocab_size=16)
    block = TransformerBlock(cfg)
    x = torch.randn(2, 8, 32, requires_grad=True)
    report = saved_tensor_report(block, x)
    by_op = report.by_op()
    assert by_op["bytes"].sum() == report.total_bytes
    assert by_op["share"].sum() == pytest.approx(1.0)
    # the FFN saves d_ff-wide tensors: the w1 and w3 outputs (silu's input, the product's inputs)
    ffn = report.by_module(depth=1).set_index("module").loc["ffn", "bytes"]
    assert ffn >= 3 * 2 * 8 * 64 * 4
    assert expected_gradient_bytes(block) == 4 * sum(p.numel() for p in block.parameters())


def test_no_grad_saves_nothing():
    with torch.no_grad():
        report = saved_tensor_report(nn.Linear(4, 3), torch.randn(2, 4))
    assert report.total_bytes == 0 and report.records.empty


def test_saved_tensor_bytes_frees_the_graph():
    """Counting must not keep what it counts alive (a leak here polluted every later memory reading)."""
    refs = []

    def attention_keeping_a_weakref(q, k, v):
        probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        refs.append(weakref.ref(probs))
        return probs @ v

    q, k, v = (torch.randn(2, 64, 8, requires_grad=True) for _ in range(3))
    assert saved_tensor_bytes(attention_keeping_a_weakref, q, k, v) == 2 * 64 * 64 * 4
    gc.collect()
    assert refs[0]() is None
