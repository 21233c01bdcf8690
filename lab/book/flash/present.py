"""Notebook 05's settings and its answers about correctness, the course's timing test and the model, as claims
(:mod:`lab.book.claims`); the grid's are in :mod:`lab.book.flash.grid` and :mod:`lab.book.flash.goals`.

Times measured on the CPU come from Triton's interpreter (``TRITON_INTERPRET=1``): their claims follow the same
rule, and say (:data:`INTERPRETED`) that such times show the code runs and nothing about a GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from lab.accounting.attention import DTYPES, PASSES, attention_flops
from lab.bench.attention_grid import Shape
from lab.book.claims import Claim, Measured, Observed, Value, Versus
from lab.book.flash import bench as fl
from lab.book.report import with_profile_defaults
from lab.measure.results import measured_on
from lab.measure.verdicts import MIN_SAMPLES, Summary

#: The full profile: one H100 (see the notebook's parameters for the quick one).
FULL = dict(check_impls=("triton", "triton_compiled_bwd", "pytorch_flash", "pytorch_naive", "sdpa", "sdpa_flash",
                         "sdpa_cudnn", "sdpa_efficient"),
            check_ds=(64, 80, 96, 128), check_seq=1024, shapes=fl.LM_SHAPES, dtypes=("bf16", "fp16"),
            pytorch_flash_max_seq=2048,
            fp32_seqs=(1024, 4096, 16384), fp32_ds=(64, 128), course_shape=(16, 16384, 64),
            course_compile=(True, False), lm_size="2.7B", lm_context=512, lm_batch=4, lm_dtype="bf16",
            lm_compile=(False, True), lm_warmup=2, lm_steps=7,
            impls=("triton", "sdpa", "sdpa_flash", "sdpa_cudnn", "pytorch_flash", "flex"), ceiling_n=8192)
#: The quick profile: tiny shapes, Triton interpreted on the CPU, no torch.compile (Inductor would dominate; so
#: no FlexAttention, which runs only compiled); 5 samples a timing, the fewest a verdict takes.
QUICK = dict(check_impls=("triton", "pytorch_flash", "pytorch_naive", "sdpa", "sdpa_flash", "sdpa_cudnn"),
             check_ds=(16, 80, 96), check_seq=64, shapes=(Shape(1, 2, 32, 16), Shape(2, 1, 32, 32, False)),
             dtypes=("bf16",),
             pytorch_flash_max_seq=64, fp32_seqs=(32, 64), fp32_ds=(16,), course_shape=(1, 64, 16),
             course_compile=(False,), lm_size="tiny", lm_context=32, lm_batch=2, lm_dtype="fp32", lm_compile=(False,),
             lm_warmup=1, lm_steps=5, impls=("triton", "sdpa", "sdpa_flash", "sdpa_cudnn", "pytorch_flash"),
             ceiling_n=256)
INTERPRETED = ("Measured with Triton interpreted on the CPU (`TRITON_INTERPRET=1`), which runs each kernel instance "
               "in Python: these times show that the code runs and say nothing about a GPU.")


@dataclass(frozen=True)
class Settings:
    """Notebook 05's knobs after the profile's defaults are filled in (:func:`settings`)."""

    quick: bool
    device: str
    check_impls: tuple
    check_ds: tuple
    check_dtypes: tuple
    check_seq: int
    impls: tuple
    shapes: tuple
    dtypes: tuple
    pytorch_flash_max_seq: int
    pytorch_flash_dtypes: tuple
    fp32_impls: tuple
    fp32_seqs: tuple
    fp32_ds: tuple
    warmup_ms: float
    rep_ms: float
    cpu_steps: int
    course_shape: tuple
    course_compile: tuple
    course_goal_ms: float
    lm_size: str
    lm_context: int
    lm_batch: int
    lm_dtype: str
    lm_compile: tuple
    lm_warmup: int
    lm_steps: int
    ceiling_n: int

    def __post_init__(self):
        # shapes may come from a parameters cell as lists [batch, heads, seq, d, causal]
        object.__setattr__(self, "shapes", tuple(s if isinstance(s, Shape) else Shape(*s) for s in self.shapes))

    @property
    def sweeps(self) -> dict:
        """The two sweeps of ``flash_benchmark``: LM-like shapes in 16-bit against every SDPA backend and the tiled
        PyTorch version, and the batch-1, one-head fp32 length sweep against naive PyTorch and SDPA."""
        return {"lm": dict(impls=self.impls, shapes=self.shapes, dtypes=self.dtypes, graph_max_seq=fl.GRAPH_MAX_SEQ,
                           skip=fl.skip_pytorch_flash(self.pytorch_flash_max_seq, self.pytorch_flash_dtypes)),
                "fp32": dict(impls=self.fp32_impls, dtypes=("fp32",),
                             shapes=[Shape(1, 1, s, d) for d in self.fp32_ds for s in self.fp32_seqs])}

    @property
    def lm_variants(self) -> list[dict]:
        """The LM's variants in measuring order: SDPA then FlashAttention-Triton, eager then compiled."""
        return [dict(attention=a, compile=c) for c in self.lm_compile for a in ("sdpa", "flash_triton")]

    def params(self) -> dict:
        """The knobs as a plain dict (the banner and the results' provenance)."""
        return {**asdict(self), "shapes": [list(asdict(s).values()) for s in self.shapes]}


def settings(quick: bool, device, **knobs) -> Settings:
    """The notebook's :class:`Settings`: ``knobs`` as given, None filled from :data:`QUICK` or :data:`FULL`."""
    return Settings(quick=quick, device=str(device), **with_profile_defaults(knobs, QUICK if quick else FULL))


def interpreted(df: pd.DataFrame) -> bool:
    """Whether the rows were measured on the CPU, Triton interpreted (:func:`lab.measure.results.measured_on`)."""
    return measured_on(df, default="cuda") == "cpu"


def fixed(label: str, value: float, unit: str = "ms") -> Measured:
    """A target known exactly (the course's goal): no spread, and as many samples as a verdict needs, so that the
    rule weighs the measured side's noise alone."""
    return Measured(label, Summary(float(value), 0.0, MIN_SAMPLES), unit)


# ----------------------------------------------------------------------------------------------------------
# Correctness


def correctness_summary(errors: pd.DataFrame, factor: float = 4.0) -> pd.DataFrame:
    """Per implementation and dtype: the head dims checked, the worst error of output and gradients against float64,
    and the worst ratio to naive PyTorch's error in the same dtype and d (its rounding, floored at one machine
    epsilon of the dtype). ``verdict``: ``"agrees"`` when every ratio is at most ``factor``, ``"too large"``
    otherwise, ``"not supported"`` where it ran at no d; ``unsupported_d``: the head dims it could not run."""
    errors = errors.assign(worst=errors[["out", "dq", "dk", "dv"]].max(axis=1))
    naive = errors[errors["impl"] == "pytorch_naive"].set_index(["dtype", "d"])["worst"]
    level = [max(naive.get((dt, d), 0.0), torch.finfo(DTYPES[dt]).eps) for dt, d in zip(errors["dtype"], errors["d"])]
    errors = errors.assign(ratio=errors["worst"] / np.asarray(level))
    rows = []
    for (impl, dtype), g in errors.groupby(["impl", "dtype"], sort=False):
        ran = g[g["status"] == "ok"]
        ratio = ran["ratio"].max() if len(ran) else math.nan
        rows.append(dict(impl=impl, dtype=dtype, ds=", ".join(str(int(d)) for d in ran["d"]),
                         worst_error=ran["worst"].max() if len(ran) else math.nan, ratio_to_naive=ratio,
                         verdict="not supported" if ran.empty else "agrees" if ratio <= factor else "too large",
                         unsupported_d=", ".join(str(int(d)) for d in g.loc[g["status"] != "ok", "d"])))
    return pd.DataFrame(rows)


def correctness_claim(summary: pd.DataFrame, factor: float = 4.0) -> Claim:
    """Whether every implementation agrees with float64 as closely as naive PyTorch in its dtype: the worst ratio
    to naive PyTorch's error, those beyond ``factor``, and where an implementation could not run."""
    question = "Is every implementation correct, head dims 80 and 96 included?"
    ran = summary[summary["verdict"] != "not supported"]
    if ran.empty:
        return Claim(question, (), "No implementation ran.")
    worst = ran.loc[ran["ratio_to_naive"].idxmax()]
    bad = ran[ran["verdict"] == "too large"]
    gaps = summary[summary["unsupported_d"] != ""]
    findings = [Value(Measured.value(f"the worst error as a multiple of naive PyTorch's ({worst['impl']}, "
                                     f"{worst['dtype']})", worst["ratio_to_naive"], "x")),
                Observed(f"beyond {factor:g}x naive PyTorch's error", ", ".join(bad["impl"] + " " + bad["dtype"])
                         or "none")]
    if len(gaps):
        findings.append(Observed("not supported here (the table's notes say why)", "; ".join(
            f"{r.impl} {r.dtype}" + (f" at d {r.unsupported_d}" if r.ds else "") for r in gaps.itertuples())))
    because = ("Each error is set against naive PyTorch's own in the same dtype and head dimension, the dtype's "
               "rounding." if bad.empty else "")
    return Claim(question, tuple(findings), because)


def flops_example(seqs=(1024, 8192), d: int = 64) -> pd.DataFrame:
    """GFLOP per pass for one sequence of each length, full and causal (the count every TFLOP/s uses)."""
    return pd.DataFrame([dict(seq_len=s, d=d, causal=c, **{f"{p}_gflop": attention_flops(1, s, d, c, p) / 1e9
                                                           for p in PASSES}) for s in seqs for c in (False, True)])


# ----------------------------------------------------------------------------------------------------------
# The course's timing test


def course_claim(course: pd.DataFrame, bench: pd.DataFrame, goal_ms: float = fl.COURSE_GOAL_MS) -> Claim:
    """The course's test against its goal, which is set for an H100: a goal there, a pointer (the ratio without a
    goal) on another GPU, the times alone on the CPU; then the same work in the grid, SDPA's default backend
    against Triton, and the time the goal allows as a multiple of SDPA's."""
    gpu = str(course["gpu"].iloc[0]) if len(course) else "cpu"
    goal = fixed("the course's goal", goal_ms)
    findings = []
    for _, r in course.iterrows():
        m = Measured.from_row(f"{'compiled' if r['compiled'] else 'eager'} forward + backward", r, "fwdbwd_ms")
        findings.append(Value(m) if gpu == "cpu" else Versus(m, goal, goal=1.0 if "H100" in gpu else None))
    if len(course):
        c = course.iloc[0]
        same = bench[(bench["sweep"] == "lm") & (bench["status"] == "ok") & (bench["dtype"] == "bf16")
                     & bench["causal"].astype(bool) & (bench["batch"] * bench["heads"] == int(c["batch"]))
                     & (bench["seq_len"] == int(c["seq_len"])) & (bench["d"] == int(c["d"]))]
        rows = same.drop_duplicates("impl", keep="last").set_index("impl")
        if {"triton", "sdpa"} <= set(rows.index):
            findings += [Versus(Measured.from_row("Triton on the same work in the grid", rows.loc["triton"], "e2e_ms"),
                                Measured.from_row("SDPA's default backend", rows.loc["sdpa"], "e2e_ms")),
                         Value(Measured.value("the time the goal allows, as a multiple of SDPA's", goal_ms /
                                              rows.loc["sdpa", "e2e_ms"], "x"))]
    because = (INTERPRETED + " The goal, set for an H100, is not evaluated." if gpu == "cpu" else "" if "H100" in gpu
               else "The goal is set for an H100, so on this GPU the ratio is a pointer, not a pass or fail.")
    return Claim(f"Does the course's timing test meet {goal_ms:g} ms?", tuple(findings), because)


# ----------------------------------------------------------------------------------------------------------
# The language model


def lm_claim(lm: pd.DataFrame) -> Claim:
    """The train step with FlashAttention-Triton against SDPA, eagerly and compiled, and what compiling did to each
    (a variant that did not run says so)."""
    r0 = lm.iloc[0]
    rows = {(r["attention"], bool(r["compile"])): r for _, r in lm.iterrows()}

    def step(attention, compiled):
        return Measured.from_row(f"the {'compiled' if compiled else 'eager'} step with {attention}",
                                 rows[attention, compiled], "step_ms")

    findings = [Versus(step("flash_triton", c), step("sdpa", c)) for c in (False, True)
                if ("flash_triton", c) in rows and ("sdpa", c) in rows]
    findings += [Versus(step(a, True), step(a, False)) for a in ("sdpa", "flash_triton")
                 if (a, True) in rows and (a, False) in rows]
    # lab.bench.lm keeps fp32 parameters and runs a 16-bit dtype as autocast: not the bf16 parameters of 10's step
    because = INTERPRETED if interpreted(lm) else (
        "" if r0["dtype"] == "fp32" else "The step keeps fp32 parameters under 16-bit autocast.")
    return Claim(f"Does FlashAttention-Triton speed up the {r0['size']} train step (batch {int(r0['batch'])}, context "
                 f"{int(r0['context'])})?", tuple(findings), because)
