"""The 09 notebook's tables: closed forms of :mod:`lab.accounting` evaluated for the book's models, the XXL
FFN-only model (the question's two matrices beside SwiGLU's three) and TPU v5p, and set against measurements:
peak memory of measured training steps (``lm_step`` and ``sharding_benchmark`` rows) and the bytes autograd
really saves.
"""

from __future__ import annotations

import math

import pandas as pd
import sympy as sp

from lab import accounting as acc
from lab.accounting import BENCH_DTYPE_TO_POLICY, saved_activation_bytes, state_memory, training_memory
from lab.measure.saved_tensors import saved_tensor_report
from lab.measure.step import MODES, lm_loss, mode_columns
from lab.model.transformer import MODEL_SIZES, ModelConfig, TransformerLM, config_for
from lab.units import GiB

#: The two FFNs of the XXL question: as posed (two matrices, up and down, no activation) and SwiGLU's three.
FFN_VARIANTS = {2: "2 matrices (the question)", 3: "SwiGLU (3 matrices)"}
#: The question's TPU v5p mesh: FSDP over X = 16 chips on M_X = 2 axes, TP over Y = 4 chips on M_Y = 1 axis.
TPU_MESH = dict(X=16, Y=4, M_X=2, M_Y=1)


def size_configs(sizes=None, context: int = 512) -> dict:
    """``{name: ModelConfig}`` of the named sizes (default: every size in the spec) at ``context``."""
    return {s: config_for(s, context_length=context) for s in (sizes or list(MODEL_SIZES))}


# ----------------------------------------------------------------------------------------------------------
# the XXL FFN-only model


def xxl_table(tokens: int, variants=(2, 3), device_bytes: int = acc.H100_MEMORY_BYTES) -> pd.DataFrame:
    """Memory of the XXL model (d_model 16,384, d_ff 53,248, 126 blocks) for each FFN variant (2: the
    question's up and down matrices; 3: SwiGLU): fp32 master weights, accumulated gradients and AdamW state
    (GB, decimal), bf16 saved activations per token (MB) and for ``tokens`` tokens (GB), and how many devices
    of ``device_bytes`` (H100: 80 GB) hold the state alone and with those activations. One row per variant."""
    rows = []
    for m in variants:
        x = acc.xxl_memory(tokens, matrices=m, device_bytes=device_bytes)
        p = x["params"]
        rows.append(dict(ffn=FFN_VARIANTS[m], matrices=m, params=p, weights_gb=4 * p / acc.GB,
                         grads_gb=4 * p / acc.GB, optimizer_gb=8 * p / acc.GB, state_gb=x["state_bytes"] / acc.GB,
                         devices_for_state=x["devices_to_hold_state"],
                         activation_mb_per_token=x["activation_bytes_per_token"] / 1e6, tokens=tokens,
                         activations_gb=x["activation_bytes"] / acc.GB, devices_for_all=x["devices_to_hold"]))
    return pd.DataFrame(rows)


def xxl_fsdp_table(token_counts, variants=(2, 3), capacity_bytes: int = acc.TPU_V5P["memory_bytes"],
                   devices=(16, 64, 128, 256)) -> pd.DataFrame:
    """:func:`lab.accounting.fsdp_table` for each FFN variant: per-device GB with the state and half the
    activations sharded over N devices, and the N needed for ``capacity_bytes`` (TPU v5p: 95 GB), for each
    token count; with ``ffn`` and ``matrices`` columns."""
    parts = [acc.fsdp_table(token_counts, capacity_bytes, devices, matrices=m).assign(ffn=FFN_VARIANTS[m], matrices=m)
             for m in variants]
    df = pd.concat(parts, ignore_index=True)
    return df[["ffn", "matrices"] + [c for c in df.columns if c not in ("ffn", "matrices")]]


def tpu_values(X=TPU_MESH["X"], Y=TPU_MESH["Y"], M_X=TPU_MESH["M_X"], M_Y=TPU_MESH["M_Y"]) -> dict:
    """Symbol -> number for the question's TPU v5p mesh and the XXL FFN's sizes."""
    return {acc.X: X, acc.Y: Y, acc.M_X: M_X, acc.M_Y: M_Y, acc.C: acc.TPU_V5P["C"], acc.W_ici: acc.TPU_V5P["W_ici"],
            acc.F: acc.XXL["d_ff"], acc.D: acc.XXL["d_model"]}


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
        t = acc.fsdp_tp_forward_times(exact=False, matrices=m)
        tp_ratio = float(sp.simplify(t["compute"] / t["tp"]).subs(values))
        tp_max_y = float((m * acc.F * acc.M_Y * acc.W_ici / (2 * acc.C)).subs(values))
        for case, network, exact in (("large X: (X-1)/X = 1", "overlapped", False),
                                     ("exact ring factor (X-1)/X", "overlapped", True),
                                     ("FSDP and TP times added", "shared", False)):
            b = acc.fsdp_tp_compute_bound_batch(network, exact=exact, matrices=m)
            rows.append(dict(ffn=FFN_VARIANTS[m], matrices=m, case=case,
                             per_fsdp_shard=float(b["per_fsdp_shard"].subs(values)),
                             per_chip=float(b["per_chip"].subs(values)), total=float(b["B"].subs(values)),
                             tp_math_over_comm=tp_ratio, tp_max_y=tp_max_y))
    return pd.DataFrame(rows)


def tpu_tricks_table(matrices: int = 2, **mesh) -> pd.DataFrame:
    """:func:`lab.accounting.tpu_batch_tricks` on the question's mesh (``X``, ``Y``, ``M_X``, ``M_Y`` override
    :data:`TPU_MESH`) for the question's two-matrix FFN."""
    m = {**TPU_MESH, **mesh}
    return acc.tpu_batch_tricks(X_=m["X"], Y_=m["Y"], M_X_=m["M_X"], M_Y_=m["M_Y"], matrices=matrices)


# ----------------------------------------------------------------------------------------------------------
# one FFN under DP, FSDP, TP and 2-D


def ffn_limits_table(tokens: int, flops: float, bandwidth: float, matrices: int = 3, d_model: int = acc.XXL["d_model"],
                     d_ff: int = acc.XXL["d_ff"], bytes_per_element: int = 2) -> pd.DataFrame:
    """The largest device count before communication dominates one FFN (``matrices`` 3: SwiGLU) of ``tokens``
    tokens on devices of ``flops`` FLOP/s and ``bandwidth`` bytes/s per link, for DP, FSDP and TP (either
    network) and FSDP x TP (separate links per axis, ``overlapped``, or one ``shared`` link), forward and
    training. Columns ``strategy``, ``phase``, ``network``, ``max_devices``, ``X``, ``Y``."""
    values = dict(B=tokens, D=d_model, F=d_ff, C=flops, W=bandwidth, W_X=bandwidth, W_Y=bandwidth, p=bytes_per_element)
    rows = []
    for strategy in ("dp", "fsdp", "tp"):
        for phase in acc.PHASES:
            rows.append(dict(strategy=strategy, phase=phase, network="either", max_devices=float(
                acc.max_devices(strategy, phase, matrices=matrices, **values)), X=math.nan, Y=math.nan))
    for network in ("overlapped", "shared"):
        for phase in acc.PHASES:
            lim = acc.max_devices("fsdp_tp", phase, network, matrices=matrices, **values)
            rows.append(dict(strategy="fsdp_tp", phase=phase, network=network, max_devices=float(lim["N"]),
                             X=float(lim["X"]), Y=float(lim["Y"])))
    return pd.DataFrame(rows)


def ffn_sweep_table(tokens: int, flops: float, bandwidth: float, devices=tuple(2**k for k in range(1, 11)),
                    matrices: int = 3, d_model: int = acc.XXL["d_model"], d_ff: int = acc.XXL["d_ff"],
                    bytes_per_element: int = 2) -> pd.DataFrame:
    """:func:`lab.accounting.ffn_strategy_table` (training) of the same FFN at each device count."""
    return acc.ffn_strategy_table(list(devices), "train", matrices=matrices, B=tokens, D=d_model, F=d_ff, C=flops,
                                  W=bandwidth, p=bytes_per_element)


# ----------------------------------------------------------------------------------------------------------
# predictions against measurements


def _flag(value) -> bool:
    """A boolean column read back from CSV (NaN, a missing value, is False)."""
    return False if value is None or (isinstance(value, float) and math.isnan(value)) else bool(value)


PARTS = ("params", "grads", "optimizer", "weight_copies", "activations")


def predicted_vs_measured(lm_step=None, sharding=None, device_type: str = "cuda"):
    """Predicted peak memory next to the measured one for ``lm_step`` and ``sharding_benchmark`` rows.

    ``lm_step`` rows: one comparison per measured mode (``fwd``, ``fwdbwd``, ``step``), the prediction for
    that mode against the peak measured in the same steps as its time (``<mode>_peak_gib``); ``dtype`` bf16
    means autocast. Their prediction is the block-by-block peak (:func:`lab.accounting.step_peak_bytes`):
    the benchmark drops the gradients before each forward. ``sharding`` rows: the sum of the parts (the
    wrappers' gradient buffers live through the step), per rank, with parameters, gradients and optimizer
    state divided by ``world_size`` where the implementation shards them (optimizer state for every implementation but
    ``ddp``; parameters and gradients too for ``fsdp`` and ``torch_fsdp2``, which hold gathered weights only
    for the two blocks in flight), activations of ``batch`` sequences per rank (``lab.book.sharding.bench``'s
    batch is per rank), compared with the largest of the measured peaks. Rows of unknown sizes are
    skipped. Returns a DataFrame with ``table`` (which results table the row comes from), the configuration,
    ``predicted_gib``, ``measured_gib``, ``ratio`` (measured / predicted) and the predicted parts.
    """
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
            if cfg is None:
                continue
            prec = BENCH_DTYPE_TO_POLICY.get(str(r["dtype"]), "fp32")
            # one comparison per measured mode, each against that mode's own peak (same measurement)
            for mode, col in zip(MODES, mode_columns(MODES)):
                peak = r.get(f"{col}_peak_gib")
                if peak is None or pd.isna(peak) or pd.isna(r.get(f"{col}_ms")):
                    continue
                mem = training_memory(cfg, int(r["batch"]), int(r["context"]), prec, mode, device_type)
                rows.append(dict(table="lm_step", impl=mode, size=r["size"], context=int(r["context"]),
                                 batch=int(r["batch"]), dtype=r["dtype"], world_size=1,
                                 compile=_flag(r.get("compile")), attention=cfg.attention,
                                 measured_gib=float(peak), predicted_gib=mem["peak"] / GiB,
                                 **{f"{k}_gib": mem[k] / GiB for k in PARTS}))
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
            rows.append(dict(table="sharding_benchmark", impl=impl, size=r["size"], context=int(r["context"]),
                             batch=int(r["batch"]), dtype=r["dtype"], world_size=n, compile=False,
                             attention=cfg.attention, measured_gib=float(measured),
                             predicted_gib=sum(mem[k] for k in PARTS) / GiB,
                             **{f"{k}_gib": mem[k] / GiB for k in PARTS}))
    out = pd.DataFrame(rows)
    if not out.empty:
        out["ratio"] = out["measured_gib"] / out["predicted_gib"]
    return out


def saved_activations_check(configs: dict, batch: int, context: int,
                            precisions=("fp32", "bf16_autocast", "bf16"), attentions=("sdpa", "naive"),
                            seed: int = 0):
    """Measure on the CPU what autograd saves for one forward + loss and set it next to the prediction.

    ``configs`` maps a name to a ``ModelConfig``. The measurement is
    :func:`lab.measure.saved_tensors.saved_tensor_report` (every non-parameter storage once); the prediction
    is :func:`saved_activation_bytes` plus what that report also sees: autocast's bf16 weight copies and, in
    fp32/pure bf16, the RoPE tables (module buffers). Returns a DataFrame with ``config``, ``attention``,
    ``precision``, ``predicted_bytes``, ``measured_bytes`` and ``match``.
    """
    import dataclasses

    import torch


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
