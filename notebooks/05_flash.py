# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · FlashAttention-2: Triton against PyTorch
#
# `lab.kernels.flash_triton.FlashAttentionTriton` computes attention tile by tile with an online softmax and never
# writes the `seq × seq` matrix to memory; its backward recomputes the scores from the saved logsumexp.
# Here we check it against a float64 reference, then time it against the naive PyTorch attention of
# notebook 04 and PyTorch's own fused SDPA over sequence lengths, head dimensions and dtypes (batch 1,
# causal), check the performance goals, and finally put it inside the language model.
#
# Every number in the prose is computed from the result tables below.

# %% tags=["parameters"]
quick = True                      # tiny shapes, Triton interpreted on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
impls = ["triton", "pytorch_naive", "sdpa"]
seqs = None                       # None: 128, 256, ..., 65536 (full) or 64, 128 (quick)
ds = None                         # None: 16, 32, 64, 128 (full) or 16, 32 (quick)
dtypes = None                     # None: bf16 and fp32 (full) or fp32 (quick: see below)
batch = 1
causal = True
warmup_ms = 3                     # triton.testing.do_bench warm-up and repetition budgets (ms, CUDA);
rep_ms = 10                       # each call runs at least once, so long shapes are not repeated 10 ms worth
cpu_steps = 1                     # timed calls per measurement on the CPU (after one untimed call)
mh_heads = None                   # multi-head shape; None: 16 (full) or 2 (quick)
mh_seq = None                     # None: 16384 (full) or 64 (quick)
mh_ds = None                      # None: 64, 128 (full) or 16 (quick)
lm_size = None                    # None: "small" (full) or "tiny" (quick)
lm_context = None                 # None: 1024 (full) or 64 (quick)
lm_batch = None                   # None: 4 (full) or 1 (quick: interpreted Triton is slow)
lm_dtype = None                   # None: "bf16" (full) or "fp32" (quick)
lm_attentions = ["flash_triton", "sdpa", "naive"]
autotune = False                  # Triton autotuning costs ~2 min of compiling per head dimension; the fixed
                                  # tile configs are the ones tuning chose on an H200
lm_warmup = None                  # None: 3 (full) or 0
lm_steps = None                   # None: 10 (full) or 1

# %%
import os

from lab.measure.device import resolve_device

dev = resolve_device(device)
if dev.type == "cpu":
    # Triton runs interpreted on the CPU; this must be set before lab.kernels.flash_triton is first imported.
    os.environ["TRITON_INTERPRET"] = "1"

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from lab.bench import attention as ab
from lab.kernels import flash_triton
from lab.book import plots, report
from lab.measure import results

flash_triton.AUTOTUNE = autotune

if quick:
    # fp32 only: under TRITON_INTERPRET the bf16 kernels do not reproduce GPU numerics (the GPU tests
    # cover bf16), so bf16 rows would time a wrong computation.
    dtypes, lm_dtype = dtypes or ["fp32"], lm_dtype or "fp32"
    seqs, ds = seqs or [64, 128], ds or [16, 32]
    mh_heads, mh_seq, mh_ds = mh_heads or 2, mh_seq or 64, mh_ds or [16]
    lm_size, lm_context = lm_size or "tiny", lm_context or 64
    lm_batch = lm_batch or 1
    lm_warmup, lm_steps = 0 if lm_warmup is None else lm_warmup, lm_steps or 1
else:
    dtypes, lm_dtype = dtypes or ["bf16", "fp32"], lm_dtype or "bf16"
    seqs, ds = seqs or [2**i for i in range(7, 17)], ds or [16, 32, 64, 128]
    mh_heads, mh_seq, mh_ds = mh_heads or 16, mh_seq or 16384, mh_ds or [64, 128]
    lm_size, lm_context = lm_size or "small", lm_context or 1024
    lm_batch = lm_batch or 4
    lm_warmup, lm_steps = 3 if lm_warmup is None else lm_warmup, lm_steps or 10

params = dict(quick=quick, device=str(dev), results_dir=results_dir, artifacts_dir=artifacts_dir, impls=impls,
              seqs=seqs, ds=ds, dtypes=dtypes, batch=batch, causal=causal, warmup_ms=warmup_ms, rep_ms=rep_ms,
              cpu_steps=cpu_steps, mh_heads=mh_heads, mh_seq=mh_seq, mh_ds=mh_ds, lm_size=lm_size,
              lm_context=lm_context, lm_batch=lm_batch, lm_dtype=lm_dtype, lm_attentions=lm_attentions,
              lm_warmup=lm_warmup, lm_steps=lm_steps, autotune=autotune, triton_interpret=os.environ.get("TRITON_INTERPRET"))
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## Correct first
#
# Output and the three gradients of each implementation against naive attention in float64 on the same
# inputs (causal, one moderate shape). Low-precision rows are expected to differ at the level of their
# rounding (bf16 keeps 8 significant bits).

# %%
fns = {name: ab.attention_impl(name, dev) for name in impls}
check_seq = 128 if quick else 1024
errors = pd.concat([ab.errors_vs_float64(fns, batch=2, seq=check_seq, d=max(ds), dtype=dt, causal=causal, device=dev)
                    for dt in dtypes], ignore_index=True)
report.show_table(errors, floatfmt=".2e")
worst = errors.set_index(["impl", "dtype"])[["out", "dq", "dk", "dv"]].max(axis=1)
report.say("Largest error of any output or gradient: " + "; ".join(
    f"{impl} {dt}: {err:.1e}" for (impl, dt), err in worst.items()) + ".")

# %% [markdown]
# ## Counting FLOPs
#
# `ab.attention_flops` counts matmul FLOPs (a multiply-add is 2): the forward's `Q Kᵀ` and `P V` are
# `4 · pairs · d`, where `pairs` is the number of (query, key) pairs the mask keeps, `seq(seq+1)/2` for
# causal attention (the papers round it to `seq²/2`). The backward is counted as FlashAttention-2 does it,
# five matmuls including the recomputed `Q Kᵀ`: 2.5× the forward; end-to-end is 3.5×. Every
# implementation is credited with the same count, so TFLOP/s is a speed, not the work each one does (naive
# attention computes the masked half too, and SDPA/Triton skip it).

# %%
example = pd.DataFrame([dict(seq_len=s, d=64, causal=c, **{f"{p}_gflop": ab.attention_flops(1, s, 64, c, p) / 1e9
                                                           for p in ab.PASSES})
                        for s in (1024, 8192) for c in (False, True)])
report.show_table(example, floatfmt=".4g")

# %% [markdown]
# ## Latency grid
#
# Batch 1, causal, one head (`(batch, seq, d)`), every length × d × dtype × implementation: forward, backward
# (on one retained forward graph) and end-to-end forward+backward, each with `triton.testing.do_bench`
# (CUDA events, L2 flushed between runs; on the CPU the shared host timer instead). Naive configurations
# whose predicted memory exceeds the GPU are recorded as out-of-memory without running; every other
# out-of-memory is caught and recorded with the pass it hit.

# %%
grid = ab.run_flash_grid(fns, seqs=seqs, ds=ds, dtypes=dtypes, batch=batch, heads=1, causal=causal,
                         warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps, device=dev)
multi = ab.run_flash_grid(fns, seqs=[mh_seq], ds=mh_ds, dtypes=dtypes, batch=1, heads=mh_heads, causal=causal,
                          warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps, device=dev)
bench = ab.add_speedups(pd.concat([grid, multi], ignore_index=True))
print(results.save_results(bench, "flash_benchmark", results_dir, params))

# %%
show_d = max(ds)
for dt in dtypes:
    sel = bench[(bench.dtype == dt) & (bench.d == show_d) & (bench.heads == 1)]
    table = sel.pivot_table(index="seq_len", columns="impl", values=["fwd_ms", "bwd_ms", "e2e_ms"])
    table.columns = [f"{p} {impl}" for p, impl in table.columns]
    report.say(f"**{dt}, d = {show_d}** (ms)")
    report.show_table(table.reset_index().astype({"seq_len": str}))

# %%
oom = bench[bench.status == "oom"]
if len(oom):
    report.show_table(oom[["impl", "dtype", "heads", "seq_len", "d", "note"]])
    for (impl, dt), g in oom.groupby(["impl", "dtype"]):
        report.say(f"{impl} ({dt}) ran out of memory from {g.seq_len.min()} tokens on "
                   f"({len(g)} configuration(s)).")
else:
    report.say(f"No configuration ran out of memory (longest: {bench.seq_len.max()} tokens).")

# %% [markdown]
# ## Latency vs length

# %%
lat = bench[(bench.heads == 1)].melt(id_vars=["impl", "dtype", "d", "seq_len"], value_vars=["fwd_ms", "bwd_ms",
                                     "e2e_ms"], var_name="pass", value_name="ms").dropna(subset=["ms"])
g = sns.relplot(data=lat[lat.d == show_d], x="seq_len", y="ms", hue="impl", col="pass", row="dtype", kind="line",
                markers=True, height=3.2, aspect=1.2, facet_kws=dict(sharey=False))
g.set(xscale="log", yscale="log")
g.figure.suptitle(f"Latency vs sequence length (batch {batch}, causal, d = {show_d})", y=1.02)
plt.show()
g = sns.relplot(data=lat[lat["pass"] == "e2e_ms"], x="seq_len", y="ms", hue="impl", col="d", row="dtype",
                kind="line", markers=True, height=2.8, aspect=1.1)
g.set(xscale="log", yscale="log")
g.figure.suptitle("End-to-end (forward + backward) latency for every head dimension", y=1.02)
plt.show()

# %% [markdown]
# ## Speedups and TFLOP/s
#
# Speedup = the baseline's time / Triton's time for the same configuration (above 1: Triton is faster).

# %%
tri = bench[(bench.impl == "triton") & (bench.heads == 1)]
baselines = [b for b in ("sdpa", "pytorch_naive") if b in impls]
if len(tri) and baselines:
    fig, axes = plt.subplots(len(baselines), len(dtypes), figsize=(5.5 * len(dtypes), 3.2 * len(baselines)),
                             squeeze=False)
    for i, base in enumerate(baselines):
        for j, dt in enumerate(dtypes):
            heat = tri[tri.dtype == dt].pivot_table(index="d", columns="seq_len", values=f"e2e_speedup_vs_{base}")
            sns.heatmap(np.log2(heat), annot=heat, fmt=".2g", cmap="RdBu", center=0, cbar=False, ax=axes[i, j],
                        annot_kws=dict(size=7))
            axes[i, j].set_title(f"Triton e2e speedup vs {base}, {dt}")
    fig.tight_layout()
    plt.show()

# %%
cols = ["impl", "dtype", "fwd_tflops", "bwd_tflops", "e2e_tflops"]
best = bench[bench.status == "ok"].groupby(["impl", "dtype"])[cols[2:]].max().reset_index()
report.show_table(best, floatfmt=".3g")
for dt in dtypes:
    t = best[(best.impl == "triton") & (best.dtype == dt)]
    if len(t):
        report.say(f"Triton {dt} reaches at best {t.fwd_tflops.iloc[0]:.3g} TFLOP/s forward, "
                   f"{t.bwd_tflops.iloc[0]:.3g} backward and {t.e2e_tflops.iloc[0]:.3g} end-to-end (causal FLOPs).")
if "pytorch_naive" in impls and len(tri):
    vs_naive = tri.dropna(subset=["e2e_speedup_vs_pytorch_naive"])
    if len(vs_naive):
        top = vs_naive.loc[vs_naive.e2e_speedup_vs_pytorch_naive.idxmax()]
        report.say(f"Against naive PyTorch, Triton's end-to-end speedup ranges from "
                   f"{vs_naive.e2e_speedup_vs_pytorch_naive.min():.2g}x to {top.e2e_speedup_vs_pytorch_naive:.3g}x "
                   f"(at {top['seq_len']} tokens, d {top['d']}, {top['dtype']}).")

# %% [markdown]
# ## The performance goals
#
# For bf16, causal, d ∈ {64, 128} and sequences of at least 8192 tokens: Triton's forward at least as fast
# as SDPA (ratio SDPA ms / Triton ms ≥ 1), its backward at least 0.8× SDPA's speed and end-to-end at least
# 0.85×. Checked on every qualifying configuration, including the multi-head shape.

# %%
goals = ab.flash_goals(bench)
summary = ab.summarize_goals(goals)
if summary["configs"] == 0:
    report.say("No configuration qualifies for the performance goals here (they need bf16, d 64/128 and at "
               "least 8192 tokens, measured for both Triton and SDPA), so they are not evaluated in this run.")
else:
    report.show_table(goals, floatfmt=".3g")
    parts = [f"{p}: {summary[p]['met']}/{summary['configs']} configurations meet ≥ {summary[p]['target']}x "
             f"(worst {summary[p]['worst']:.3g}x)" for p in ab.GOALS]
    verdict = "All goals hold" if summary["all_met"] else "The goals do not all hold"
    report.say(f"{verdict} on this GPU — " + "; ".join(parts) + ".")

# %% [markdown]
# ## The multi-head shape
#
# Batch 1 with `mh_heads` heads is the same computation as a batch of `mh_heads` independent heads, so the
# kernels see `(batch · heads, seq, d)` and SDPA the same tensor viewed as heads.

# %%
mh = bench[bench.heads > 1]
report.show_table(mh[["impl", "dtype", "heads", "seq_len", "d", "fwd_ms", "bwd_ms", "e2e_ms", "e2e_tflops",
                      "e2e_speedup_vs_sdpa", "status"]])
for r in mh[(mh.impl == "triton") & (mh.status == "ok")].itertuples():
    report.say(f"{r.heads} heads × {r.seq_len} tokens, d {r.d}, {r.dtype}: Triton end-to-end {r.e2e_ms:.3g} ms, "
               f"{r.e2e_speedup_vs_sdpa:.2f}x SDPA's speed, {r.e2e_tflops:.3g} TFLOP/s.")

# %% [markdown]
# ## The language model with FlashAttention
#
# The same Transformer with its attention swapped (`attention="flash_triton"`, `"sdpa"`, `"naive"`):
# forward, forward+backward and full AdamW train step via `lab.bench.lm.benchmark_lm`.

# %%
lm = ab.lm_step_rows(lm_size, context=lm_context, batch=lm_batch, dtype=lm_dtype,
                     variants=[(a, False) for a in lm_attentions], warmup=lm_warmup, steps=lm_steps, device=dev)
report.show_table(lm[ab.LM_STEP_COLUMNS])
print(results.save_results(lm, "lm_step", results_dir, params))

# %%
ok = lm[lm.status == "ok"].set_index("attention")
if "flash_triton" in ok.index:
    flash = ok.loc["flash_triton"]
    for other in [a for a in ("sdpa", "naive") if a in ok.index]:
        o = ok.loc[other]
        memory = (f"; peak memory {flash.peak_gib:.3g} vs {o.peak_gib:.3g} GiB" if np.isfinite(flash.peak_gib)
                  and np.isfinite(o.peak_gib) else "")
        report.say(f"{lm_size} at context {lm_context}, batch {lm_batch}, {lm_dtype}: the train step takes "
                   f"{flash.step_ms:.4g} ms with FlashAttention-Triton vs {o.step_ms:.4g} ms with {other}, "
                   f"{o.step_ms / flash.step_ms:.2f}x {other}'s speed (forward+backward "
                   f"{o.fwdbwd_ms / flash.fwdbwd_ms:.2f}x){memory}.")
for r in lm[lm.status == "oom"].itertuples():
    report.say(f"{r.attention} ran out of memory at context {r.context}.")
