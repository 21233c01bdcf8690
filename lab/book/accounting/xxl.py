"""The 09 notebook's XXL questions, (a) to (d): the XXL FFN-only model's fp32 state and bf16 activations
against H100s, FSDP's device count for a 95 GB TPU v5p, the batch at which the FSDP x TP forward is compute
bound, and the tricks that lower that batch: its equations, tables displayed and sentences, from the tables of
:mod:`lab.book.accounting.bench`. The rest of the 09 notebook's presentation is :mod:`lab.book.accounting.present`.
"""

from __future__ import annotations

import math

import pandas as pd
import sympy as sp

from lab import accounting as acc
from lab.book.accounting.present import show_equation

QUESTION = 2  # the XXL question's FFN: two matrices, up and down


# ----------------------------------------------------------------------------------------------------------
# equations


def show_xxl_equations(matrices: int = QUESTION) -> list[str]:
    """The XXL model's parameters and the FSDP memory per device, symbolic (``matrices`` per FFN)."""
    state, act, n = sp.symbols("M_{state} M_{act} N", positive=True)
    return [show_equation(rf"P_{{XXL}}\ ({matrices}\ \mathrm{{matrices}})",
                          acc.ffn_model_parameters(matrices=matrices)),
            show_equation(r"\mathrm{saved\ elements\ per\ token\ and\ block}",
                          acc.ffn_saved_elements_per_token(matrices=matrices)),
            show_equation(r"M_{\mathrm{device}}(N)", acc.fsdp_memory_per_device(state, act, n))]


def show_tpu_equations(matrices: int = QUESTION) -> list[str]:
    """Per-chip forward times of one FFN under FSDP over X and TP over Y (the scaling book's mesh notation)
    and the compute-bound batch they imply."""
    t = acc.fsdp_tp_forward_times(exact=False, matrices=matrices)
    bound = acc.fsdp_tp_compute_bound_batch("overlapped", matrices=matrices)
    return [show_equation(r"T_{\mathrm{math}}", t["compute"]),
            show_equation(r"T_{\mathrm{FSDP}}\ (\text{all-gather of the weights over } X)", t["fsdp"]),
            show_equation(r"T_{\mathrm{TP}}\ (\text{all-gather} + \text{reduce-scatter of } (B/X) \times D"
                          r" \text{ over } Y)", t["tp"]),
            show_equation(r"B_{\min}", bound["B"]), show_equation(r"\frac{B_{\min}}{X}", bound["per_fsdp_shard"])]


# ----------------------------------------------------------------------------------------------------------
# tables and sentences


def _variant(df: pd.DataFrame, matrices: int) -> pd.DataFrame:
    return df[df["matrices"] == matrices]


def xxl_display(xxl: pd.DataFrame) -> pd.DataFrame:
    """The XXL memory table turned sideways: one row per quantity, one column per FFN variant."""
    labels = {"params": "parameters", "weights_gb": "fp32 master weights (GB)", "grads_gb": "fp32 gradients (GB)",
              "optimizer_gb": "fp32 AdamW m and v (GB)", "state_gb": "fp32 state in all (GB)",
              "devices_for_state": "H100s (80 GB) for the state", "activation_mb_per_token":
              "bf16 saved activations per token (MB)", "activations_gb": "bf16 saved activations of the tokens (GB)",
              "devices_for_all": "H100s for state + those activations"}
    out = xxl.set_index("ffn")[list(labels)].T
    out.index = [labels[k] + (f", {int(xxl['tokens'].iloc[0]):,} tokens" if k == "activations_gb" else "")
                 for k in out.index]
    out.columns.name = None
    return out.reset_index(names="quantity")


def xxl_sentence(xxl: pd.DataFrame) -> str:
    """Question (a) in words: fp32 state, bf16 activations and H100s, with the SwiGLU variant beside it."""
    q = _variant(xxl, QUESTION).iloc[0]
    out = (f"As the question poses it (126 blocks of two matrices, up and down), the XXL model has "
           f"{q['params'] / 1e9:.1f} B parameters. Its fp32 master weights, accumulated gradients and AdamW state "
           f"({q['weights_gb']:,.0f} + {q['grads_gb']:,.0f} + {q['optimizer_gb']:,.0f} GB) take "
           f"**{q['state_gb'] / 1e3:.2f} TB**, the memory of **{int(q['devices_for_state'])} H100s** (80 GB) "
           f"before a single activation is stored. Saved for the backward in bf16 are the inputs of both matrices, "
           f"**{q['activation_mb_per_token']:.1f} MB per token**: {q['activations_gb']:,.1f} GB for "
           f"{int(q['tokens']):,} tokens ({int(q['devices_for_all'])} H100s in all).")
    s = _variant(xxl, 3)
    if len(s):
        s = s.iloc[0]
        out += (f" With SwiGLU's three matrices the state is {s['state_gb'] / 1e3:.2f} TB "
                f"({int(s['devices_for_state'])} H100s) and the activations {s['activation_mb_per_token']:.1f} MB per "
                "token, since SwiGLU also saves its gate's output, SiLU of it and the product.")
    return out


def xxl_answer(xxl: pd.DataFrame) -> str:
    q = _variant(xxl, QUESTION).iloc[0]
    text = (f"{q['state_gb'] / 1e3:.2f} TB of fp32 state ({int(q['devices_for_state'])} H100s) and "
            f"{q['activation_mb_per_token']:.1f} MB of bf16 activations per token ({q['activations_gb']:,.1f} GB for "
            f"{int(q['tokens']):,} tokens, {int(q['devices_for_all'])} H100s in all)")
    swiglu = _variant(xxl, 3)
    if len(swiglu):
        text += f"; with SwiGLU {swiglu['state_gb'].iloc[0] / 1e3:.2f} TB of state"
    return text + "."


def fsdp_display(fsdp: pd.DataFrame) -> pd.DataFrame:
    """The FSDP table with token counts spelled out and "none fits" where no N is enough."""
    return fsdp.drop(columns=["matrices"]).assign(
        tokens=fsdp["tokens"].map("{:,}".format),
        devices_needed=fsdp["devices_needed"].map(lambda n: "none fits" if pd.isna(n) else f"{int(n):,}"))


def fsdp_sentence(fsdp: pd.DataFrame, capacity_gb: float = acc.TPU_V5P["memory_bytes"] / acc.GB) -> str:
    """Question (b) in words: N for the state alone and with each token count's activations."""
    parts = []
    for m in (QUESTION, 3):
        rows = _variant(fsdp, m).set_index("tokens")
        if rows.empty:
            continue
        state_n = rows["devices_needed"].iloc[0] if 0 in rows.index else math.nan
        lead = (f"With the question's two matrices, the state alone needs **N = {int(state_n)}**"
                if m == QUESTION else f"With SwiGLU, N = {int(state_n)} for the state")
        with_act = []
        for t, r in rows[rows.index > 0].iterrows():
            n = (f"N = {int(r['devices_needed'])}" if pd.notna(r["devices_needed"])
                 else f"none fits (the unsharded half alone is {r['activations_gb'] / 2:,.0f} GB)")
            with_act.append(f"{t:,} token{'s' * (t != 1)}: {n}")
        parts.append(f"{lead} to fit in {capacity_gb:.0f} GB per device; with the activations of "
                     + "; ".join(with_act))
    return ". ".join(parts) + "."


def fsdp_answer(fsdp: pd.DataFrame, tokens: int) -> str:
    rows = _variant(fsdp, QUESTION).set_index("tokens")
    state_n = int(rows.loc[0, "devices_needed"]) if 0 in rows.index else None
    at = rows.loc[tokens, "devices_needed"] if tokens in rows.index else math.nan
    return (r"$M(N) = M_{state}/N + M_{act}\,(1/(2N) + 1/2)$; "
            + (f"N = {state_n} for the state alone" if state_n else "")
            + (f", N = {int(at)} with {tokens:,} tokens of activations" if pd.notna(at) else "") + " (95 GB TPU v5p).")


def tpu_sentence(tpu: pd.DataFrame, mesh: dict) -> str:
    """Question (c) in words: the per-device and overall compute-bound batch, and TP's margin."""
    q = _variant(tpu, QUESTION).reset_index(drop=True)
    b, exact, added = q.iloc[0], q.iloc[1], q.iloc[2]
    chips = mesh["X"] * mesh["Y"]
    return (f"Each FSDP shard must see **B/X ≥ {b['per_fsdp_shard']:,.0f} tokens** per forward (the {mesh['Y']} TP "
            f"chips of a group share them: {b['per_chip']:,.0f} tokens per chip over all X·Y = {chips} chips), an "
            f"overall batch of **B ≥ {b['total']:,.0f} tokens**, about {b['total'] / 2048:.0f} sequences of 2048. "
            f"The bound does not depend on the FFN's shape: both the math and the weights gathered scale with "
            f"the matrices. With the exact ring factor it is {exact['total']:,.0f} tokens. TP over Y = {mesh['Y']} "
            f"is compute bound by a factor {b['tp_math_over_comm']:.1f} (up to Y = {b['tp_max_y']:.0f}); if the "
            f"FSDP and TP transfers could not run at the same time, the bound would rise to {added['total']:,.0f} "
            f"tokens ({_variant(tpu, 3).iloc[2]['total']:,.0f} with SwiGLU).")


def tpu_answer(tpu: pd.DataFrame) -> str:
    b = _variant(tpu, QUESTION).iloc[0]
    return (f"per device (FSDP shard) B/X ≥ {b['per_fsdp_shard']:,.0f} tokens ({b['per_chip']:,.0f} per chip); "
            f"overall B ≥ {b['total']:,.0f} tokens.")


def tricks_display(tricks: pd.DataFrame) -> pd.DataFrame:
    """The tricks table with its conditions as inline math."""
    return tricks.assign(condition="$" + tricks["condition"] + "$")


def tricks_sentence(tricks: pd.DataFrame) -> str:
    """Question (d) in words, from :func:`lab.accounting.tpu_batch_tricks`."""
    tr = tricks.set_index("trick")["batch_tokens"]
    return (f"Shifting chips from FSDP to TP lowers the compute-bound batch from {tr.iloc[0]:,.0f} to "
            f"{tr.iloc[1]:,.0f} tokens on the same chips; spreading FSDP over all three ICI axes gives "
            f"{tr.iloc[2]:,.0f}, and gathering fp8 weights {tr.iloc[3]:,.0f}. Pipeline stages remove the weight "
            "traffic altogether, at the price of a pipeline bubble that itself needs several microbatches to hide. "
            "Gradient accumulation leaves the bound where it is: each microbatch all-gathers the weights again. "
            "Overlapping the all-gather of layer $i+1$ with the math of layer $i$ (prefetch) is what makes the "
            "'hide behind compute' conditions the right ones at all.")


def tricks_answer(tricks: pd.DataFrame) -> str:
    tr = tricks.set_index("trick")["batch_tokens"]
    return (f"more TP on the same chips ({tr.iloc[1]:,.0f} tokens), FSDP over more ICI axes ({tr.iloc[2]:,.0f}), "
            f"fp8 weight gathers ({tr.iloc[3]:,.0f}), pipeline stages (no weight traffic); not gradient accumulation.")
