"""The closed forms of :mod:`lab.accounting` against measurements: what autograd saves for a forward + loss,
counted on the CPU tensor by tensor (:func:`saved_activations_check`), and the peak memory of measured
training steps, ``lm_step`` and ``sharding_benchmark`` rows, next to their prediction
(:func:`predicted_vs_measured`).
"""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import torch

from lab.accounting import BENCH_DTYPE_TO_POLICY, saved_activation_bytes, state_memory, training_memory
from lab.measure.saved_tensors import saved_tensor_report
from lab.measure.step import MODES, lm_loss, mode_columns
from lab.model.transformer import ModelConfig, TransformerLM, config_for
from lab.units import GiB


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
    state divided by ``world_size`` where the implementation shards them (optimizer state for every
    implementation but ``ddp``; parameters and gradients too for ``fsdp`` and ``torch_fsdp2``, which hold
    gathered weights only for the two blocks in flight), activations of ``batch`` sequences per rank (the
    sharding benchmark's batch is per rank), compared with the largest of the measured peaks. Rows of unknown
    sizes are skipped. Returns a DataFrame with ``table`` (which results table the row comes from), the ``gpu``
    and ``commit`` that measured the row (where it names them), the configuration, ``predicted_gib``,
    ``measured_gib``, ``ratio`` (measured / predicted) and the predicted parts.
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
                rows.append(dict(table="lm_step", gpu=r.get("gpu"), commit=r.get("commit"), impl=mode, size=r["size"],
                                 context=int(r["context"]),
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
            rows.append(dict(table="sharding_benchmark", gpu=r.get("gpu"), commit=r.get("commit"), impl=impl,
                             size=r["size"], context=int(r["context"]),
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
