"""The course's questions about the XXL FFN-only model (d_model 16,384, d_ff 53,248, 126 blocks) as tables, for
both FFN variants (2: the question's up and down matrices; 3: SwiGLU): its memory against H100s, FSDP's device
count for a 95 GB TPU v5p, the batch at which its FSDP x TP forward is compute bound on TPU v5p and the tricks
that lower it, and the largest device count before communication dominates one such FFN on GPUs.
"""

from __future__ import annotations

import math

import pandas as pd
import sympy as sp

from lab.accounting import parallelism as par
from lab.accounting import symbols as sym

__all__ = ["FFN_VARIANTS", "TPU_MESH", "xxl_table", "xxl_fsdp_table", "tpu_values", "tpu_batch_table",
           "tpu_tricks_table", "ffn_limits_table", "ffn_sweep_table"]

#: The two FFNs of the XXL question: as posed (two matrices, up and down, no activation) and SwiGLU's three.
FFN_VARIANTS = {2: "2 matrices (the question)", 3: "SwiGLU (3 matrices)"}
#: The question's TPU v5p mesh: FSDP over X = 16 chips on M_X = 2 axes, TP over Y = 4 chips on M_Y = 1 axis.
TPU_MESH = dict(X=16, Y=4, M_X=2, M_Y=1)


def xxl_table(tokens: int, variants=(2, 3), device_bytes: int = par.H100_MEMORY_BYTES) -> pd.DataFrame:
    """Memory of the XXL model (d_model 16,384, d_ff 53,248, 126 blocks) for each FFN variant (2: the
    question's up and down matrices; 3: SwiGLU): fp32 master weights, accumulated gradients and AdamW state
    (GB, decimal), bf16 saved activations per token (MB) and for ``tokens`` tokens (GB), and how many devices
    of ``device_bytes`` (H100: 80 GB) hold the state alone and with those activations. One row per variant."""
    rows = []
    for m in variants:
        x = par.xxl_memory(tokens, matrices=m, device_bytes=device_bytes)
        p = x["params"]
        rows.append(dict(ffn=FFN_VARIANTS[m], matrices=m, params=p, weights_gb=4 * p / sym.GB,
                         grads_gb=4 * p / sym.GB, optimizer_gb=8 * p / sym.GB, state_gb=x["state_bytes"] / sym.GB,
                         devices_for_state=x["devices_to_hold_state"],
                         activation_mb_per_token=x["activation_bytes_per_token"] / 1e6, tokens=tokens,
                         activations_gb=x["activation_bytes"] / sym.GB, devices_for_all=x["devices_to_hold"]))
    return pd.DataFrame(rows)


def xxl_fsdp_table(token_counts, variants=(2, 3), capacity_bytes: int = par.TPU_V5P["memory_bytes"],
                   devices=(16, 64, 128, 256)) -> pd.DataFrame:
    """:func:`lab.accounting.fsdp_table` for each FFN variant: per-device GB with the state and half the
    activations sharded over N devices, and the N needed for ``capacity_bytes`` (TPU v5p: 95 GB), for each
    token count; with ``ffn`` and ``matrices`` columns."""
    parts = [par.fsdp_table(token_counts, capacity_bytes, devices, matrices=m).assign(ffn=FFN_VARIANTS[m], matrices=m)
             for m in variants]
    df = pd.concat(parts, ignore_index=True)
    return df[["ffn", "matrices"] + [c for c in df.columns if c not in ("ffn", "matrices")]]


def tpu_values(X=TPU_MESH["X"], Y=TPU_MESH["Y"], M_X=TPU_MESH["M_X"], M_Y=TPU_MESH["M_Y"]) -> dict:
    """Symbol -> number for the question's TPU v5p mesh and the XXL FFN's sizes."""
    return {sym.X: X, sym.Y: Y, sym.M_X: M_X, sym.M_Y: M_Y, sym.C: par.TPU_V5P["C"], sym.W_ici: par.TPU_V5P["W_ici"],
            sym.F: par.XXL["d_ff"], sym.D: par.XXL["d_model"]}


def tpu_batch_table(variants=(2, 3), **mesh) -> pd.DataFrame:
    """The smallest batch (tokens) at which the XXL FFN forward under FSDP x TP is compute bound on TPU v5p,
    per FFN variant and case: the scaling book's large-X approximation, the exact ring factor (X-1)/X, and
    FSDP and TP transfers that cannot overlap (their times add). Columns ``ffn``, ``matrices``, ``case``,
    ``per_fsdp_shard`` (B/X), ``per_chip`` (B/(X Y)), ``total`` (B), and ``tp_math_over_comm`` (TP's compute
    time over its communication time, >= 1 when TP is compute bound; it does not depend on B) and ``tp_max_y``
    (the largest compute-bound TP degree)."""
    values = tpu_values(**mesh)
    rows = []
    for m in variants:
        t = par.fsdp_tp_forward_times(exact=False, matrices=m)
        tp_ratio = float(sp.simplify(t["compute"] / t["tp"]).subs(values))
        tp_max_y = float((m * sym.F * sym.M_Y * sym.W_ici / (2 * sym.C)).subs(values))
        for case, network, exact in (("large X: (X-1)/X = 1", "overlapped", False),
                                     ("exact ring factor (X-1)/X", "overlapped", True),
                                     ("FSDP and TP times added", "shared", False)):
            b = par.fsdp_tp_compute_bound_batch(network, exact=exact, matrices=m)
            rows.append(dict(ffn=FFN_VARIANTS[m], matrices=m, case=case,
                             per_fsdp_shard=float(b["per_fsdp_shard"].subs(values)),
                             per_chip=float(b["per_chip"].subs(values)), total=float(b["B"].subs(values)),
                             tp_math_over_comm=tp_ratio, tp_max_y=tp_max_y))
    return pd.DataFrame(rows)


def tpu_tricks_table(matrices: int = 2, **mesh) -> pd.DataFrame:
    """:func:`lab.accounting.tpu_batch_tricks` on the question's mesh (``X``, ``Y``, ``M_X``, ``M_Y`` override
    :data:`TPU_MESH`) for the question's two-matrix FFN."""
    m = {**TPU_MESH, **mesh}
    return par.tpu_batch_tricks(X_=m["X"], Y_=m["Y"], M_X_=m["M_X"], M_Y_=m["M_Y"], matrices=matrices)


def ffn_limits_table(tokens: int, flops: float, bandwidth: float, matrices: int = 3, d_model: int = par.XXL["d_model"],
                     d_ff: int = par.XXL["d_ff"], bytes_per_element: int = 2) -> pd.DataFrame:
    """The largest device count before communication dominates one FFN (``matrices`` 3: SwiGLU) of ``tokens``
    tokens on devices of ``flops`` FLOP/s and ``bandwidth`` bytes/s per link, for DP, FSDP and TP (either
    network) and FSDP x TP (separate links per axis, ``overlapped``, or one ``shared`` link), forward and
    training. Columns ``strategy``, ``phase``, ``network``, ``max_devices``, ``X``, ``Y``."""
    values = dict(B=tokens, D=d_model, F=d_ff, C=flops, W=bandwidth, W_X=bandwidth, W_Y=bandwidth, p=bytes_per_element)
    rows = []
    for strategy in ("dp", "fsdp", "tp"):
        for phase in par.PHASES:
            rows.append(dict(strategy=strategy, phase=phase, network="either", max_devices=float(
                par.max_devices(strategy, phase, matrices=matrices, **values)), X=math.nan, Y=math.nan))
    for network in ("overlapped", "shared"):
        for phase in par.PHASES:
            lim = par.max_devices("fsdp_tp", phase, network, matrices=matrices, **values)
            rows.append(dict(strategy="fsdp_tp", phase=phase, network=network, max_devices=float(lim["N"]),
                             X=float(lim["X"]), Y=float(lim["Y"])))
    return pd.DataFrame(rows)


def ffn_sweep_table(tokens: int, flops: float, bandwidth: float, devices=tuple(2**k for k in range(1, 11)),
                    matrices: int = 3, d_model: int = par.XXL["d_model"], d_ff: int = par.XXL["d_ff"],
                    bytes_per_element: int = 2) -> pd.DataFrame:
    """:func:`lab.accounting.ffn_strategy_table` (training) of the same FFN at each device count."""
    return par.ffn_strategy_table(list(devices), "train", matrices=matrices, B=tokens, D=d_model, F=d_ff, C=flops,
                                  W=bandwidth, p=bytes_per_element)


