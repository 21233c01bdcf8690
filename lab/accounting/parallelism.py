"""Parallelizing one feed-forward network, and the XXL FFN-only model on TPU v5p (the scaling book's
notation): FLOPs and communication per device under DP, FSDP, TP and FSDP x TP, the largest device count
before communication dominates, FSDP memory per device, and the compute-bound batch.

The FFN is either the question's two matrices (up D x F, down F x D, no activation function, as the
course's XXL question poses it: ``matrices=2``, the default) or SwiGLU's three (w1, w3: D x F; w2: F x D;
``matrices=3``), which the book's own model uses.
"""

from __future__ import annotations

import math

import sympy as sp

from lab.accounting.collectives import ring_fraction
from lab.accounting.symbols import GB, HALF, M_X, M_Y, W_X, W_Y, B, C, D, F, L, N, W, W_ici, X, Y, as_float, p

STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")
PHASES = ("forward", "train")


def _ring(n, exact: bool):
    """The (n-1)/n factor of a ring collective (:func:`lab.accounting.collectives.ring_fraction`), or 1 in
    the large-n approximation."""
    return ring_fraction(n) if exact else 1


def _check_matrices(matrices: int) -> None:
    if matrices not in (2, 3):
        raise ValueError(f"matrices must be 2 (up and down, the XXL question) or 3 (SwiGLU), got {matrices!r}")


def ffn_costs(strategy: str, phase: str = "train", exact: bool = True, B=B, D=D, F=F, N=N, X=X, Y=Y,
              C=C, W=W, W_X=W_X, W_Y=W_Y, p=p, matrices: int = 2) -> dict:
    """FLOPs, bytes and times per device of one FFN of ``matrices`` D x F matrices (2: up and down, as the
    XXL question poses it; 3: SwiGLU) under a parallelism ``strategy``.

    Strategies (``N`` devices; ``X * Y`` for ``fsdp_tp``):

    * ``dp``: weights replicated, tokens split; training all-reduces the ``m D F`` gradients.
    * ``fsdp``: tokens split, weights sharded; all-gather the weights before forward (and again before
      backward), reduce-scatter the gradients.
    * ``tp``: Megatron-style with sequence-sharded activations: the up projection(s) split by columns, the
      down projection by rows;
      all-gather the B x D input, reduce-scatter the B x D output (backward: the mirror pair).
    * ``fsdp_tp``: FSDP over X devices (bandwidth ``W_X``) on weights already split Y ways by TP over Y
      devices (bandwidth ``W_Y``, on B/X tokens).

    ``phase`` is ``forward`` (FLOPs ``2 m B D F``) or ``train`` (forward + backward, ``6 m B D F``). ``p`` is bytes per
    communicated element. ``exact=False`` drops the (n-1)/n ring factors (the large-n approximation).
    Returns a dict of sympy expressions: ``flops`` and ``compute_time`` per device, ``comm_bytes`` and
    ``comm_time`` per mesh axis (dicts keyed ``"N"`` or ``"X"``/``"Y"``).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    train = phase == "train"
    _check_matrices(matrices)
    weights = matrices * D * F * p  # bytes of the FFN's matrices
    total_flops = (3 if train else 1) * 2 * matrices * B * D * F
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
                matrices: int = 2, **values):
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
    costs = ffn_costs(strategy, phase, exact, matrices=matrices)
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


def ffn_model_parameters(d_model=D, d_ff=F, blocks=L, matrices: int = 2):
    """Parameters of an FFN-only model: ``matrices`` D x F matrices per block (2 as the XXL question poses
    it: up and down; 3 for SwiGLU), nothing else."""
    _check_matrices(matrices)
    return matrices * d_model * d_ff * blocks


def ffn_saved_elements_per_token(d_model=D, d_ff=F, matrices: int = 2):
    """Elements one FFN block saves for backward per token.

    Two matrices with no activation function (the XXL question: "each FFN is simply two linear layers"):
    the input of each, ``D + F``. SwiGLU (``matrices=3``): the input x (D, shared by w1 and w3), w1's output
    (for SiLU's backward), SiLU of it and w3's output (for the product), and the product (w2's input):
    ``D + 4 F``.
    """
    _check_matrices(matrices)
    return d_model + (d_ff if matrices == 2 else 4 * d_ff)


def fsdp_memory_per_device(state_bytes, activation_bytes, n, activation_sharded_fraction=HALF):
    """Bytes per device when all state and a fraction of the activations are sharded over ``n`` devices.

    ``state_bytes / n + activation_bytes * (fraction / n + 1 - fraction)``: the sharded activations are
    the ones of every other layer in practice (fraction 1/2)."""
    f = activation_sharded_fraction
    return state_bytes / n + activation_bytes * (f / n + 1 - f)


def fsdp_tp_forward_times(exact: bool = False, matrices: int = 2):
    """Forward times of one FFN under FSDP over X and TP over Y, in the scaling book's mesh notation.

    The FSDP axis spans ``M_X`` ICI axes and the TP axis ``M_Y`` (bandwidth ``M W_ici`` each); bf16
    communication (p = 2). Returns ``compute``, ``fsdp`` and ``tp`` times as sympy expressions.
    """
    costs = ffn_costs("fsdp_tp", "forward", exact, p=2, W_X=M_X * W_ici, W_Y=M_Y * W_ici, matrices=matrices)
    return dict(compute=costs["compute_time"], fsdp=costs["comm_time"]["X"], tp=costs["comm_time"]["Y"])


def fsdp_tp_compute_bound_batch(network: str = "overlapped", exact: bool = False, matrices: int = 2):
    """The smallest total batch ``B`` (tokens) at which the FSDP x TP forward of one FFN is compute bound.

    ``overlapped``: the FSDP all-gather over X and the TP collectives over Y each take no longer than the
    compute (``B / X >= C / (W_ici M_X)`` in the large-X limit) -- the TP condition does not involve B
    and is returned separately as ``tp_ok`` (a sympy relation). ``shared``: their times add. Returns a dict
    with ``B`` (expression in X, Y, C, W_ici, M_X, M_Y, F, and D where it enters), ``per_fsdp_shard`` = B/X
    and ``per_chip`` = B/(X Y).
    """
    t = fsdp_tp_forward_times(exact, matrices)
    if network == "overlapped":
        b = sp.solve(sp.Eq(t["compute"], t["fsdp"]), B)[0]
    elif network == "shared":
        b = sp.solve(sp.Eq(t["compute"], t["fsdp"] + t["tp"]), B)[0]
    else:
        raise ValueError(f"network must be 'overlapped' or 'shared', got {network!r}")
    b = sp.simplify(b)
    tp_ok = sp.simplify(t["compute"] / t["tp"]) >= 1
    return dict(B=b, per_fsdp_shard=sp.simplify(b / X), per_chip=sp.simplify(b / (X * Y)), tp_ok=tp_ok)



def ffn_strategy_table(devices, phase: str = "train", matrices: int = 2, **values):
    """Compute and communication time per device of one FFN for DP, FSDP and TP at each device count.

    ``values`` gives ``B``, ``D``, ``F``, ``C``, ``W``, ``p``. Returns a DataFrame with ``strategy``,
    ``devices``, ``compute_s``, ``comm_s``, ``comm_bound`` (comm > compute), the step time when
    communication overlaps compute (``step_overlapped_s`` = max) and when it does not (``step_serial_s`` =
    sum), and the matching fractions of peak FLOP/s (``efficiency_*``).
    """
    import pandas as pd

    rows = []
    for strategy in ("dp", "fsdp", "tp"):
        costs = ffn_costs(strategy, phase, matrices=matrices)
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
               device_bytes: int = H100_MEMORY_BYTES, matrices: int = 2) -> dict:
    """Memory of the FFN-only model: fp32 state (weights, grads, AdamW m, v: 16 B/param) and bf16 saved
    activations of ``tokens`` tokens; how many devices of ``device_bytes`` hold it all (bytes, counts)."""
    params = int(ffn_model_parameters(d_model, d_ff, blocks, matrices))
    per_token = int(ffn_saved_elements_per_token(d_model, d_ff, matrices)) * activation_bytes * blocks
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
                     F_=XXL["d_ff"], matrices: int = 2):
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
    # more TP on the same chips: X = N / Y, up to the TP limit where compute 2 m B D F / (X Y C) meets the
    # TP collectives 4 B D / (X M_Y W_ici): Y <= m F M_Y W_ici / (2 C) (m matrices: F M_Y W_ici / C for two)
    _check_matrices(matrices)
    tp_limit = matrices * F * M_Y * W_ici / (2 * C)
    y_max = math.floor(float(tp_limit.subs(base)))
    y_pow2 = 2 ** int(math.log2(y_max))
    add(f"more TP: Y={y_pow2} on the same {n_chips} chips",
        r"B \ge \frac{N C}{Y W_{ici} M_X},\quad Y \le " + sp.latex(tp_limit),
        (C * n_chips / (y_pow2 * W_ici * M_X)).subs(base), f"TP stays compute bound up to Y={y_max}")
    add("FSDP over all 3 ICI axes (M_X=3)", r"\frac{B}{X} \ge \frac{C}{W_{ici} M_X}",
        b0.subs({**base, M_X: 3}), "TP then shares links with FSDP")
    add("fp8 weight all-gather (p_w = 1 byte)", r"\frac{B}{X} \ge \frac{p_w}{2}\frac{C}{W_{ici} M_X}",
        (b0 * p_w / 2).subs({**base, p_w: 1}), "halves the bytes gathered per FLOP")
    # pipeline parallelism over P stages: only B x D activations cross a stage boundary
    stage_blocks = C / (matrices * F * W_ici)
    add("pipeline stages instead of FSDP", rf"\frac{{{2 * matrices} B D F (L/P)}}{{C}} \ge \frac{{2 B D}}{{W_{{ici}}}} "
        r"\iff \frac{L}{P} \ge " + sp.latex(stage_blocks),
        float("nan"), "no weight traffic, so no batch bound from communication (one FFN stage holds "
        f"L/P >= {float(stage_blocks.subs(base)):.3f} blocks); needs several microbatches in flight "
        "to hide the pipeline bubble")
    # gradient accumulation: every microbatch re-gathers the weights, so the bound is on the microbatch
    add("gradient accumulation (k microbatches)", r"\frac{B/k}{X} \ge \frac{C}{W_{ici} M_X}",
        b0.subs(base), "no help: each microbatch all-gathers the weights again, so the bound applies to "
        "B/k; keeping gathered weights instead costs the full weights on every chip")
    return pd.DataFrame(rows)


