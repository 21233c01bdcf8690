# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Attention: the PyTorch baselines
#
# Attention written the obvious way, `softmax(Q Kᵀ / √d) V` as three PyTorch ops, materializes a
# `seq × seq` score matrix per sequence. Here we time it (no heads, batch 8) over head dimensions and
# sequence lengths, watch its memory grow with the square of the length until it no longer fits, account
# for that memory term by term, and see what `torch.compile` does to it — first on the attention function
# alone, then on the whole language model.
#
# Every number in the prose is computed from the result tables below.

# %% tags=["parameters"]
quick = True                      # tiny grid on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
ds = None                         # head dimensions; None: 16, 32, 64, 128 (full) or 16, 32 (quick)
seqs = None                       # sequence lengths; None: 256 ... 16384 (full) or 64, 128 (quick)
batch = 8
dtype = "fp32"
causal = False                    # the grid measures plain (unmasked) attention
passes = None                     # forward and backward passes per configuration; None: 100 (full) or 3
warmup = None                     # untimed passes first; None: 5 (full) or 1
compile_grid = True               # also run the grid through torch.compile (compiles once per shape)
lm_sizes = None                   # whole-model eager vs compiled; None: ["small"] (full) or ["tiny"]
lm_context = None                 # None: 512 (full) or 64 (quick)
lm_batch = 4
lm_dtype = "bf16"
lm_warmup = None                  # None: 3 (full) or 1
lm_steps = None                   # None: 10 (full) or 2

# %%
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from lab.bench import attention as ab
from lab.book import plots, report
from lab.measure import results
from lab.measure.device import resolve_device

dev = resolve_device(device)
if quick:
    ds, seqs = ds or [16, 32], seqs or [64, 128]
    passes, warmup = passes or 3, 1 if warmup is None else warmup
    lm_sizes, lm_context = lm_sizes or ["tiny"], lm_context or 64
    lm_warmup, lm_steps = 1 if lm_warmup is None else lm_warmup, lm_steps or 2
else:
    ds, seqs = ds or [16, 32, 64, 128], seqs or [256, 1024, 4096, 8192, 16384]
    passes, warmup = passes or 100, 5 if warmup is None else warmup
    lm_sizes, lm_context = lm_sizes or ["small"], lm_context or 512
    lm_warmup, lm_steps = 3 if lm_warmup is None else lm_warmup, lm_steps or 10

params = dict(quick=quick, device=str(dev), results_dir=results_dir, artifacts_dir=artifacts_dir, ds=ds, seqs=seqs,
              batch=batch, dtype=dtype, causal=causal, passes=passes, warmup=warmup, compile_grid=compile_grid,
              lm_sizes=lm_sizes, lm_context=lm_context, lm_batch=lm_batch, lm_dtype=lm_dtype, lm_warmup=lm_warmup,
              lm_steps=lm_steps)
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## Naive attention over d × seq
#
# `lab.bench.attention.naive_attention` is the same math as the model's `"naive"` attention (scores,
# softmax, weighted sum), on `(batch, seq, d)` inputs. For every configuration `run_naive_grid`
# times `passes` forward passes (gradients enabled, as in training), then runs one forward, reads the
# memory in use (`torch.cuda.memory_allocated`) before the backward starts, and times `passes` backward
# passes on that graph. Out-of-memory is a row with `status="oom"`. It also counts, with autograd's
# saved-tensor hooks, how many bytes the forward keeps for the backward (`saved_mib`, any device).

# %%
eager = ab.run_naive_grid(ab.naive_attention, ds=ds, seqs=seqs, batch=batch, dtype=dtype, causal=causal,
                          passes=passes, warmup=warmup, impl="naive", device=dev)
grid_cols = ["d", "seq_len", "fwd_ms", "bwd_ms", "mem_baseline_mib", "mem_before_bwd_mib", "peak_mib", "saved_mib",
             "predicted_saved_mib", "status"]
report.show_table(eager[grid_cols])

# %%
ok, oom = eager[eager["status"] == "ok"], eager[eager["status"] == "oom"]
if len(oom):
    first = oom.sort_values(["seq_len", "d"]).iloc[0]
    report.say(f"{len(oom)} of {len(eager)} configurations ran out of memory; the shortest sequence that did "
               f"not fit is {first.seq_len} tokens (d={first.d}), in the {first.note.split(':')[0].split()[-1]} "
               f"pass. Out-of-memory depends on the length far more than on d: "
               f"{', '.join(f'd={d}: from {g.seq_len.min()}' for d, g in oom.groupby('d'))} tokens.")
else:
    report.say(f"All {len(eager)} configurations fit on this device (longest: {eager.seq_len.max()} tokens, "
               f"batch {batch}, {dtype}).")
if len(ok):
    longest = ok[ok["seq_len"] == ok["seq_len"].max()]
    report.say(f"At {longest.seq_len.iloc[0]} tokens a forward pass takes {longest.fwd_ms.min():.3g}–"
               f"{longest.fwd_ms.max():.3g} ms and a backward pass {longest.bwd_ms.min():.3g}–"
               f"{longest.bwd_ms.max():.3g} ms over d = {', '.join(map(str, longest.d))}: the backward is "
               f"{(longest.bwd_ms / longest.fwd_ms).median():.2g}x the forward (median). Going from the "
               f"smallest to the largest d multiplies the forward time by only "
               f"{(longest.fwd_ms.iloc[-1] / longest.fwd_ms.iloc[0]):.2g}x for {longest.d.iloc[-1] // longest.d.iloc[0]}x "
               f"the FLOPs, because the seq × seq softmax traffic does not depend on d.")

# %% [markdown]
# ## Memory accounting
#
# What the naive forward leaves for the backward, term by term (`naive_attention_memory`): the softmax
# output `P` (`batch × seq² × bytes`, saved once and used by both the softmax backward and the `P @ V`
# backward), plus, beside it, the live inputs, the upstream gradient and the output. The backward then
# needs two more score-sized tensors (`dP` and `dS`). We work it for the smallest configuration that did
# not fit or, if everything fit, for the largest one, and compare with the measurement.

# %%
row, kind = ab.accounting_config(eager)
terms = ab.naive_attention_memory(batch, int(row.seq_len), int(row.d), dtype, causal)
terms["MiB"] = terms["bytes"] / 2**20
report.show_table(terms[["term", "formula", "when", "MiB"]], floatfmt=".1f")
check = ab.naive_memory_check(row)
report.show_table(check, floatfmt=".4g")

# %%
p_mib = terms.set_index("term").loc["probabilities P (saved)", "MiB"]
what = "the smallest configuration that ran out of memory" if kind == "oom" else "the largest configuration that fit"
report.say(f"For {what} (batch {batch}, seq {row.seq_len}, d {row.d}, {dtype}) the probability matrix alone is "
           f"{batch} × {row.seq_len}² × {ab.dtype_bytes(dtype)} B = {p_mib / 1024:.3g} GiB; when the backward "
           f"starts {row.predicted_before_bwd_mib / 1024:.3g} GiB should be allocated and the backward peak "
           f"needs at least {row.predicted_peak_mib / 1024:.3g} GiB.")
measured = check.dropna(subset=["measured_mib"])
if len(measured):
    report.say("Measured against predicted: " + "; ".join(
        f"{r.quantity}: {r.measured_mib:.4g} MiB measured vs {r.predicted_mib:.4g} MiB predicted "
        f"({r.measured_over_predicted:.3f}x)" for r in measured.itertuples()) + ".")
if kind == "oom" and dev.type == "cuda":
    total = torch.cuda.get_device_properties(dev).total_memory / 2**30
    report.say(f"This GPU has {total:.3g} GiB, so the predicted {row.predicted_peak_mib / 1024:.3g} GiB "
               f"cannot fit: the out-of-memory is explained by the score-sized tensors alone.")

# %% [markdown]
# ## How the saved memory scales with length, and what removes it
#
# The fitted exponent of `saved ~ seqᵖ` (from autograd's own count). FlashAttention never materializes
# `P`: it keeps Q, K, V, the output and one logsumexp per query row (`flash_attention_saved_bytes`), and
# recomputes the scores tile by tile in the backward pass — memory linear in the length, paid for with
# one extra `Q Kᵀ` matmul.

# %%
scaling = ab.saved_memory_scaling(eager)
report.show_table(scaling, floatfmt=".3f")
e = ab.dtype_bytes(dtype)
curves = []
for r in eager.dropna(subset=["saved_mib"]).itertuples():
    inputs = 3 * batch * r.seq_len * r.d * e / 2**20  # both methods keep q, k, v
    curves.append(dict(d=r.d, seq_len=r.seq_len, method="naive (measured)", MiB=r.saved_mib + inputs))
for d in ds:
    for s in seqs:
        curves.append(dict(d=d, seq_len=s, method="FlashAttention (closed form)",
                           MiB=ab.flash_attention_saved_bytes(batch, s, d, dtype) / 2**20))
curves = pd.DataFrame(curves)
g = sns.relplot(data=curves, x="seq_len", y="MiB", hue="d", style="method", kind="line", markers=True,
                palette="viridis", height=4, aspect=1.6)
g.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="kept for backward incl. q, k, v (MiB)")
g.figure.suptitle(f"Memory kept for the backward pass, batch {batch}, {dtype}", y=1.03)
plt.show()

# %%
if len(scaling):
    report.say(f"Fitted over all lengths the saved memory grows as seq^{scaling.p_all.min():.2f}–"
               f"seq^{scaling.p_all.max():.2f} across d; between the two longest lengths the exponent is "
               f"{scaling.p_longest.min():.3f}–{scaling.p_longest.max():.3f}, i.e. quadratic, and independent of d "
               f"because P has no d axis.")
    big = curves[curves.seq_len == curves.seq_len.max()].pivot_table(index="d", columns="method", values="MiB")
    if "naive (measured)" in big:
        big = big.dropna()
        ratio = big["naive (measured)"] / big["FlashAttention (closed form)"]
        report.say(f"At {curves.seq_len.max()} tokens the naive version keeps {big['naive (measured)'].min():.4g}–"
                   f"{big['naive (measured)'].max():.4g} MiB for the backward; FlashAttention would keep "
                   f"{big['FlashAttention (closed form)'].min():.4g}–{big['FlashAttention (closed form)'].max():.4g}"
                   f" MiB, {ratio.min():.3g}–{ratio.max():.3g}x less.")

# %% [markdown]
# ## The same grid through `torch.compile`
#
# Each shape is compiled on its own (`dynamic=False`, after `torch._dynamo.reset()`), so `compile_s` is the
# one-off cost of the first forward+backward of that shape. Compiled backward graphs normally donate
# saved buffers, which forbids re-running the backward on one graph; the runner switches donation off.

# %%
if compile_grid:
    compiled = ab.run_naive_grid(ab.naive_attention, ds=ds, seqs=seqs, batch=batch, dtype=dtype, causal=causal,
                                 passes=passes, warmup=warmup, compile=True, impl="naive", device=dev)
    versus = ab.eager_vs_compiled(eager, compiled)
    report.show_table(versus[["d", "seq_len", "fwd_ms_eager", "fwd_ms_compiled", "fwd_speedup", "bwd_ms_eager",
                              "bwd_ms_compiled", "bwd_speedup", "mem_before_bwd_mib_eager",
                              "mem_before_bwd_mib_compiled", "compile_s", "status_eager", "status_compiled"]])

# %%
if compile_grid:
    both = versus.dropna(subset=["fwd_speedup", "bwd_speedup"])
    if len(both):
        best = both.loc[both.fwd_speedup.idxmax()]
        report.say(f"Compiling changes the forward by {both.fwd_speedup.min():.2f}–{both.fwd_speedup.max():.2f}x "
                   f"(median {both.fwd_speedup.median():.2f}x; best at seq {best.seq_len}, d {best.d}) and the "
                   f"backward by {both.bwd_speedup.min():.2f}–{both.bwd_speedup.max():.2f}x "
                   f"(median {both.bwd_speedup.median():.2f}x); speedups above 1 mean compiled is faster. "
                   f"Compiling cost {compiled.compile_s.sum():.3g} s for {compiled.compile_s.notna().sum()} shapes.")
    mem = versus.dropna(subset=["mem_before_bwd_mib_eager", "mem_before_bwd_mib_compiled"])
    if len(mem):
        r = (mem.mem_before_bwd_mib_compiled / mem.mem_before_bwd_mib_eager)
        report.say(f"Memory in use before the backward, compiled over eager: {r.min():.3f}–{r.max():.3f}x.")
    saved = versus.dropna(subset=["saved_mib_eager", "saved_mib_compiled"])
    compiled_scaling = ab.saved_memory_scaling(compiled)
    if len(saved) and len(compiled_scaling):
        r = saved.saved_mib_compiled / saved.saved_mib_eager
        report.say(f"What the compiled graph saves for the backward is {r.min():.3f}–{r.max():.3f}x what eager "
                   f"saves, and it still grows as seq^{compiled_scaling.p_longest.min():.2f}–"
                   f"seq^{compiled_scaling.p_longest.max():.2f} between the two longest lengths: "
                   + ("fusing the scale, softmax and matmuls does not remove the seq × seq tensor kept for the "
                      "backward." if compiled_scaling.p_longest.min() > 1.8 else
                      "the compiled graph no longer keeps a quadratic tensor."))
    newly = versus[(versus.status_eager == "oom") & (versus.status_compiled == "ok")]
    if len(newly):
        report.say(f"{len(newly)} configuration(s) that ran out of memory eagerly fit once compiled.")
    plot = both.melt(id_vars=["d", "seq_len"], value_vars=["fwd_speedup", "bwd_speedup"], var_name="pass",
                     value_name="speedup")
    g = sns.catplot(data=plot, x="seq_len", y="speedup", hue="d", col="pass", kind="bar", palette="viridis",
                    height=3.5, aspect=1.3)
    for ax in g.axes.flat:
        ax.axhline(1, color="black", lw=1)
    g.figure.suptitle("torch.compile speedup over eager (naive attention)", y=1.04)
    plt.show()

# %% [markdown]
# ## The whole model: eager vs compiled
#
# `lab.bench.lm.benchmark_lm` times the language model's forward, forward+backward and full AdamW train step,
# eager and with `torch.compile(model)` (PyTorch SDPA attention inside), under bf16 autocast by default.

# %%
variants = [("sdpa", False), ("sdpa", True)]
lm = pd.concat([ab.lm_step_rows(size, context=lm_context, batch=lm_batch, dtype=lm_dtype, variants=variants,
                                warmup=lm_warmup, steps=lm_steps, device=dev) for size in lm_sizes],
               ignore_index=True)
report.show_table(lm[ab.LM_STEP_COLUMNS])

# %%
for size, g in lm[lm.status == "ok"].groupby("size"):
    if g["compile"].nunique() < 2:
        continue
    e_row, c_row = g[~g["compile"]].iloc[0], g[g["compile"]].iloc[0]
    report.say(f"{size} (context {lm_context}, batch {lm_batch}, {lm_dtype}): compiling changes the forward from "
               f"{e_row.fwd_ms:.3g} to {c_row.fwd_ms:.3g} ms ({e_row.fwd_ms / c_row.fwd_ms:.2f}x), forward+backward "
               f"from {e_row.fwdbwd_ms:.3g} to {c_row.fwdbwd_ms:.3g} ms ({e_row.fwdbwd_ms / c_row.fwdbwd_ms:.2f}x) "
               f"and the train step from {e_row.step_ms:.3g} to {c_row.step_ms:.3g} ms "
               f"({e_row.step_ms / c_row.step_ms:.2f}x).")
for r in lm[lm.status == "oom"].itertuples():
    report.say(f"{r.size} with compile={r.compile} ran out of memory.")

# %% [markdown]
# ## Saved results
#
# The grid (eager and compiled rows) goes to `attention_naive_grid.csv`, the model rows to the headline
# table `lm_step.csv`.

# %%
grid_all = pd.concat([eager] + ([compiled] if compile_grid else []), ignore_index=True)
print(results.save_results(grid_all, "attention_naive_grid", results_dir, params))
print(results.save_results(lm, "lm_step", results_dir, params))
