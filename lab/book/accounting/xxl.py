"""The 09 notebook's XXL questions, (a) to (d), from the tables of :mod:`lab.accounting.xxl`: the XXL FFN-only
model's fp32 state and bf16 activations against H100s, FSDP's device count for a 95 GB TPU v5p, the batch at
which the FSDP x TP forward is compute bound, and the tricks that lower it; equations, displays and claims.
"""

from __future__ import annotations

import sympy as sp

from lab import accounting as acc
from lab.book.accounting.present import show_equation, value
from lab.book.claims import Claim, Observed, number, plural

QUESTION = 2  # the XXL question's FFN: two matrices, up and down


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


def xxl_display(xxl):
    """The XXL memory table turned sideways: one row per quantity, one column per FFN variant."""
    labels = {"params": "parameters", "weights_gb": "fp32 master weights (GB)", "grads_gb": "fp32 gradients (GB)",
              "optimizer_gb": "fp32 AdamW m and v (GB)", "state_gb": "fp32 state in all (GB)",
              "devices_for_state": "H100s (80 GB) for the state", "activation_mb_per_token":
              "bf16 saved activations per token (MB)", "activations_gb": "bf16 saved activations of the tokens (GB)",
              "devices_for_all": "H100s for state + those activations"}
    out = xxl.set_index("ffn")[list(labels)].T.astype(float)
    out.index = [labels[k] for k in out.index]
    out.columns.name = None
    return out.reset_index(names="quantity")


def _row(df, matrices: int, i: int = 0):  # the i-th row of one FFN variant
    return df[df["matrices"] == matrices].iloc[i]


def xxl_claim(xxl) -> Claim:
    """Question (a): fp32 state, bf16 activations and H100s, with the SwiGLU variant beside it."""
    q, s = _row(xxl, QUESTION), _row(xxl, 3)
    return Claim("XXL (a): fp32 state, bf16 activations, H100s?", [
        value("parameters", q["params"] / 1e9, "billion"), value("fp32 weights, gradients and AdamW state",
                                                                q["state_gb"] / 1e3, "TB"),
        value("H100s (80 GB) for the state alone", q["devices_for_state"]),
        value("bf16 saved activations per token", q["activation_mb_per_token"], "MB"),
        value(f"for {plural(int(q['tokens']), 'token')}", q["activations_gb"], "GB"),
        value("H100s in all", q["devices_for_all"]), value("with SwiGLU, the state", s["state_gb"] / 1e3, "TB"),
        value("its activations per token", s["activation_mb_per_token"], "MB")],
        "The question's blocks save the inputs of both matrices; SwiGLU also saves its gate's output, SiLU of it "
        "and their product.")


def fsdp_display(fsdp):
    """The FSDP table with "none fits" where no N is enough."""
    return fsdp.drop(columns=["matrices"]).assign(devices_needed=fsdp["devices_needed"].map(
        lambda n: "none fits" if n != n or n is None else number(n)))


def fsdp_claim(fsdp) -> Claim:
    """Question (b): the N of 95 GB devices for the state alone and with each token count's activations."""
    findings = []
    for m, name in ((QUESTION, "the question's FFN"), (3, "SwiGLU")):
        for _, r in fsdp[fsdp["matrices"] == m].iterrows():
            label = f"{name}, " + (plural(int(r["tokens"]), "token") if r["tokens"] else "the state alone")
            findings.append(value(label, r["devices_needed"], "devices") if r["devices_needed"] == r["devices_needed"]
                            else Observed(label, "no N fits: the unsharded half of the activations is too large"))
    return Claim("XXL (b): how many 95 GB devices does FSDP need?", findings,
                 "M(N) = M_state / N + M_act (1/(2N) + 1/2): the state and half the activations are sharded.")


def tpu_claim(tpu, mesh: dict) -> Claim:
    """Question (c): the per-device and overall compute-bound batch, the exact ring factor, TP's margin and
    the bound when the FSDP and TP transfers cannot overlap."""
    b, exact, added = (_row(tpu, QUESTION, i) for i in range(3))
    return Claim("XXL (c): at what per-device and overall batch is the forward compute bound?", [
        value("per FSDP shard, B/X at least", b["per_fsdp_shard"], "tokens"),
        value(f"per chip of the {mesh['X'] * mesh['Y']}", b["per_chip"], "tokens"),
        value("overall, B at least", b["total"], "tokens"),
        value("with the exact ring factor", exact["total"], "tokens"),
        value(f"TP's math over its communication at Y = {mesh['Y']}", b["tp_math_over_comm"], "x"),
        value("TP stays compute bound up to Y", b["tp_max_y"]),
        value("if the FSDP and TP transfers cannot overlap", added["total"], "tokens"),
        value("the same with SwiGLU", _row(tpu, 3, 2)["total"], "tokens")],
        "The bound does not depend on the FFN's shape: the math and the weights gathered both scale with the "
        "matrices.")


def tricks_claim(tricks) -> Claim:
    """Question (d): the compute-bound batch each trick reaches, from :func:`lab.accounting.tpu_batch_tricks`."""
    rows = tricks.dropna(subset=["batch_tokens"])
    return Claim("XXL (d): which tricks keep throughput at a smaller batch?", [
        value(r["trick"], r["batch_tokens"], "tokens") for _, r in rows.iterrows()],
        "Pipeline stages remove the weight traffic altogether, at the price of a bubble that needs several "
        "microbatches to hide; gradient accumulation leaves the bound where it is, since each microbatch gathers "
        "the weights again. Prefetching layer i+1's weights during layer i's math is what makes hiding behind "
        "compute possible at all.")
