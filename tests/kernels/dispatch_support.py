"""What the dispatch tests of the forward and the backward share (their fixture, ``compiled_triton``, is in
conftest.py): whether this machine has an sm_90 GPU, shape-only tensors, and the GPU tests' shapes, inputs and
float64 reference."""

import math

import pytest
import torch


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def fake(shape, dtype=torch.bfloat16, device="cuda"):
    return torch.empty(*shape, dtype=dtype, device=device)


needs_hopper = pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU")

GPU_SHAPES = [  # lead (batch, or batch and heads), n_q, n_k, d, dtype, causal; "model": (batch, seq, heads, d) views
    ((2, 4), 1000, 1000, 128, torch.bfloat16, True),
    ((2, 3), 512, 700, 64, torch.float16, False),
    (6, 777, 777, 64, torch.bfloat16, True),
    ("model", 640, 640, 128, torch.bfloat16, True),
]


def gpu_inputs(lead, n_q, n_k, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if lead == "model":  # the model's layout: (batch, heads, seq, d) views of (batch, seq, heads, d)
        return [torch.randn(2, n, 4, d, device="cuda", dtype=dtype, generator=gen).transpose(1, 2).detach()
                .requires_grad_() for n in (n_q, n_k, n_k)]
    lead = (lead,) if isinstance(lead, int) else lead
    return [torch.randn(*lead, n, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            for n in (n_q, n_k, n_k)]


def float64_reference(q, k, v, grad, causal):
    """Output, logsumexp and the three gradients in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, -math.inf)
    out = torch.softmax(scores, -1) @ v64
    return (out, torch.logsumexp(scores, -1), *torch.autograd.grad(out, (q64, k64, v64), grad.double()))
