"""Notebook 05's settings, tables, plots and prose: FlashAttention-2 in Triton against PyTorch.

Here: the settings of each profile, the interpreter's caveat, correctness against float64, the FLOP count,
the course's timing test and the model with FlashAttention (tables ``flash_correctness``,
``flash_course_timing``, ``lm_step``); the grid (``flash_benchmark``: latency, speedups, TFLOP/s, the goals,
the fp32 sweep) is presented by :mod:`lab.book.flash.grid`. Every sentence is built from this render's
tables; every "faster"/"slower", "goal met"/"missed" comes from :mod:`lab.measure.verdicts` on the measured
spread. Times measured on the CPU come from Triton's interpreter (``TRITON_INTERPRET=1``): they show that
the code runs, and every sentence built from them says so instead of claiming a speedup.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch

from lab.accounting.attention import DTYPES, PASSES, attention_flops
from lab.book.flash import bench as fl
from lab.book.flash import goals as gl
from lab.book.flash.sweep import PRODUCTS, backward_breakdown, matmul_ceiling
from lab.book.report import fmt, warn, with_profile_defaults
from lab.measure.results import measured_on
from lab.measure.verdicts import GoalCheck, compare_summaries, span

# ----------------------------------------------------------------------------------------------------------
# Settings


#: The full profile: one H100 in about four minutes (see the notebook's parameters for the quick one).
FULL = dict(check_impls=("triton", "triton_compiled_bwd", "pytorch_flash", "pytorch_naive", "sdpa", "sdpa_flash",
                         "sdpa_cudnn", "sdpa_efficient"),
            check_ds=(64, 80, 96, 128), check_seq=1024, shapes=tuple(fl.LM_SHAPES), pytorch_flash_max_seq=2048,
            fp32_seqs=(1024, 4096, 16384), fp32_ds=(64, 128), course_shape=(16, 16384, 64),
            course_compile=(True, False), lm_size="2.7B", lm_context=512, lm_batch=4, lm_dtype="bf16",
            lm_compile=(False, True), lm_warmup=2, lm_steps=5,
            impls=("triton", "sdpa", "sdpa_flash", "sdpa_cudnn", "pytorch_flash", "flex"), ceiling_n=8192)
#: The quick profile: tiny shapes, Triton interpreted on the CPU, no torch.compile (inductor would dominate; so
#: no FlexAttention, which runs only compiled).
QUICK = dict(check_impls=("triton", "pytorch_flash", "pytorch_naive", "sdpa", "sdpa_flash", "sdpa_cudnn"),
             check_ds=(16, 80, 96), check_seq=64, shapes=(fl.Shape(1, 2, 64, 16), fl.Shape(2, 1, 64, 32, False)),
             pytorch_flash_max_seq=64, fp32_seqs=(64, 128), fp32_ds=(16,), course_shape=(1, 64, 16),
             course_compile=(False,), lm_size="tiny", lm_context=32, lm_batch=2, lm_dtype="fp32", lm_compile=(False,),
             lm_warmup=1, lm_steps=2, impls=("triton", "sdpa", "sdpa_flash", "sdpa_cudnn", "pytorch_flash"),
             ceiling_n=256)


@dataclass(frozen=True)
class Settings:
    """Notebook 05's knobs after the profile's defaults are filled in (see :func:`settings`)."""

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
        object.__setattr__(self, "shapes", tuple(s if isinstance(s, fl.Shape) else fl.Shape(*s) for s in self.shapes))

    @property
    def sweeps(self) -> dict:
        """The two sweeps of ``flash_benchmark``: LM-like shapes in bf16/fp16 against every SDPA backend and the
        tiled PyTorch version, and the batch-1 fp32 length sweep against naive PyTorch and SDPA."""
        return {"lm": dict(impls=self.impls, shapes=self.shapes, dtypes=self.dtypes,
                           skip=fl.skip_pytorch_flash(self.pytorch_flash_max_seq, self.pytorch_flash_dtypes),
                           graph_max_seq=fl.GRAPH_MAX_SEQ, min_samples=fl.MIN_SAMPLES),
                "fp32": dict(impls=self.fp32_impls, shapes=fl.grid_shapes(self.fp32_seqs, self.fp32_ds),
                             dtypes=("fp32",))}

    @property
    def lm_variants(self) -> list[dict]:
        """The LM's variants in measuring order: SDPA then FlashAttention-Triton, eager then compiled."""
        return [dict(attention=a, compile=c) for c in self.lm_compile for a in ("sdpa", "flash_triton")]

    def params(self) -> dict:
        """The knobs as a plain dict (the banner and the results' provenance)."""
        out = asdict(self)
        out["shapes"] = [list(asdict(s).values()) for s in self.shapes]
        return out


def settings(quick: bool, device, **knobs) -> Settings:
    """The notebook's :class:`Settings`: ``knobs`` as given, None filled from :data:`QUICK` or :data:`FULL`."""
    return Settings(quick=quick, device=str(device), **with_profile_defaults(knobs, QUICK if quick else FULL))


def interpreted(df: pd.DataFrame) -> bool:
    """True when the rows were measured on the CPU (Triton interpreted), read from the rows
    (:func:`lab.measure.results.measured_on`); such times say nothing about a GPU."""
    return measured_on(df, default="cuda") == "cpu"


INTERPRETED_NOTE = ("These times were measured on the CPU with Triton's interpreter (`TRITON_INTERPRET=1`), which "
                    "runs each kernel instance in Python: they show that the code runs end to end, and say nothing "
                    "about speed on a GPU. No speedup is claimed from them.")
#: What each sentence built from interpreted times says instead of a claim.
INTERPRETED_SHORT = ("Measured with Triton interpreted on the CPU: these times say nothing about a GPU, so no claim is "
                     "made.")


def warn_if_interpreted(df: pd.DataFrame) -> bool:
    """Show :data:`INTERPRETED_NOTE` as a warning when ``df`` was measured on the CPU; returns whether it was."""

    if interpreted(df):
        warn(INTERPRETED_NOTE)
        return True
    return False


# ----------------------------------------------------------------------------------------------------------
# Correctness


def correctness_summary(errors: pd.DataFrame, factor: float = 4.0) -> pd.DataFrame:
    """Per implementation and dtype: the head dims checked, the worst error of output and gradients against
    float64, and the worst ratio to naive PyTorch's error in the same dtype and d (its rounding level, floored
    at one machine epsilon of the dtype). ``verdict``: ``"agrees"`` when every ratio is at most ``factor``,
    ``"too large"`` otherwise, ``"not supported"`` where it ran at no d; ``unsupported_d`` lists the head
    dims it could not run."""
    errors = errors.copy()
    errors["worst"] = errors[["out", "dq", "dk", "dv"]].max(axis=1)
    naive = errors[errors["impl"] == "pytorch_naive"].set_index(["dtype", "d"])["worst"]
    floor = errors["dtype"].map(lambda dt: torch.finfo(DTYPES[dt]).eps)
    level = [max(naive.get((dt, d), 0.0), f) for dt, d, f in zip(errors["dtype"], errors["d"], floor)]
    errors["ratio"] = errors["worst"] / np.asarray(level)
    rows = []
    for (impl, dtype), g in errors.groupby(["impl", "dtype"], sort=False):
        ran = g[g["status"] == "ok"]
        unsupported = [int(d) for d in g.loc[g["status"] != "ok", "d"]]
        ratio = ran["ratio"].max() if len(ran) else math.nan
        verdict = "not supported" if ran.empty else ("agrees" if ratio <= factor else "too large")
        rows.append(dict(impl=impl, dtype=dtype, ds=", ".join(str(int(d)) for d in ran["d"]),
                         worst_error=ran["worst"].max() if len(ran) else math.nan, ratio_to_naive=ratio,
                         verdict=verdict, unsupported_d=", ".join(map(str, unsupported))))
    return pd.DataFrame(rows)


def correctness_sentence(summary: pd.DataFrame, factor: float = 4.0) -> str:
    """Whether every implementation agrees with float64 to its dtype's rounding, which do not, and which
    could not run some head dims (and why, from the notes of the errors table)."""
    ran = summary[summary["verdict"] != "not supported"]
    bad = ran[ran["verdict"] == "too large"]
    if ran.empty:
        return "No implementation ran."
    if bad.empty:
        worst = ran.loc[ran["ratio_to_naive"].idxmax()]
        text = (f"Every implementation that ran agrees with float64 as closely as naive PyTorch in the same dtype "
                f"(within {factor:g}x its error): the worst is {worst['impl']} in {worst['dtype']} at "
                f"{fmt(worst['ratio_to_naive'], 2)}x (largest error {fmt(worst['worst_error'], 2)}).")
    else:
        text = "Errors beyond the dtype's rounding (more than " + f"{factor:g}x naive PyTorch's): " + "; ".join(
            f"{r.impl} {r.dtype} {fmt(r.ratio_to_naive)}x ({fmt(r.worst_error, 2)})" for r in bad.itertuples()) + "."
    gaps = summary[summary["unsupported_d"] != ""]
    if len(gaps):
        text += " Not supported here: " + "; ".join(
            f"{r.impl} {r.dtype}" + (f" at d = {r.unsupported_d}" if r.ds else "") for r in gaps.itertuples()) + \
            " (see the `note` column)."
    return text


def flops_example(seqs=(1024, 8192), d: int = 64) -> pd.DataFrame:
    """GFLOP per pass for one sequence of each length, full and causal (the count every TFLOP/s uses)."""
    return pd.DataFrame([dict(seq_len=s, d=d, causal=c, **{f"{p}_gflop": attention_flops(1, s, d, c, p) / 1e9
                                                           for p in PASSES})
                         for s in seqs for c in (False, True)])


# ----------------------------------------------------------------------------------------------------------
# The course's timing test


def course_goal(row: pd.Series, goal_ms: float = fl.COURSE_GOAL_MS) -> GoalCheck:
    """``mean ms <= goal_ms`` decided within the measured spread of the timing (the goal has none)."""
    n = int(row.get("n", 0) or 0)
    return GoalCheck(compare_summaries(row["mean_ms"], row["std_ms"], n, goal_ms, 0.0, 2), 1.0)


def _goal_word(row: pd.Series, goal_ms: float) -> str:
    """The course goal's verdict for a row: met / missed / undecided on an H100 (the card the goal is set
    for); on another GPU only which side of the H100 goal the time falls, a pointer and not a verdict; not
    evaluated on the CPU."""
    if _on_cpu(row):
        return "not evaluated (CPU)"
    word = course_goal(row, goal_ms).word
    if _on_goal_card(row.get("gpu", "")):
        return word
    return {"met": "under the H100 goal (pointer only)", "missed": "over the H100 goal (pointer only)"}.get(
        word, f"{word} against the H100 goal (pointer only)")


def course_table(course: pd.DataFrame, goal_ms: float = fl.COURSE_GOAL_MS) -> pd.DataFrame:
    """The timing test's rows with the goal's verdict (met / missed / undecided on an H100, a pointer on another
    GPU, not evaluated on the CPU)."""
    words = [_goal_word(r, goal_ms) for _, r in course.iterrows()]
    cols = ["compiled", "batch", "seq_len", "d", "dtype", "ms", "std_ms", "n", "gpu"]
    return course[[c for c in cols if c in course.columns]].assign(goal_ms=goal_ms, goal=words)


def _on_goal_card(gpu) -> bool:
    """Whether ``gpu`` (a device name) is the card the course's goal is set for."""
    return "H100" in str(gpu)


def _on_cpu(row: pd.Series) -> bool:
    return str(row.get("gpu", "cpu")).lower() in ("cpu", "nan")


def course_sentence(course: pd.DataFrame, goal_ms: float = fl.COURSE_GOAL_MS) -> str:
    """The course test's times against its H100 goal, saying which device ran them and whether the goal
    applies there."""
    if course.empty:
        return "The timing test did not run."
    gpu = str(course["gpu"].iloc[0]) if "gpu" in course.columns else "unknown"
    r0 = course.iloc[0]
    shape = f"{int(r0['batch'])} x {int(r0['seq_len'])} x {int(r0['d'])}, bf16, causal"
    times = "; ".join(f"{'compiled' if bool(r['compiled']) else 'eager'} {fmt(r['ms'])} ms (± {fmt(r['std_ms'], 2)}, "
                      f"{int(r['n'])} samples)" for _, r in course.iterrows())
    if gpu.lower() in ("cpu", "nan"):
        return (f"Forward + backward at {shape} on the CPU: {times}. " + INTERPRETED_SHORT +
                f" The course's goal ({goal_ms:g} ms at 16 x 16384 x 64 on an H100) is not evaluated.")
    def verdict(r):
        check = course_goal(r, goal_ms)
        c = check.comparison
        spread = (f"95% interval {span(c.low, c.high)}" if math.isfinite(c.low) else "no spread measured")
        return (f"{'compiled' if bool(r['compiled']) else 'eager'} {c.ratio:.3g}x the goal ({spread}): "
                f"{_goal_word(r, goal_ms)}")

    verdicts = "; ".join(verdict(r) for _, r in course.iterrows())
    if _on_goal_card(gpu):
        where = f"It ran on an {gpu}, the GPU the goal is set for, so the goal applies"
    else:
        where = (f"It ran on {gpu}, not an H100, and the goal is set for an H100, so what follows is only a "
                 "pointer, not a pass or fail")
    return f"Forward + backward at {shape}: {times}. {where}. Against {goal_ms:g} ms: {verdicts}."


# ----------------------------------------------------------------------------------------------------------
# The language model


def _versus_row(row: pd.Series, ref: pd.DataFrame, mode: str) -> tuple[float, str]:
    if ref.empty:
        return math.nan, ""
    e = ref.iloc[0]
    c = compare_summaries(row[f"{mode}_ms"], row[f"{mode}_std_ms"], int(row["steps"]), e[f"{mode}_ms"],
                          e[f"{mode}_std_ms"], int(e["steps"]))
    return c.speedup, c.verdict


def lm_versus(lm: pd.DataFrame, mode: str = "step") -> pd.DataFrame:
    """One row per LM variant: its mean ``mode`` time (ms) and peak (GiB); against SDPA with the same
    ``compile`` setting (``speedup_vs_sdpa`` = SDPA / this, > 1: faster) and, when compiled, against its own
    eager run (``speedup_vs_eager``), each with its verdict (``compare_summaries`` over the timed steps).
    A variant that did not run is a row whose ``verdict_vs_sdpa`` is its status; interpreted (CPU) rows get
    no verdicts."""
    ok = lm[lm["status"] == "ok"].assign(compile=lambda x: x["compile"].astype(bool))
    claims = not interpreted(lm)
    rows = []
    for _, r in ok.iterrows():
        sdpa = ok[(ok["attention"] == "sdpa") & (ok["compile"] == r["compile"])]
        eager = ok[(ok["attention"] == r["attention"]) & ~ok["compile"]]
        vs_sdpa = _versus_row(r, sdpa if r["attention"] != "sdpa" else sdpa.iloc[0:0], mode)
        vs_eager = _versus_row(r, eager if r["compile"] else eager.iloc[0:0], mode)
        rows.append(dict(attention=r["attention"], compile=r["compile"], ms=r[f"{mode}_ms"],
                         std_ms=r[f"{mode}_std_ms"], peak_gib=r.get(f"{mode}_peak_gib", math.nan),
                         speedup_vs_sdpa=vs_sdpa[0], verdict_vs_sdpa=vs_sdpa[1] if claims else "",
                         speedup_vs_eager=vs_eager[0], verdict_vs_eager=vs_eager[1] if claims else ""))
    for _, r in lm[lm["status"] != "ok"].iterrows():
        rows.append(dict(attention=r["attention"], compile=bool(r["compile"]), ms=math.nan,
                         verdict_vs_sdpa=r["status"]))
    return pd.DataFrame(rows, columns=["attention", "compile", "ms", "std_ms", "peak_gib", "speedup_vs_sdpa",
                                       "verdict_vs_sdpa", "speedup_vs_eager", "verdict_vs_eager"])


def lm_sentence(lm: pd.DataFrame, versus: pd.DataFrame) -> str:
    """The train step with FlashAttention-Triton against SDPA, eager and compiled, with verdicts, and what
    compiling did to each (on the CPU: the times and the interpreter caveat, no claim)."""
    if lm.empty:
        return "The model was not measured."
    r0 = lm.iloc[0]
    # lab.bench.lm keeps fp32 parameters and runs a 16-bit dtype as autocast: not the bf16 parameters of 10's step
    precision = r0["dtype"] if r0["dtype"] == "fp32" else f"fp32 parameters under {r0['dtype']} autocast"
    where = f"{r0['size']} train step (batch {int(r0['batch'])}, context {int(r0['context'])}, {precision})"
    ran = versus[versus["ms"].notna()]
    flash = ran[ran["attention"] == "flash_triton"]
    if flash.empty:
        return f"{where}: FlashAttention-Triton did not run (see the table)."
    sdpa = ran[ran["attention"] == "sdpa"].set_index("compile")["ms"]
    claims = not interpreted(lm)
    words = {"faster": "faster than SDPA", "slower": "slower than SDPA", "within noise": "within noise of SDPA"}
    parts = []
    for _, r in flash.iterrows():
        reference = fmt(sdpa.get(r["compile"], math.nan), 4)
        clause = f"{'compiled' if r['compile'] else 'eager'} {fmt(r['ms'], 4)} ms vs SDPA {reference} ms"
        if claims and r["verdict_vs_sdpa"]:
            clause += f" ({fmt(r['speedup_vs_sdpa'])}x, {words[r['verdict_vs_sdpa']]})"
        parts.append(clause)
    text = f"{where} with FlashAttention-Triton: " + "; ".join(parts) + "."
    compiled = ran[ran["verdict_vs_eager"].astype(str) != ""]
    if claims and len(compiled):
        text += " Compiling the model: " + "; ".join(
            f"{r['attention']} {fmt(r['speedup_vs_eager'])}x ({r['verdict_vs_eager']})" for _, r in compiled.iterrows()
        ) + " (eager time / compiled time)."
    if not claims:
        text += " " + INTERPRETED_SHORT
    failed = lm[lm["status"] != "ok"]
    if len(failed):
        text += " Did not run: " + ", ".join(f"{r['attention']}{' compiled' if bool(r['compile']) else ''} "
                                              f"({r['status']})" for _, r in failed.iterrows()) + "."
    return text


# ----------------------------------------------------------------------------------------------------------
# Where the backward's time goes


def matmul_ceilings(dtypes, n: int, device) -> pd.DataFrame:
    """The tensor-core rate a kernel's matrix products can hope for: one ``n x n x n`` ``torch.mm`` per dtype
    (:func:`lab.book.flash.sweep.matmul_ceiling`), columns ``dtype``, ``n``, ``tflops``."""
    return pd.DataFrame([dict(dtype=dt, n=n, tflops=matmul_ceiling(dt, n=n, device=device)) for dt in dtypes])


def backward_table(bench: pd.DataFrame, ceilings: pd.DataFrame, sweep: str = "lm") -> pd.DataFrame:
    """Triton's backward on each shape of ``sweep``: the launch mode the default config chose (``bwd_mode``),
    matrix products per tile pair, the useful rate (FlashAttention-2's 5-product count), the executed rate (the
    products really issued, on power-of-two ``BLOCK_D`` tiles) and its share of the dtype's measured matmul
    ceiling (:func:`lab.book.flash.sweep.backward_breakdown`). Rows without a time or a mode are left out."""
    cols = ["shape", "dtype", "bwd_mode", "products", "bwd_ms", "useful_tflops", "executed_tflops", "ceiling_tflops",
            "of_ceiling"]
    ceiling = ceilings.set_index("dtype")["tflops"].to_dict() if len(ceilings) else {}
    rows = []
    sel = bench[(bench["sweep"] == sweep) & (bench["impl"] == "triton") & (bench["status"] == "ok")]
    for _, r in sel.iterrows():
        mode = r.get("bwd_mode")
        if not isinstance(mode, str) or mode not in PRODUCTS or not r["bwd_ms"] > 0:
            continue
        shape = fl.Shape.of(r)
        top = ceiling.get(r["dtype"], math.nan)
        parts = backward_breakdown(shape, float(r["bwd_ms"]), mode, top, fl.kernel_columns(r, "bwd"))
        rows.append(dict(shape=shape.label, dtype=r["dtype"], bwd_mode=mode, bwd_ms=r["bwd_ms"], ceiling_tflops=top,
                         **parts))
    return pd.DataFrame(rows, columns=cols)


def backward_sentence(table: pd.DataFrame, interpreted_: bool = False) -> str:
    """The range of the executed backward rate as a share of the matmul ceiling, with the products per tile
    pair of the modes that ran (on the CPU: no claim)."""
    if table.empty:
        return "No Triton backward was timed."
    if interpreted_:
        return f"{len(table)} backward times measured. " + INTERPRETED_SHORT
    share = table["of_ceiling"].dropna()
    modes = ", ".join(f"{m} ({PRODUCTS[m]} products per tile pair)" for m in table["bwd_mode"].unique())
    if share.empty:
        return f"Backward launch modes: {modes}; no matmul ceiling was measured."
    return (f"Triton's backward issued its matrix products at {_span(100 * share, 2)}% of the measured matmul "
            f"ceiling ({_span(table['ceiling_tflops'].dropna(), 3)} TFLOP/s) over {len(table)} shapes; launch modes: "
            f"{modes}. Useful work (5 products) ran at {_span(table['useful_tflops'], 3)} TFLOP/s.")


def forward_table(bench: pd.DataFrame, ceilings: pd.DataFrame, sweep: str = "lm",
                  reference: str = "sdpa") -> pd.DataFrame:
    """Triton's forward and ``reference``'s on each shape of ``sweep`` against the dtype's measured matmul
    ceiling: the useful rate (the forward's two products, S = QK^T and O = PV, on the d columns), Triton's
    executed rate (the same products on the columns its kernel computes, :func:`lab.book.flash.bench.
    kernel_columns`) and each one's share of the ceiling. A shape with either side missing is left out."""
    cols = ["shape", "dtype", "d", "triton_ms", "reference_ms", "triton_tflops", "reference_tflops",
            "triton_executed_tflops", "ceiling_tflops", "triton_of_ceiling", "reference_of_ceiling"]
    ceiling = ceilings.set_index("dtype")["tflops"].to_dict() if len(ceilings) else {}
    sel = fl.add_tflops(bench[(bench["sweep"] == sweep) & (bench["status"] == "ok") & (bench["fwd_ms"] > 0)])
    theirs = sel[sel["impl"] == reference].set_index(gl.CONFIG_KEY)
    rows = []
    for _, r in sel[sel["impl"] == "triton"].iterrows():
        key = tuple(r[k] for k in gl.CONFIG_KEY)
        if key not in theirs.index:
            continue
        ref, d, top = theirs.loc[key], int(r["d"]), ceiling.get(r["dtype"], math.nan)
        rate, ref_rate = r["fwd_tflops"], ref["fwd_tflops"]
        rows.append(dict(shape=fl.Shape.of(r).label, dtype=r["dtype"], d=d, triton_ms=r["fwd_ms"],
                         reference_ms=ref["fwd_ms"], triton_tflops=rate, reference_tflops=ref_rate,
                         triton_executed_tflops=rate * fl.kernel_columns(r, "fwd") / d, ceiling_tflops=top,
                         triton_of_ceiling=rate / top, reference_of_ceiling=ref_rate / top))
    return pd.DataFrame(rows, columns=cols)


def forward_sentence(table: pd.DataFrame, reference: str = "sdpa", interpreted_: bool = False) -> str:
    """Per head dimension, the range of Triton's and ``reference``'s useful forward rate as a share of the
    matmul ceiling (from :func:`forward_table`): where both kernels do the same useful work, the gap between
    the shares is the kernels' efficiency, not the tensor cores' rate. On the CPU: no claim."""
    table = table.dropna(subset=["triton_of_ceiling", "reference_of_ceiling"])
    if table.empty:
        return "No forward was timed against a measured matmul ceiling."
    if interpreted_:
        return f"{len(table)} forward times measured. " + INTERPRETED_SHORT
    parts = [f"d {d}: Triton {_span(100 * g['triton_of_ceiling'], 2)}%, {reference} "
             f"{_span(100 * g['reference_of_ceiling'], 2)}%" for d, g in table.groupby("d")]
    return (f"The forward's useful work (two products per tile pair) against the measured matmul ceiling "
            f"({_span(table['ceiling_tflops'], 3)} TFLOP/s), over {len(table)} shapes: " + "; ".join(parts)
            + f". Where {reference} reaches a larger share on the same work, the card is not the bound: the gap "
            "is how the kernel keeps the tensor cores fed (the softmax between its two products, its loads).")


def _span(values: pd.Series, digits: int) -> str:
    """``"low-high"`` of ``values``, one number when both ends print alike."""
    low, high = fmt(values.min(), digits), fmt(values.max(), digits)
    return low if low == high else f"{low}-{high}"
