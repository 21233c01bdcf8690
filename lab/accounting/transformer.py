"""Memory and FLOPs of ``lab.model.TransformerLM`` in closed form: parameters, training state under a
precision policy, the activations autograd saves (counted tensor by tensor), matmul FLOPs.

Functions take a model config (anything with ``vocab_size``, ``d_model``, ``d_ff``, ``num_layers``,
``num_heads``, ``context_length``, ``attention``) and return plain ints; the ``*_expr`` forms are sympy.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.accounting.symbols import B, D, F, GiB, L, T, V


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per element of each kind of training state under one precision policy.

    ``param``/``grad``/``optimizer`` are bytes per parameter (``optimizer`` counts AdamW's m and v
    together); ``weight_copy`` the bytes per matrix-weight element of the low-precision copies that
    autocast makes and keeps for backward; ``activation`` the bytes of a saved activation that is in
    the compute dtype.
    """

    name: str
    param: int
    grad: int
    optimizer: int
    weight_copy: int
    activation: int
    description: str


POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", 4, 4, 8, 0, 4, "everything in fp32"),
    "bf16_autocast": PrecisionPolicy(
        "bf16_autocast", 4, 4, 8, 2, 2,
        "fp32 master weights, fp32 gradients and AdamW state; matmuls under bf16 autocast, which keeps a "
        "bf16 copy of each weight matrix for backward"),
    "bf16": PrecisionPolicy("bf16", 2, 2, 4, 0, 2, "pure bf16: weights, gradients, AdamW m and v all bf16"),
}
# ``lab.bench.lm`` calls autocast "bf16"; here that name means pure bf16, so translate at the boundary. Autocast
# to fp16 keeps the same bytes as to bf16 (16-bit weight copies and activations).
BENCH_DTYPE_TO_POLICY = {"fp32": "fp32", "bf16": "bf16_autocast", "fp16": "bf16_autocast"}


def policy(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The :class:`PrecisionPolicy` called ``name`` (``fp32``, ``bf16_autocast``, ``bf16``)."""
    if isinstance(name, PrecisionPolicy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown precision policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]


# ----------------------------------------------------------------------------------------------------------
# Parameters and training state of lab.model.transformer.TransformerLM


def parameter_count_expr(vocab=V, d_model=D, d_ff=F, layers=L):
    """Parameters of ``TransformerLM``: untied embedding and LM head (2 V D), per block q/k/v/o (4 D^2),
    SwiGLU w1/w2/w3 (3 D F) and two RMSNorm weights (2 D), plus the final RMSNorm (D). No biases."""
    return 2 * vocab * d_model + layers * (4 * d_model**2 + 3 * d_model * d_ff + 2 * d_model) + d_model


def _cfg_values(cfg) -> dict:
    return dict(vocab=cfg.vocab_size, d_model=cfg.d_model, d_ff=cfg.d_ff, layers=cfg.num_layers)


def parameter_count(cfg) -> int:
    """Number of parameters of ``TransformerLM(cfg)`` from the closed form (an int)."""
    return int(parameter_count_expr(**_cfg_values(cfg)))


def matrix_parameter_count(cfg) -> int:
    """Parameters in the matrices that matmuls use (what autocast copies to bf16): blocks and LM head."""
    d, f = cfg.d_model, cfg.d_ff
    return cfg.num_layers * (4 * d * d + 3 * d * f) + d * cfg.vocab_size


def state_memory(cfg, precision: str | PrecisionPolicy = "fp32") -> dict[str, int]:
    """Bytes of parameters, gradients, AdamW state (m and v) and autocast weight copies for ``cfg``.

    Returns a dict with ``params``, ``grads``, ``optimizer``, ``weight_copies`` (bf16 copies of the
    matrices that autocast keeps alive from forward until backward), ``buffers`` (RoPE tables) and ``total``.
    """
    pol = policy(precision)
    n = parameter_count(cfg)
    head_dim = cfg.d_model // cfg.num_heads
    # RoPE cos and sin tables (context x head_dim/2 each) are fp32 buffers in every block; pure bf16 casts
    # the whole model, buffers included.
    rope_bytes = (2 if pol.name == "bf16" else 4) * cfg.num_layers * cfg.context_length * head_dim
    out = dict(params=n * pol.param, grads=n * pol.grad, optimizer=n * pol.optimizer,
               weight_copies=matrix_parameter_count(cfg) * pol.weight_copy, buffers=rope_bytes)
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------------------------------------
# Saved activations of lab.model.transformer.TransformerLM (what autograd keeps for backward)


def saved_activation_bytes(cfg, batch: int, context: int, precision: str | PrecisionPolicy = "fp32",
                           device_type: str = "cuda") -> dict[str, int]:
    """Bytes autograd saves for backward in one forward of ``TransformerLM(cfg)`` plus the loss of ``lab.bench.lm``.

    Counted tensor by tensor from what ``lab.model.transformer`` does (and checked against
    ``torch.autograd.graph.saved_tensors_hooks`` in the tests), per token and block with ``D = d_model``,
    ``F = d_ff``, ``H`` heads, ``T = context``:

    * each RMSNorm saves its fp32 input and the normalised fp32 ``x * rstd`` (2 D x 4 bytes) and ``rstd``
      (4 bytes); its output is saved by the matmuls that read it: once in fp32, once in pure bf16, but
      under autocast each consuming Linear casts (and saves) its own bf16 copy (3 for q/k/v, 2 for w1/w3);
    * attention: SDPA saves q, k, v, the output (4 D) and the fp32 logsumexp (H); naive attention saves
      q, k, v (3 D), the softmax probabilities (H T per token; under CUDA autocast softmax runs in fp32 and
      the bf16 copy for the second matmul is saved as well) and a T x T boolean mask per block;
    * the o_proj input (D, a copy made by the head reshape) and SwiGLU's w1 output, silu of it, w3 output
      and the product (4 F);
    * under autocast, the bf16 RoPE tables cast for q and for k (4 x T x head_dim/2 per block);
    * the head: the final RMSNorm as above, the LM-head input, the fp32 log-softmax (V per token), and
      the int64 tokens and targets.

    Autocast's bf16 weight copies are *not* counted here (see :func:`state_memory`). Returns a dict with
    ``blocks``, ``head`` and ``total`` bytes, and ``per_token_per_block`` (bytes, without per-block
    constants).
    """
    pol = policy(precision)
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    d, f, h, v = cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.vocab_size
    t, tokens = context, batch * context
    a = pol.activation
    autocast = pol.name == "bf16_autocast"
    naive = cfg.attention == "naive"

    def norm_bytes(consumers: int) -> int:
        statistics = 4 * (2 * d + 1)
        if pol.name == "fp32":
            return statistics + 4 * d
        return statistics + (consumers if autocast else 1) * d * a

    per_token = norm_bytes(3) + norm_bytes(2)
    if naive:
        probs = h * t * (4 + 2 if autocast and device_type == "cuda" else a)
        per_token += 3 * d * a + probs
    else:
        per_token += 4 * d * a + 4 * h  # q, k, v, output; fp32 logsumexp
    per_token += d * a + 4 * f * a  # o_proj input; SwiGLU
    per_block_constant = (t * t if naive else 0) + (4 * t * (d // h) // 2 * 2 if autocast else 0)
    blocks = cfg.num_layers * (tokens * per_token + per_block_constant)
    head_per_token = norm_bytes(1) + 4 * v + 8 + 8
    head = tokens * head_per_token + 4  # + the loss's scalar total weight
    return dict(blocks=blocks, head=head, total=blocks + head, per_token_per_block=per_token)


def training_memory(cfg, batch: int, context: int, precision: str | PrecisionPolicy = "fp32",
                    mode: str = "train_step", device_type: str = "cuda") -> dict[str, int]:
    """Predicted bytes of a forward / forward+backward / AdamW train step, by kind.

    ``total`` is the sum ``params + grads + optimizer + weight copies + activations``, keeping only what
    exists in ``mode`` (``forward`` has no gradients or optimizer state, ``forward_backward`` no optimizer
    state): the accounting the course asks for, and the peak when the gradients live through the step
    (DDP's bucketed gradient buffers). ``peak`` is :func:`step_peak_bytes`: the peak when the gradients are
    dropped before each forward, as :class:`lab.measure.step.TrainStep` does. Temporaries such as the
    logits or AdamW's scratch are in neither. Returns a dict of bytes.
    """
    modes = ("forward", "forward_backward", "train_step")
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}")
    state = state_memory(cfg, precision)
    out = dict(params=state["params"] + state["buffers"],
               grads=state["grads"] if mode != "forward" else 0,
               optimizer=state["optimizer"] if mode == "train_step" else 0,
               weight_copies=state["weight_copies"],
               activations=saved_activation_bytes(cfg, batch, context, precision, device_type)["total"])
    out["total"] = sum(out.values())
    out["peak"] = step_peak_bytes(out, mode)
    return out


def step_peak_bytes(parts: dict[str, float], mode: str) -> float:
    """Peak of one step whose gradients were dropped before its forward, from :func:`training_memory`'s parts.

    The forward ends holding every saved activation and autocast weight copy. The backward then walks the
    blocks from last to first: each block's activations and copies are freed as its gradients appear, so
    what it holds moves linearly from ``activations + weight_copies`` to ``grads`` and its largest value is at
    one end. Parameters (and AdamW's moments, from the previous step) are held throughout; the optimizer
    step itself holds ``params + grads + optimizer``, which the second end already covers.
    """
    held = parts["params"] + (parts["optimizer"] if mode == "train_step" else 0)
    saved = parts["activations"] + parts["weight_copies"]
    return held + (saved if mode == "forward" else max(saved, parts["grads"]))


# ----------------------------------------------------------------------------------------------------------
# FLOPs


def forward_flops_expr(batch=B, context=T, d_model=D, d_ff=F, layers=L, vocab=V):
    """Matmul FLOPs of one ``TransformerLM`` forward (2 m n k per matmul).

    Per token and block: q/k/v/o projections ``2 * 4 D^2``, SwiGLU ``2 * 3 D F``, and attention's two
    T x T score matmuls ``2 * 2 T D`` (the full square: the causal half is not skipped); the LM head adds
    ``2 D V`` per token. Element-wise work (norms, softmax, SiLU) is not counted.
    """
    tokens = batch * context
    per_block = 2 * 4 * d_model**2 + 2 * 3 * d_model * d_ff + 2 * 2 * context * d_model
    return tokens * (layers * per_block + 2 * d_model * vocab)


def forward_flops(cfg, batch: int, context: int) -> int:
    """Forward matmul FLOPs of ``TransformerLM(cfg)`` on ``batch`` sequences of ``context`` tokens."""
    return int(forward_flops_expr(batch, context, cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.vocab_size))


def backward_flops(cfg, batch: int, context: int) -> int:
    """Backward FLOPs: twice the forward (each matmul needs one product for the input and one for the weight)."""
    return 2 * forward_flops(cfg, batch, context)


def training_flops(cfg, batch: int, context: int) -> int:
    """Forward + backward matmul FLOPs of one training step (3x the forward)."""
    return 3 * forward_flops(cfg, batch, context)


def memory_table(configs: dict, batch: int, context: int, precisions=("fp32", "bf16_autocast", "bf16"),
                 mode: str = "train_step"):
    """Predicted training memory (GiB) by kind for each named config and precision policy; a DataFrame.

    ``configs`` maps a size name to a model config. Columns: ``size``, ``precision``, ``params_M``
    (millions), ``params_gib``, ``grads_gib``, ``optimizer_gib``, ``weight_copies_gib``, ``activations_gib``,
    ``total_gib``.
    """
    import pandas as pd

    rows = []
    for size, cfg in configs.items():
        for prec in precisions:
            mem = training_memory(cfg, batch, context, prec, mode)
            rows.append(dict(size=size, precision=prec, params_M=parameter_count(cfg) / 1e6,
                             **{f"{k}_gib": v / GiB for k, v in mem.items() if k != "peak"}))
    return pd.DataFrame(rows)


def flops_table(configs: dict, batch: int, context: int):
    """Forward, backward and train-step matmul TFLOPs for each named config (a DataFrame)."""
    import pandas as pd

    rows = []
    for size, cfg in configs.items():
        fwd = forward_flops(cfg, batch, context)
        rows.append(dict(size=size, batch=batch, context=context, forward_tflop=fwd / 1e12,
                         backward_tflop=2 * fwd / 1e12, train_tflop=3 * fwd / 1e12,
                         attention_share=attention_share(cfg, batch, context)))
    return pd.DataFrame(rows)


def attention_share(cfg, batch: int, context: int) -> float:
    """Fraction of forward FLOPs in the two T x T score matmuls."""
    scores = batch * context * cfg.num_layers * 4 * context * cfg.d_model
    return scores / forward_flops(cfg, batch, context)
