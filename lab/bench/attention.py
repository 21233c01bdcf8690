"""The attention implementations the book compares, by the names of its tables, and their inputs.

Each takes ``fn(q, k, v, causal)`` on ``(batch, seq, d)`` tensors (heads folded into the batch), the interface
of ``FlashAttentionTriton.apply``, and all share the registry's top-left causal convention
(:mod:`lab.model.attention`).
"""

from __future__ import annotations

import torch
import torch._functorch.config  # not imported by ``import torch``; flex_attention_fn sets it

from lab.kernels.flash_pytorch import FlashAttentionPytorch
from lab.measure.device import resolve_device
from lab.model.attention import AttentionFn, get_attention, naive_attention


def sdpa_on_heads(name: str = "sdpa") -> AttentionFn:
    """An SDPA variant of the registry on ``(batch, seq, d)``: viewed as one batch of ``batch`` heads,
    because the fused (Flash/cuDNN/efficient) backends only accept 4-D input and would otherwise fall back
    to the math kernel."""
    fn = get_attention(name)
    return lambda q, k, v, causal: fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal)[0]


#: The benchmark's implementation names (the ``impl`` column of ``flash_benchmark.csv``).
IMPLS = ("triton", "triton_compiled_bwd", "pytorch_flash", "pytorch_naive", "sdpa", "sdpa_flash", "sdpa_cudnn",
         "sdpa_efficient", "flex")

_FLEX = {}


def flex_attention_fn() -> AttentionFn:
    """PyTorch's FlexAttention as a peer: ``torch.compile`` of ``flex_attention`` (Triton kernels that
    Inductor generates) with a causal block mask, so fully masked key blocks are skipped as in the other
    fused kernels; on ``(batch, seq, d)`` inputs viewed as one batch of ``batch`` heads. Block masks are
    built once per (sequence lengths, device) and reused.

    Turns off AOTAutograd's donated buffers for the rest of the process: the benchmarks run one forward's
    backward repeatedly (``retain_graph=True``), which a compiled backward that frees ("donates") its saved
    tensors refuses, and the check reads the setting when the backward runs, so a scoped patch cannot do. Raises
    dynamo's recompile limit too (to 64): every new shape is one more compilation of ``flex_attention``, and
    past the default 8 dynamo would run it uncompiled (materializing the whole score matrix) without failing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # optional: torch >= 2.5

    if "fn" not in _FLEX:
        torch._functorch.config.donated_buffer = False
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def fn(q, k, v, causal=True):
        mask = None
        if causal:
            key = (q.shape[-2], k.shape[-2], str(q.device))
            if key not in _FLEX:
                _FLEX[key] = create_block_mask(causal_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
            mask = _FLEX[key]
        return _FLEX["fn"](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), block_mask=mask)[0]

    return fn


def attention_impl(name: str, device: torch.device | str = "auto") -> AttentionFn:
    """The attention function ``fn(q, k, v, causal)`` on ``(batch, seq, d)`` called ``name`` in the tables.

    ``pytorch_naive`` (the registry's naive attention), ``sdpa`` and ``sdpa_<backend>`` (SDPA, default or one
    backend), ``triton`` (``FlashAttentionTriton``), ``triton_compiled_bwd`` (Triton forward, backward as
    compiled PyTorch), ``flex`` (compiled FlexAttention, :func:`flex_attention_fn`) and ``pytorch_flash``
    (``FlashAttentionPytorch``, tiled in pure PyTorch). All share
    the registry's top-left causal convention. The flash kernels are imported only when asked for (on a
    machine without a GPU, ``import lab`` has already switched Triton to its interpreter).
    """
    if isinstance(device, str):
        resolve_device(device)  # an unknown device name is an error here too
    if name == "pytorch_naive":
        return naive_attention
    if name.startswith("sdpa") and name in IMPLS:
        return sdpa_on_heads(name)
    if name == "triton":
        # optional dependency: Triton (Linux only), imported only when its kernel is asked for
        from lab.kernels.flash_triton import FlashAttentionTriton

        return lambda q, k, v, causal: FlashAttentionTriton.apply(q, k, v, causal)
    if name == "triton_compiled_bwd":
        # optional dependency: Triton (Linux only), imported only when its kernel is asked for
        from lab.kernels.flash_triton import FlashAttentionTritonCompiledBackward

        return lambda q, k, v, causal: FlashAttentionTritonCompiledBackward.apply(q, k, v, causal)
    if name == "pytorch_flash":
        return lambda q, k, v, causal: FlashAttentionPytorch.apply(q, k, v, causal)
    if name == "flex":
        return flex_attention_fn()
    raise ValueError(f"unknown attention implementation {name!r}; choose one of {', '.join(IMPLS)}")


def attention_inputs(batch: int, seq: int, d: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Seeded random ``q, k, v`` (requiring gradients) and an upstream gradient ``dout``, each ``(batch, seq,
    d)`` in ``dtype`` on ``device``: the same values on every device for one seed (drawn on the CPU)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda: torch.randn(batch, seq, d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = (make().requires_grad_() for _ in range(3))
    return q, k, v, make()
