"""Parallelism arithmetic: memory, FLOPs and communication time in closed form.

Everything here is a formula, kept symbolic with sympy so a notebook can print the derivation and then
evaluate it (``.subs`` / ``sympy.lambdify`` / :func:`as_float`). The closed forms accept sympy symbols *or*
numbers for each quantity: with numbers they return exact sympy numbers (``float(...)`` them), with
symbols expressions; the module-level symbols below are the defaults. Functions that take a
``lab.model.transformer.ModelConfig`` return plain ints (bytes, FLOPs), and the ``*_table`` functions DataFrames.

Units: bytes, FLOPs, seconds, bytes/s, FLOP/s. ``B`` is a number of *tokens* (batch x sequence).
Conventions for collectives (shared with :mod:`lab.accounting.ring_sim`, which checks them step by step): ``S`` is the
size in bytes of the full array, ``N`` the number of devices on the ring, ``W`` the bytes/s each device can
send (its egress bandwidth), ``alpha`` a per-step latency (0 unless given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp

# ----------------------------------------------------------------------------------------------------------
# Symbols

S, N, W, alpha = sp.symbols("S N W alpha", positive=True)
B, D, F, L, V, H, T = sp.symbols("B D F L V H T", positive=True)
C, p = sp.symbols("C p", positive=True)  # FLOP/s per device; bytes per communicated element
X, Y, W_X, W_Y, M_X, M_Y, W_ici = sp.symbols("X Y W_X W_Y M_X M_Y W_ici", positive=True)

GB = 10**9  # device memory is sold in decimal gigabytes (H100 "80 GB", TPU v5p "95 GB")
GiB = 2**30
HALF = sp.Rational(1, 2)  # FSDP shards every other layer's activations


def as_float(expr, **values) -> float:
    """Evaluate a sympy expression to a float after substituting ``values`` (symbol name -> number)."""
    expr = sp.sympify(expr)
    subs = {sym: values[sym.name] for sym in expr.free_symbols if sym.name in values}
    out = expr.subs(subs)
    if out.free_symbols:
        raise ValueError(f"no value given for {sorted(s.name for s in out.free_symbols)}")
    return float(out)


# ----------------------------------------------------------------------------------------------------------
# Precision policies


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
# ``lab.bench.lm`` calls autocast "bf16"; here that name means pure bf16, so translate at the boundary.
BENCH_DTYPE_TO_POLICY = {"fp32": "fp32", "bf16": "bf16_autocast"}


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
    """Predicted bytes held at the peak of a forward / forward+backward / AdamW train step, by kind.

    The sum ``params + grads + optimizer + weight copies + activations``, keeping only what exists in
    ``mode``: ``forward`` has no gradients or optimizer state, ``forward_backward`` no optimizer state.
    It is an estimate of the peak: backward frees activations while it creates gradients (so the sum
    overstates), and temporaries such as logits or AdamW's scratch are not counted (so it understates).
    Returns a dict of bytes with a ``total``.
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
    return out


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


# ----------------------------------------------------------------------------------------------------------
# Ring collectives


def ring_all_gather_time(S=S, N=N, W=W, alpha=0):
    """Ring all-gather of a full array of S bytes (each device starts with S/N): N-1 steps of S/N bytes.

    Time ``(N-1) (alpha + S / (N W))`` seconds."""
    return (N - 1) * (alpha + S / (N * W))


def ring_reduce_scatter_time(S=S, N=N, W=W, alpha=0):
    """Ring reduce-scatter of S bytes per device into S/N-byte reduced shards: N-1 steps of S/N bytes.

    Time ``(N-1) (alpha + S / (N W))`` seconds."""
    return (N - 1) * (alpha + S / (N * W))


def ring_all_reduce_time(S=S, N=N, W=W, alpha=0):
    """Bandwidth-optimal ring all-reduce = reduce-scatter + all-gather: 2(N-1) steps of S/N bytes.

    Time ``2 (N-1) (alpha + S / (N W))`` seconds; tends to ``2 S / W`` for large N."""
    return 2 * (N - 1) * (alpha + S / (N * W))


def alternate_ring_all_reduce_time(S=S, N=N, W=W, alpha=0):
    """The alternate (naive) ring all-reduce: the *whole* S-byte array of every device travels the ring.

    Each of N-1 steps, every device forwards a full array (its own first, then the one it just received)
    and adds what it receives, so after N-1 steps each holds the sum of all N. Time
    ``(N-1) (alpha + S / W)`` seconds: N/2 times the bandwidth-optimal all-reduce (equal at N = 2), but
    only N-1 latencies instead of 2(N-1)."""
    return (N - 1) * (alpha + S / W)


def ring_all_gather_bytes(S=S, N=N):
    """Bytes each device sends in a ring all-gather: ``(N-1) S / N``."""
    return (N - 1) * S / N


def ring_reduce_scatter_bytes(S=S, N=N):
    """Bytes each device sends in a ring reduce-scatter: ``(N-1) S / N``."""
    return (N - 1) * S / N


def ring_all_reduce_bytes(S=S, N=N):
    """Bytes each device sends in a reduce-scatter + all-gather ring all-reduce: ``2 (N-1) S / N``."""
    return 2 * (N - 1) * S / N


def alternate_ring_all_reduce_bytes(S=S, N=N):
    """Bytes each device sends in the alternate (whole-array) ring all-reduce: ``(N-1) S``."""
    return (N - 1) * S


COLLECTIVES = {
    "all_gather": (ring_all_gather_time, ring_all_gather_bytes),
    "reduce_scatter": (ring_reduce_scatter_time, ring_reduce_scatter_bytes),
    "all_reduce": (ring_all_reduce_time, ring_all_reduce_bytes),
    "alternate_all_reduce": (alternate_ring_all_reduce_time, alternate_ring_all_reduce_bytes),
}


def collective_time(name: str, S=S, N=N, W=W, alpha=0):
    """Time (s) of the ring collective ``name`` (a key of ``COLLECTIVES``)."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name][0](S, N, W, alpha)


def collective_bytes(name: str, S=S, N=N):
    """Bytes each device sends in the ring collective ``name``."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; choose one of {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name][1](S, N)


# ----------------------------------------------------------------------------------------------------------
# One SwiGLU FFN (w1, w3: D x F; w2: F x D) on B tokens under DP, FSDP, TP and 2-D (FSDP x TP)

STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")
PHASES = ("forward", "train")


def _ring(n, exact: bool):
    """The (n-1)/n factor of a ring collective, or 1 in the large-n approximation."""
    return (n - 1) / n if exact else 1


def ffn_costs(strategy: str, phase: str = "train", exact: bool = True, B=B, D=D, F=F, N=N, X=X, Y=Y,
              C=C, W=W, W_X=W_X, W_Y=W_Y, p=p) -> dict:
    """FLOPs, bytes and times per device of one SwiGLU FFN under a parallelism ``strategy``.

    Strategies (``N`` devices; ``X * Y`` for ``fsdp_tp``):

    * ``dp``: weights replicated, tokens split; training all-reduces the 3 D F gradients.
    * ``fsdp``: tokens split, weights sharded; all-gather the weights before forward (and again before
      backward), reduce-scatter the gradients.
    * ``tp``: Megatron-style with sequence-sharded activations: w1/w3 split by columns, w2 by rows;
      all-gather the B x D input, reduce-scatter the B x D output (backward: the mirror pair).
    * ``fsdp_tp``: FSDP over X devices (bandwidth ``W_X``) on weights already split Y ways by TP over Y
      devices (bandwidth ``W_Y``, on B/X tokens).

    ``phase`` is ``forward`` (FLOPs 6 B D F) or ``train`` (forward + backward, 18 B D F). ``p`` is bytes per
    communicated element. ``exact=False`` drops the (n-1)/n ring factors (the large-n approximation).
    Returns a dict of sympy expressions: ``flops`` and ``compute_time`` per device, ``comm_bytes`` and
    ``comm_time`` per mesh axis (dicts keyed ``"N"`` or ``"X"``/``"Y"``).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    train = phase == "train"
    weights = 3 * D * F * p  # bytes of the three matrices
    total_flops = (18 if train else 6) * B * D * F
    if strategy == "fsdp_tp":
        devices = X * Y
        fsdp_collectives = 3 if train else 1  # all-gather (forward), all-gather (backward), reduce-scatter
        tp_collectives = 4 if train else 2  # all-gather + reduce-scatter per direction
        comm_bytes = {"X": fsdp_collectives * _ring(X, exact) * weights / Y,
                      "Y": tp_collectives * _ring(Y, exact) * (B / X) * D * p}
        comm_time = {"X": comm_bytes["X"] / W_X, "Y": comm_bytes["Y"] / W_Y}
    else:
        devices = N
        if strategy == "dp":
            nbytes = 2 * _ring(N, exact) * weights if train else sp.Integer(0)
        elif strategy == "fsdp":
            nbytes = (3 if train else 1) * _ring(N, exact) * weights
        else:  # tp
            nbytes = (4 if train else 2) * _ring(N, exact) * B * D * p
        comm_bytes = {"N": nbytes}
        comm_time = {"N": nbytes / W}
    flops = total_flops / devices
    return dict(flops=flops, compute_time=flops / C, comm_bytes=comm_bytes, comm_time=comm_time)


def max_devices(strategy: str, phase: str = "train", network: str = "overlapped", exact: bool = True,
                **values):
    """The largest device count at which communication still fits under compute (sympy expression).

    ``network="overlapped"``: communication runs alongside compute and each mesh axis has links of its own,
    so a step is compute bound while every axis's communication time <= the compute time. ``network=
    "shared"``: both axes of ``fsdp_tp`` send over the same link of bandwidth ``W``, so their times add
    (for one-axis strategies the two cases coincide). Communication that cannot overlap compute at all
    (serial) crosses compute at the same device count, but costs its full time below it as well (see
    :func:`ffn_strategy_table`). For ``fsdp_tp`` returns a dict with ``X``, ``Y`` and
    ``N = X * Y``: with separate links the per-axis bounds; with a shared link the (X, Y) that maximises
    X Y on the boundary (it can fall below 1 on one axis, where that axis alone is the better choice).
    ``values`` substitutes numbers by symbol name (``B``, ``D``, ``F``, ``C``, ``W``, ``W_X``, ``W_Y``,
    ``p``) before solving. Returns ``oo`` when communication never dominates (forward DP has none).
    """
    if network not in ("overlapped", "shared"):
        raise ValueError(f"network must be 'overlapped' or 'shared', got {network!r}")
    costs = ffn_costs(strategy, phase, exact)
    known = {sym.name: sym for sym in (B, D, F, C, W, W_X, W_Y, p)}
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"unknown quantities {sorted(unknown)}; max_devices takes {', '.join(known)}")
    subs = {known[name]: val for name, val in values.items() if val is not None}

    def largest_root(expr, var):
        roots = [r for r in sp.solve(sp.Eq(expr, 0), var) if r.is_positive is not False]
        if not roots:
            return sp.oo
        return roots[0] if len(roots) == 1 else sp.Max(*roots)

    if strategy != "fsdp_tp":
        comm = costs["comm_time"]["N"]
        if comm == 0:
            return sp.oo
        gap = sp.together(costs["compute_time"] - comm).subs(subs)
        return sp.simplify(largest_root(sp.numer(gap), N))
    compute = costs["compute_time"]
    if network == "overlapped":
        x_max = largest_root(sp.numer(sp.together(compute - costs["comm_time"]["X"]).subs(subs)), X)
        y_max = largest_root(sp.numer(sp.together(compute - costs["comm_time"]["Y"]).subs(subs)), Y)
        return dict(X=sp.simplify(x_max), Y=sp.simplify(y_max), N=sp.simplify(x_max * y_max))
    shared = {W_X: W, W_Y: W}
    gap = sp.together((compute - costs["comm_time"]["X"] - costs["comm_time"]["Y"]).subs(shared)).subs(subs)
    # on the boundary the condition is linear in X and Y: solve for Y, then maximise X*Y over X
    y_of_x = sp.solve(sp.Eq(sp.numer(gap), 0), Y)[0]
    x_best = sp.solve(sp.diff(X * y_of_x, X), X)[0]
    y_best = sp.simplify(y_of_x.subs(X, x_best))
    return dict(X=sp.simplify(x_best), Y=y_best, N=sp.simplify(x_best * y_best))


# ----------------------------------------------------------------------------------------------------------
# The FFN-only XXL model and TPU v5p (the scaling book's notation)

XXL = dict(d_model=16384, d_ff=53248, num_blocks=126)
TPU_V5P = dict(W_ici=2 * 9 * 10**10, C=46 * 10**13, memory_bytes=95 * GB)
H100_MEMORY_BYTES = 80 * GB


def ffn_model_parameters(d_model=D, d_ff=F, blocks=L):
    """Parameters of an FFN-only model: three D x F matrices per block, nothing else."""
    return 3 * d_model * d_ff * blocks


def ffn_saved_elements_per_token(d_model=D, d_ff=F):
    """Elements one SwiGLU FFN saves for backward per token: input x (D, shared by w1 and w3), w1's
    output (for SiLU's backward), SiLU of it and w3's output (for the product), and the product (w2's
    input): ``D + 4 F``."""
    return d_model + 4 * d_ff


def fsdp_memory_per_device(state_bytes, activation_bytes, n, activation_sharded_fraction=HALF):
    """Bytes per device when all state and a fraction of the activations are sharded over ``n`` devices.

    ``state_bytes / n + activation_bytes * (fraction / n + 1 - fraction)``: the sharded activations are
    the ones of every other layer in practice (fraction 1/2)."""
    f = activation_sharded_fraction
    return state_bytes / n + activation_bytes * (f / n + 1 - f)


def fsdp_tp_forward_times(exact: bool = False):
    """Forward times of one FFN under FSDP over X and TP over Y, in the scaling book's mesh notation.

    The FSDP axis spans ``M_X`` ICI axes and the TP axis ``M_Y`` (bandwidth ``M W_ici`` each); bf16
    communication (p = 2). Returns ``compute``, ``fsdp`` and ``tp`` times as sympy expressions.
    """
    costs = ffn_costs("fsdp_tp", "forward", exact, p=2, W_X=M_X * W_ici, W_Y=M_Y * W_ici)
    return dict(compute=costs["compute_time"], fsdp=costs["comm_time"]["X"], tp=costs["comm_time"]["Y"])


def fsdp_tp_compute_bound_batch(network: str = "overlapped", exact: bool = False):
    """The smallest total batch ``B`` (tokens) at which the FSDP x TP forward of one FFN is compute bound.

    ``overlapped``: the FSDP all-gather over X and the TP collectives over Y each take no longer than the
    compute (``B / X >= C / (W_ici M_X)`` in the large-X limit) -- the TP condition does not involve B
    and is returned separately as ``tp_ok`` (a sympy relation). ``shared``: their times add. Returns a dict
    with ``B`` (expression in X, Y, C, W_ici, M_X, M_Y, F, and D where it enters), ``per_fsdp_shard`` = B/X
    and ``per_chip`` = B/(X Y).
    """
    t = fsdp_tp_forward_times(exact)
    if network == "overlapped":
        b = sp.solve(sp.Eq(t["compute"], t["fsdp"]), B)[0]
    elif network == "shared":
        b = sp.solve(sp.Eq(t["compute"], t["fsdp"] + t["tp"]), B)[0]
    else:
        raise ValueError(f"network must be 'overlapped' or 'shared', got {network!r}")
    b = sp.simplify(b)
    tp_ok = sp.simplify(t["compute"] / t["tp"]) >= 1
    return dict(B=b, per_fsdp_shard=sp.simplify(b / X), per_chip=sp.simplify(b / (X * Y)), tp_ok=tp_ok)


# ----------------------------------------------------------------------------------------------------------
# Tables for the notebook (numbers from the formulas above)


def memory_table(sizes, batch: int, context: int, precisions=("fp32", "bf16_autocast", "bf16"),
                 attention: str = "sdpa", mode: str = "train_step"):
    """Predicted training memory (GiB) by kind for each model size and precision policy; a DataFrame.

    Columns: ``size``, ``precision``, ``params_M`` (millions), ``params_gib``, ``grads_gib``,
    ``optimizer_gib``, ``weight_copies_gib``, ``activations_gib``, ``total_gib``.
    """
    import pandas as pd

    from lab.model.transformer import config_for

    rows = []
    for size in sizes:
        cfg = config_for(size, context_length=context, attention=attention)
        for prec in precisions:
            mem = training_memory(cfg, batch, context, prec, mode)
            rows.append(dict(size=size, precision=prec, params_M=parameter_count(cfg) / 1e6,
                             **{f"{k}_gib": v / GiB for k, v in mem.items()}))
    return pd.DataFrame(rows)


def flops_table(sizes, batch: int, context: int):
    """Forward, backward and train-step matmul TFLOPs for each size (a DataFrame)."""
    import pandas as pd

    from lab.model.transformer import config_for

    rows = []
    for size in sizes:
        cfg = config_for(size, context_length=context)
        fwd = forward_flops(cfg, batch, context)
        rows.append(dict(size=size, batch=batch, context=context, forward_tflop=fwd / 1e12,
                         backward_tflop=2 * fwd / 1e12, train_tflop=3 * fwd / 1e12,
                         attention_share=_attention_share(cfg, batch, context)))
    return pd.DataFrame(rows)


def _attention_share(cfg, batch: int, context: int) -> float:
    """Fraction of forward FLOPs in the two T x T score matmuls."""
    scores = batch * context * cfg.num_layers * 4 * context * cfg.d_model
    return scores / forward_flops(cfg, batch, context)


def collective_table(size_bytes: float, devices, bandwidth: float, latency: float = 0.0):
    """Time (s) and bytes sent per device of every ring collective for each device count; a DataFrame."""
    import pandas as pd

    rows = []
    for name in COLLECTIVES:
        # one compiled numeric function per formula, evaluated for every N
        time_fn = sp.lambdify((S, N, W, alpha), collective_time(name, alpha=alpha))
        bytes_fn = sp.lambdify((S, N), collective_bytes(name))
        for n in devices:
            rows.append(dict(collective=name, devices=n, size_bytes=size_bytes, bandwidth=bandwidth,
                             time_s=float(time_fn(size_bytes, n, bandwidth, latency)),
                             bytes_sent=float(bytes_fn(size_bytes, n))))
    return pd.DataFrame(rows).sort_values(["devices", "collective"], kind="stable", ignore_index=True)


def ffn_strategy_table(devices, phase: str = "train", **values):
    """Compute and communication time per device of one FFN for DP, FSDP and TP at each device count.

    ``values`` gives ``B``, ``D``, ``F``, ``C``, ``W``, ``p``. Returns a DataFrame with ``strategy``,
    ``devices``, ``compute_s``, ``comm_s``, ``comm_bound`` (comm > compute), the step time when
    communication overlaps compute (``step_overlapped_s`` = max) and when it does not (``step_serial_s`` =
    sum), and the matching fractions of peak FLOP/s (``efficiency_*``).
    """
    import pandas as pd

    rows = []
    for strategy in ("dp", "fsdp", "tp"):
        costs = ffn_costs(strategy, phase)
        for n in devices:
            compute = as_float(costs["compute_time"], **values, N=n)
            comm = as_float(costs["comm_time"]["N"], **values, N=n)
            # overlapped: communication hides behind compute; serial: it waits for it (e.g. TP's gathers,
            # which the next matmul needs at once)
            rows.append(dict(strategy=strategy, devices=n, compute_s=compute, comm_s=comm,
                             comm_bound=comm > compute, step_overlapped_s=max(compute, comm),
                             step_serial_s=compute + comm, efficiency_overlapped=compute / max(compute, comm),
                             efficiency_serial=compute / (compute + comm)))
    return pd.DataFrame(rows)


def devices_needed(state_bytes, activation_bytes, capacity_bytes, activation_sharded_fraction=HALF):
    """Smallest integer N with :func:`fsdp_memory_per_device` <= ``capacity_bytes``; ``None`` if no N fits
    (the unsharded activations alone exceed the capacity)."""
    f = sp.nsimplify(activation_sharded_fraction)
    n = sp.Symbol("n", positive=True)
    unsharded = activation_bytes * (1 - f)
    if unsharded >= capacity_bytes:
        return None
    bound = sp.solve(sp.Eq(fsdp_memory_per_device(state_bytes, activation_bytes, n, f), capacity_bytes), n)[0]
    return max(1, math.ceil(float(bound) - 1e-9))


def xxl_memory(tokens: int, d_model: int = XXL["d_model"], d_ff: int = XXL["d_ff"],
               blocks: int = XXL["num_blocks"], state_bytes_per_param: int = 16, activation_bytes: int = 2,
               device_bytes: int = H100_MEMORY_BYTES) -> dict:
    """Memory of the FFN-only model: fp32 state (weights, grads, AdamW m, v: 16 B/param) and bf16 saved
    activations of ``tokens`` tokens; how many devices of ``device_bytes`` hold it all (bytes, counts)."""
    params = int(ffn_model_parameters(d_model, d_ff, blocks))
    per_token = int(ffn_saved_elements_per_token(d_model, d_ff)) * activation_bytes * blocks
    state = params * state_bytes_per_param
    act = per_token * tokens
    return dict(params=params, state_bytes=state, activation_bytes_per_token=per_token, tokens=tokens,
                activation_bytes=act, total_bytes=state + act,
                devices_to_hold=math.ceil((state + act) / device_bytes),
                devices_to_hold_state=math.ceil(state / device_bytes))


def fsdp_table(token_counts, capacity_bytes: int = TPU_V5P["memory_bytes"], devices=(16, 64, 128, 256),
               activation_sharded_fraction=HALF, **xxl_kwargs):
    """Per-device GB of the XXL model under FSDP, and the N needed for ``capacity_bytes``, per token count."""
    import pandas as pd

    rows = []
    for tokens in token_counts:
        m = xxl_memory(tokens, **xxl_kwargs)
        row = dict(tokens=tokens, state_gb=m["state_bytes"] / GB, activations_gb=m["activation_bytes"] / GB)
        for n in devices:
            row[f"per_device_gb_N{n}"] = float(fsdp_memory_per_device(
                m["state_bytes"], m["activation_bytes"], n, activation_sharded_fraction)) / GB
        row["devices_needed"] = devices_needed(m["state_bytes"], m["activation_bytes"], capacity_bytes,
                                               activation_sharded_fraction)
        rows.append(row)
    return pd.DataFrame(rows)


def tpu_batch_tricks(X_=16, Y_=4, M_X_=2, M_Y_=1, C_=TPU_V5P["C"], W_ici_=TPU_V5P["W_ici"],
                     F_=XXL["d_ff"]):
    """Smallest compute-bound total batch (tokens) of the FSDP x TP forward, and how tricks lower it.

    Each row: ``trick``, ``condition`` (LaTeX of the compute-bound inequality), ``batch_tokens`` (total),
    ``per_chip_tokens`` (batch over all X Y chips), ``note``. Large-X approximation as in the scaling book.
    """
    import pandas as pd

    base = {X: X_, Y: Y_, M_X: M_X_, M_Y: M_Y_, C: C_, W_ici: W_ici_, F: F_}
    n_chips = X_ * Y_
    p_w = sp.Symbol("p_w", positive=True)  # bytes per all-gathered weight element
    rows = []

    def add(trick, condition, b, note, chips=n_chips):
        rows.append(dict(trick=trick, condition=condition, batch_tokens=float(b), per_chip_tokens=float(b) / chips,
                         note=note))

    b0 = C * X / (W_ici * M_X)
    add("baseline: FSDP X, TP Y", r"\frac{B}{X} \ge \frac{C}{W_{ici} M_X}", b0.subs(base),
        f"X={X_}, Y={Y_}, M_X={M_X_}")
    # more TP on the same chips: X = N / Y, up to the TP limit Y <= 3 F M_Y W_ici / (2 C)
    y_max = math.floor(float((3 * F * M_Y * W_ici / (2 * C)).subs(base)))
    y_pow2 = 2 ** int(math.log2(y_max))
    add(f"more TP: Y={y_pow2} on the same {n_chips} chips",
        r"B \ge \frac{N C}{Y W_{ici} M_X},\quad Y \le \frac{3 F M_Y W_{ici}}{2 C}",
        (C * n_chips / (y_pow2 * W_ici * M_X)).subs(base), f"TP stays compute bound up to Y={y_max}")
    add("FSDP over all 3 ICI axes (M_X=3)", r"\frac{B}{X} \ge \frac{C}{W_{ici} M_X}",
        b0.subs({**base, M_X: 3}), "TP then shares links with FSDP")
    add("fp8 weight all-gather (p_w = 1 byte)", r"\frac{B}{X} \ge \frac{p_w}{2}\frac{C}{W_{ici} M_X}",
        (b0 * p_w / 2).subs({**base, p_w: 1}), "halves the bytes gathered per FLOP")
    # pipeline parallelism over P stages: only B x D activations cross a stage boundary
    add("pipeline stages instead of FSDP", r"\frac{6 B D F (L/P)}{C} \ge \frac{2 B D}{W_{ici}} "
        r"\iff \frac{L}{P} \ge \frac{C}{3 F W_{ici}}",
        float("nan"), "no weight traffic, so no batch bound from communication (one FFN stage holds "
        f"L/P >= {float((C / (3 * F * W_ici)).subs(base)):.3f} blocks); needs several microbatches in flight "
        "to hide the pipeline bubble")
    # gradient accumulation: every microbatch re-gathers the weights, so the bound is on the microbatch
    add("gradient accumulation (k microbatches)", r"\frac{B/k}{X} \ge \frac{C}{W_{ici} M_X}",
        b0.subs(base), "no help: each microbatch all-gathers the weights again, so the bound applies to "
        "B/k; keeping gathered weights instead costs the full weights on every chip")
    return pd.DataFrame(rows)


def predicted_vs_measured(lm_step=None, sharding=None, device_type: str = "cuda"):
    """Predicted peak memory next to the measured one for ``lm_step`` and ``sharding_benchmark`` rows.

    ``lm_step`` rows: the mode is the largest one timed (``step_ms`` -> train step, ``fwdbwd_ms`` ->
    forward+backward, else forward) since ``peak_gib`` covers the whole measurement; ``dtype`` bf16 means
    autocast. ``sharding`` rows: per-rank prediction with parameters, gradients and optimizer state divided
    by ``world_size`` where the implementation shards them (optimizer state for every implementation but
    ``ddp``; parameters and gradients too for ``fsdp`` and ``torch_fsdp2``, which hold gathered weights only
    for the two blocks in flight), activations of ``batch`` sequences per rank (``lab.bench.sharding``'s
    batch is per rank), compared with the largest of the measured peaks. Rows of unknown sizes are
    skipped. Returns a DataFrame with ``source``, the configuration, ``predicted_gib``, ``measured_gib``,
    ``ratio`` (measured / predicted) and the predicted parts.
    """
    import pandas as pd

    from lab.model.transformer import ModelConfig, config_for

    def cfg_of(row):
        attention = row.get("attention", "sdpa")
        attention = attention if isinstance(attention, str) else "sdpa"
        try:
            return config_for(str(row["size"]), context_length=int(row["context"]), attention=attention)
        except ValueError:
            if all(k in row and pd.notna(row[k]) for k in ("d_model", "d_ff", "num_layers", "num_heads")):
                return ModelConfig(d_model=int(row["d_model"]), d_ff=int(row["d_ff"]),
                                   num_layers=int(row["num_layers"]), num_heads=int(row["num_heads"]),
                                   context_length=int(row["context"]), attention=attention)
            return None

    rows = []
    if lm_step is not None:
        for _, r in lm_step.iterrows():
            cfg = cfg_of(r)
            if cfg is None or r.get("status", "ok") != "ok" or pd.isna(r.get("peak_gib")):
                continue
            mode = ("train_step" if pd.notna(r.get("step_ms")) else
                    "forward_backward" if pd.notna(r.get("fwdbwd_ms")) else "forward")
            prec = BENCH_DTYPE_TO_POLICY.get(str(r["dtype"]), "fp32")
            mem = training_memory(cfg, int(r["batch"]), int(r["context"]), prec, mode, device_type)
            rows.append(dict(source="lm_step", impl=mode, size=r["size"], context=int(r["context"]),
                             batch=int(r["batch"]), dtype=r["dtype"], world_size=1,
                             compile=bool(r.get("compile", False)), attention=cfg.attention,
                             measured_gib=float(r["peak_gib"]),
                             **{f"{k}_gib": v / GiB for k, v in mem.items()}))
    if sharding is not None:
        peak_cols = [c for c in ("peak_init_gib", "peak_before_step_gib", "peak_after_step_gib") if c in sharding]
        for _, r in sharding.iterrows():
            cfg = cfg_of(r)
            if cfg is None or r.get("status", "ok") != "ok" or not peak_cols:
                continue
            measured = r[peak_cols].astype(float).max()
            if pd.isna(measured):
                continue
            n = int(r["world_size"])
            prec = BENCH_DTYPE_TO_POLICY.get(str(r["dtype"]), "fp32")
            mem = training_memory(cfg, int(r["batch"]), int(r["context"]), prec, "train_step", device_type)
            impl = str(r["impl"])
            fully_sharded = impl in ("fsdp", "torch_fsdp2")
            if impl != "ddp":
                mem["optimizer"] /= n
            if fully_sharded:
                mem["params"] /= n
                mem["grads"] /= n
                # instead of a copy of every matrix, the gathered weights of the blocks in flight (FSDP
                # prefetches up to two ahead), in the compute dtype
                block = 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff
                mem["weight_copies"] = 2 * block * (2 if prec == "bf16_autocast" else 4)
            mem["total"] = sum(v for k, v in mem.items() if k != "total")
            rows.append(dict(source="sharding_benchmark", impl=impl, size=r["size"], context=int(r["context"]),
                             batch=int(r["batch"]), dtype=r["dtype"], world_size=n, compile=False,
                             attention=cfg.attention, measured_gib=float(measured),
                             **{f"{k}_gib": v / GiB for k, v in mem.items()}))
    out = pd.DataFrame(rows)
    if not out.empty:
        out = out.rename(columns={"total_gib": "predicted_gib"})
        out["ratio"] = out["measured_gib"] / out["predicted_gib"]
    return out


def saved_activations_check(configs: dict, batch: int, context: int,
                            precisions=("fp32", "bf16_autocast", "bf16"), attentions=("sdpa", "naive"),
                            seed: int = 0):
    """Measure on the CPU what autograd saves for one forward + loss and set it next to the prediction.

    ``configs`` maps a name to a ``ModelConfig``. The measurement is :func:`lab.measure.saved_tensors.saved_tensor_report`
    (every non-parameter storage once); the prediction is :func:`saved_activation_bytes` plus what that
    report also sees: autocast's bf16 weight copies and, in fp32/pure bf16, the RoPE tables (module buffers).
    Returns a DataFrame with ``config``, ``attention``, ``precision``, ``predicted_bytes``,
    ``measured_bytes`` and ``match``.
    """
    import dataclasses

    import pandas as pd
    import torch

    from lab.bench.lm import lm_loss
    from lab.model.transformer import TransformerLM
    from lab.measure.saved_tensors import saved_tensor_report

    rows = []
    for name, base in configs.items():
        for attention in attentions:
            cfg = dataclasses.replace(base, attention=attention, context_length=context)
            for prec in precisions:
                torch.manual_seed(seed)
                model = TransformerLM(cfg)
                if prec == "bf16":
                    model = model.to(torch.bfloat16)
                tokens = torch.randint(0, cfg.vocab_size, (batch, context))
                targets = torch.randint(0, cfg.vocab_size, (batch, context))
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16_autocast"):
                    report = saved_tensor_report(model, tokens, targets,
                                                 forward=lambda x, y, m=model: lm_loss(m, x, y))
                state = state_memory(cfg, prec)
                extra = state["weight_copies"] + (0 if prec == "bf16_autocast" else state["buffers"])
                predicted = saved_activation_bytes(cfg, batch, context, prec, device_type="cpu")["total"] + extra
                rows.append(dict(config=name, attention=attention, precision=prec, batch=batch, context=context,
                                 predicted_bytes=predicted, measured_bytes=report.total_bytes,
                                 match=predicted == report.total_bytes))
    return pd.DataFrame(rows)
