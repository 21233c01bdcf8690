# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Profiling: where a Transformer's training time goes
#
# We time the language model end to end (forward, backward, full AdamW step) for every size in the
# spec, study why the first steps are slow, and then look inside one step with `torch.profiler`: which
# kernels run, how much of the time is matrix multiplication, and what softmax costs inside attention.
#
# Every number in the prose below is computed from the result tables, so it stays true when the book is
# re-rendered on another machine.

# %% tags=["parameters"]
quick = True                      # tiny models on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
sizes = None                      # None: every spec size (full) or the toy sizes (quick)
contexts = None                   # None: 128, 256, 512, 1024 (full) or 32, 64 (quick)
default_context = None            # the context at which the train step is also timed
batch = 4
warmup = 3
steps = 6
warmup_size = None                # model for the warm-up study
profile_size = None               # model for the kernel profile
profile_context = None

# %%
import pandas as pd
import matplotlib.pyplot as plt
import seaborn as sns

from lab.bench import lm as bench
from lab.measure import profiling, results
from lab.book import report, plots
from lab import paths
from lab.model.transformer import MODEL_SIZES, config_for

if quick:
    sizes = sizes or ["tiny", "mini"]
    contexts = contexts or [32, 64]
    default_context = default_context or 64
    warmup, steps = min(warmup, 2), min(steps, 3)
    warmup_size = warmup_size or "mini"
    profile_size = profile_size or "mini"
    profile_context = profile_context or 64
else:
    sizes = sizes or list(MODEL_SIZES)
    contexts = contexts or [128, 256, 512, 1024]
    default_context = default_context or 512
    warmup_size = warmup_size or "large"
    profile_size = profile_size or "2.7B"
    profile_context = profile_context or 512

params = dict(quick=quick, device=device, sizes=sizes, contexts=contexts, default_context=default_context,
              batch=batch, warmup=warmup, steps=steps, warmup_size=warmup_size, profile_size=profile_size,
              profile_context=profile_context)
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## The models
#
# Vocabulary 10,000, batch 4, pre-norm RMSNorm, RoPE, SwiGLU, causal multi-head attention, untied LM head.
# (Some courses call the 2560-wide model "xl"; here "xl" is the 1600-wide one and that one is "2.7B".)

# %%
import torch
from lab.model.transformer import TransformerLM

def count_params(size):
    with torch.device("meta"):  # no memory: only the shapes are needed
        return TransformerLM(config_for(size)).num_parameters()

size_table = pd.DataFrame([{"size": s, **config_for(s).__dict__, "params_M": count_params(s) / 1e6}
                           for s in sizes]).drop(columns=["rope_theta", "attention", "context_length"])
report.show_table(size_table, floatfmt=".1f")

# %% [markdown]
# ## End-to-end timing: every size and context
#
# `lab.bench.lm.benchmark_lm` builds the model, runs `warmup` untimed steps and then `steps` timed ones,
# synchronizing the GPU after every step. Forward and backward are timed separately inside each
# forward+backward step. At the default context the full AdamW train step is timed as well.
# fp32 here; mixed precision is the subject of notebook 02.

# %%
raw = bench.sweep_lm(sizes, contexts, dtypes=["fp32"], batch=batch, warmup=warmup, steps=steps, device=device,
                     modes=lambda s, c: bench.MODES if c == default_context else ("forward", "forward_backward"))
lm = bench.lm_step_table(raw)
results.save_results(lm, "lm_step", results_dir, params)
samples = bench.samples_long(raw)
results.save_results(samples, "01_lm_samples", results_dir, params)
ok = lm[lm.fwd_ms.notna()]  # a row that ran out of memory in backward still has its forward
cols = ["size", "context", "status", "params", "fwd_ms", "fwd_std_ms", "bwd_ms", "bwd_std_ms", "step_ms", "step_std_ms",
        "peak_gib"]
report.show_table(lm[cols].assign(params=lm["params"] / 1e6).rename(columns={"params": "params_M"}),
                  floatfmt=".2f")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
for ax, phase in zip(axes, ["fwd", "bwd"]):
    for size, g in ok.groupby("size", sort=False):
        ax.errorbar(g["context"], g[f"{phase}_ms"], yerr=g[f"{phase}_std_ms"], marker="o", capsize=3, label=size)
    ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="ms per step",
           title={"fwd": "forward", "bwd": "backward"}[phase])
    ax.set_xticks(contexts, [str(c) for c in contexts])
axes[1].legend(title="size")
plt.show()

# %%
ok = ok.assign(bwd_over_fwd=ok["bwd_ms"] / ok["fwd_ms"], fwd_cv=ok["fwd_std_ms"] / ok["fwd_ms"],
               bwd_cv=ok["bwd_std_ms"] / ok["bwd_ms"])
noisy = ok[(ok.fwd_cv > 0.05) | (ok.bwd_cv > 0.05)]
oom = lm[lm.status == "oom"]
at_default = ok[ok.context == default_context].set_index("size")
ratio = ok["bwd_over_fwd"].dropna()
text = (f"Backward costs **{ratio.min():.1f}x to {ratio.max():.1f}x** the forward (median {ratio.median():.1f}x): "
        "it computes two matrix products per forward one (gradients of inputs and of weights). ")
if len(at_default) >= 2:
    big, small = at_default.index[-1], at_default.index[0]
    text += (f"At context {default_context} the forward takes {at_default.loc[small, 'fwd_ms']:.1f} ms for "
             f"{small} and {at_default.loc[big, 'fwd_ms']:.1f} ms for {big}. ")
if len(noisy):
    worst = noisy.sort_values("fwd_cv").iloc[-1]
    text += (f"Variability is high (std above 5% of the mean) in {len(noisy)} of {len(ok)} configurations, "
             f"worst for {worst['size']} at context {worst['context']} "
             f"(forward std {100 * worst['fwd_cv']:.0f}% of the mean): the smallest steps are dominated by "
             "kernel-launch and Python overhead, which jitters. ")
else:
    text += "Variability is low everywhere: every standard deviation is below 5% of its mean. "
if len(oom):
    failed_modes = lambda err: "/".join(part.split(":")[0] for part in err.split("; "))
    text += ("Out of memory: " + ", ".join(f"{r['size']} at context {r['context']} ({failed_modes(r['error'])})"
                                           for _, r in oom.iterrows()) + ". ")
report.say(text)

# %% [markdown]
# ## Warm-up: why the first steps are slow
#
# Each warm-up setting runs in a **fresh Python process** (via `python -m lab.bench.lm --json`), because the cost
# we want to see is paid once per process: creating the CUDA context, loading kernels into it, creating the
# cuBLAS handle and choosing its algorithms for each new shape, and growing the caching allocator's pool by
# `cudaMalloc`. None of that is the model's steady-state cost, which is why benchmarks warm up first.

# %%
wu = bench.warmup_study(warmup_size, warmups=(0, 1, 2, 5), steps=steps, context=default_context, batch=batch,
                        device=device)
results.save_results(wu, "01_warmup", results_dir, params)
fig, ax = plt.subplots(figsize=(9, 4.5))
sns.lineplot(data=wu, x="step", y="fwdbwd_ms", hue="warmup", marker="o", ax=ax, palette="viridis")
ax.set(yscale="log", xlabel="timed step index", ylabel="forward+backward ms",
       title=f"{warmup_size}: timed steps after 0, 1, 2, 5 warm-up steps (each a fresh process)")
plt.show()
summary = wu.groupby("warmup")["fwdbwd_ms"].agg(["mean", "std", "median", "max"]).reset_index()
report.show_table(summary.astype({"warmup": str}), floatfmt=".2f")

# %%
cold = wu[(wu.warmup == 0) & (wu.step == 0)]["fwdbwd_ms"].iloc[0]
steady = wu[wu.warmup == 5]["fwdbwd_ms"].median()
second = wu[(wu.warmup == 0) & (wu.step == 1)]["fwdbwd_ms"].iloc[0]
report.say(f"Without warm-up the first timed step takes **{cold:.1f} ms**, {cold / steady:.1f}x the steady-state "
           f"median of {steady:.1f} ms measured after 5 warm-up steps; the second step already takes "
           f"{second:.1f} ms ({second / steady:.2f}x). With no warm-up the mean over {steps} steps is "
           f"{summary.loc[summary.warmup == 0, 'mean'].iloc[0]:.1f} ms and its std "
           f"{summary.loc[summary.warmup == 0, 'std'].iloc[0]:.1f} ms, against "
           f"{summary.loc[summary.warmup == 5, 'mean'].iloc[0]:.1f} ± "
           f"{summary.loc[summary.warmup == 5, 'std'].iloc[0]:.1f} ms with 5: one cold step is enough to distort "
           "both. One or two warm-up steps remove most of the effect; the first step pays for one-time setup "
           "(context, kernel loading, library handles and algorithm selection, allocator growth).")

# %% [markdown]
# ## Inside one step: a kernel profile
#
# `lab.measure.profiling.profile_lm` runs warm-up steps, then profiles a few steps with `torch.profiler`
# (CPU and CUDA activities) using the **naive** attention, whose three phases carry `record_function` and
# NVTX ranges. Each profile is also exported as a Chrome/Perfetto trace into the artifacts folder
# (git-ignored, regenerated by this cell; open it at ui.perfetto.dev).

# %%
trace_dir = paths.artifacts_dir(artifacts_dir) / "traces"
profiles, kernel_tables, shares = {}, [], []
for mode in bench.MODES:
    prof = profiling.profile_lm(profile_size, mode=mode, context=profile_context, batch=batch,
                                attention="naive", device=device, warmup=3, steps=3,
                                trace_path=trace_dir / f"01_{profile_size}_{mode}.json")
    profiles[mode] = prof
    kernel_tables.append(profiling.kernel_table(prof, top=None).assign(mode=mode))
    shares.append(profiling.class_shares(prof).assign(mode=mode))
kernels = pd.concat(kernel_tables, ignore_index=True)
shares = pd.concat(shares, ignore_index=True)
results.save_results(kernels, "01_kernels", results_dir, params)
report.say(f"Profiled **{profile_size}** at context {profile_context}, batch {batch}, fp32; traces in "
           f"`{trace_dir.relative_to(paths.REPO_ROOT) if trace_dir.is_relative_to(paths.REPO_ROOT) else trace_dir}`. "
           f"Time source: {kernels['source'].iloc[0]}s.")

# %%
for mode in bench.MODES:
    report.say(f"**Top kernels, {mode}** (per step)")
    top = kernels[kernels["mode"] == mode].head(8).copy()
    top["name"] = top["name"].str.slice(0, 90)
    report.show_table(top[["name", "class", "calls_per_step", "ms_per_step", "share"]], floatfmt=".3g")

# %%
fig, ax = plt.subplots(figsize=(8, 4))
pivot = shares.pivot(index="mode", columns="class", values="share").reindex(list(bench.MODES)).fillna(0)
pivot.plot.barh(stacked=True, ax=ax, colormap="tab10")
ax.set(xlabel="share of kernel time", ylabel="", title=f"{profile_size}: matmul vs other kernels")
ax.legend(loc="lower right")
plt.show()
mm = shares[shares["class"] == "matmul"].set_index("mode")["share"]
top_other = kernels[(kernels["class"] != "matmul") & (kernels["mode"] == "forward")].iloc[0]
report.say(f"Matrix multiplications take **{100 * mm.get('forward', 0):.0f}%** of the kernel time in the forward "
           f"pass, {100 * mm.get('forward_backward', 0):.0f}% in forward+backward and "
           f"{100 * mm.get('train_step', 0):.0f}% in the full train step (the optimizer adds elementwise "
           f"kernels). The largest non-matmul kernel in the forward is `{top_other['name'][:70]}` "
           f"({100 * top_other['share']:.1f}% of forward time, {top_other['calls_per_step']:.0f} calls per step): "
           "elementwise and reduction kernels are memory-bound, so their share is far above their share of FLOPs.")

# %%
fwd_prof = profiles["forward"]
python_fwd = at_default.loc[profile_size, "fwd_ms"] if (profile_size in at_default.index
                                                         and profile_context == default_context) else None
busy, wall = profiling.gpu_busy_ms(fwd_prof), profiling.step_wall_ms(fwd_prof)
text = f"The profiler sees a forward step of **{wall:.1f} ms** wall time"
if busy:
    text += f", of which kernels are busy {busy:.1f} ms ({100 * busy / wall:.0f}%)"
if python_fwd is not None:
    text += (f"; the Python timer measured {python_fwd:.1f} ms for the same configuration with SDPA attention "
             f"in the sweep (the profile uses naive attention and adds profiler overhead)")
report.say(text + ".")

# %% [markdown]
# ### Softmax against the two matrix products inside attention
#
# The naive attention's three ranges (`attention/scores`, `attention/softmax`, `attention/final_matmul`)
# are summed over the forward step. FLOPs: each matmul costs 2·b·h·s²·d, softmax about 5 operations per score.

# %%
ranges = profiling.range_times(fwd_prof)
cfg = config_for(profile_size)
flops = profiling.attention_phase_flops(batch, cfg.num_heads, profile_context, cfg.head_dim, cfg.num_layers)
ranges["gflop_per_step"] = ranges["range"].map(flops) / 1e9
ranges["tflop_per_s"] = ranges["gflop_per_step"] / ranges["ms_per_step"]
report.show_table(ranges, floatfmt=".3g")
r = ranges.set_index("range")
matmul_ms = r.loc["attention/scores", "ms_per_step"] + r.loc["attention/final_matmul", "ms_per_step"]
matmul_gf = r.loc["attention/scores", "gflop_per_step"] + r.loc["attention/final_matmul", "gflop_per_step"]
rt_ratio = r.loc["attention/softmax", "ms_per_step"] / matmul_ms
fl_ratio = r.loc["attention/softmax", "gflop_per_step"] / matmul_gf
results.save_results(ranges.assign(runtime_ratio=rt_ratio, flop_ratio=fl_ratio), "01_attention_ranges",
                     results_dir, params)
report.say(f"Softmax takes **{rt_ratio:.2f}x** the time of the two attention matmuls together but only "
           f"**{fl_ratio:.3f}x** their FLOPs: per FLOP it is {rt_ratio / fl_ratio:.0f}x more expensive "
           f"({r.loc['attention/softmax', 'tflop_per_s']:.3g} TFLOP/s against "
           f"{matmul_gf / matmul_ms:.3g} TFLOP/s for the matmuls). Softmax does a handful of operations per score "
           "but reads and writes the whole b·h·s² score matrix, so it is bound by memory bandwidth, not "
           "arithmetic; fusing it into the matmuls (FlashAttention, notebook 05) removes those round trips.")
