# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Mixed precision: what changes when the math runs in 16 bits
#
# Four steps: why *accumulating* in low precision loses information; what autocast actually does to each
# tensor of a small model (observed with hooks, not assumed); why normalisation statistics are kept in
# fp32; and how much bf16 autocast speeds up every model size.
#
# Every number in the prose is computed from the result tables below.

# %% tags=["parameters"]
quick = True                      # tiny models on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
sizes = None                      # None: every spec size (full) or two toy configs (quick)
context = None                    # None: 512 (full) or 64 (quick)
batch = 4
warmup = 2
steps = 3
accumulation_value = 0.01
accumulation_count = 1000
norm_width = 1024                 # width of the synthetic activations in the norm demo

# %%
import math

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from lab.book import plots, report
from lab.bench import precision
from lab.measure import results
from lab.measure.device import resolve_device
from lab.model.transformer import MODEL_SIZES, ModelConfig

dev = resolve_device(device)
if quick:
    sizes = sizes or [ModelConfig(d_model=64, d_ff=256, num_layers=2, num_heads=4, context_length=64),
                      ModelConfig(d_model=128, d_ff=512, num_layers=2, num_heads=4, context_length=64)]
    context = context or 64
    batch = min(batch, 2)
else:
    sizes = sizes or list(MODEL_SIZES)
    context = context or 512

size_names = [s if isinstance(s, str) else f"d{s.d_model}_L{s.num_layers}" for s in sizes]
params = dict(quick=quick, device=str(dev), sizes=size_names,
              context=context, batch=batch, warmup=warmup, steps=steps, accumulation_value=accumulation_value,
              accumulation_count=accumulation_count, norm_width=norm_width)
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## 1. Accumulation: summing 0.01 a thousand times
#
# The exact answer is 10. Each variant keeps a running sum (the *accumulator*) in one dtype and adds an
# *addend* stored in another; "upcast" converts the addend to the accumulator's dtype explicitly before
# adding. `representation_error` is the part of the error that comes only from storing 0.01 in the
# addend's dtype (count × (stored value − 0.01)); whatever is left is rounding of the partial sums.

# %%
acc = precision.accumulation_experiment(accumulation_value, accumulation_count)
results.save_results(acc, "mixed_precision_accumulation", results_dir, params)
report.show_table(acc.drop(columns=["exact"]), floatfmt=".6g")

# %%
row = acc.set_index(["accumulator", "addend", "upcast"])
fp16_acc = row.loc[("fp16", "fp16", False)]
fp32_acc16 = row.loc[("fp32", "fp16", True)]
bf16_acc = row.loc[("bf16", "bf16", False)]
fp32_acc32 = row.loc[("fp32", "fp32", False)]
report.say(
    f"Accumulating in fp16 ends at **{fp16_acc['result']:.6g}** (error {fp16_acc['abs_error']:.3g}); keeping the "
    f"same fp16 addends but accumulating in fp32 ends at **{fp32_acc16['result']:.6g}** (error "
    f"{fp32_acc16['abs_error']:.3g}), of which {abs(fp32_acc16['representation_error']):.3g} is just 0.01 being "
    f"stored as {fp32_acc16['addend_value']:.8g} in fp16. bf16, with only 8 significant bits, is the extreme "
    f"case: its accumulator stops growing at **{bf16_acc['result']:.6g}** "
    f"({bf16_acc['rel_error']:.0%} error) once 0.01 is less than half a unit in the last place of the sum. "
    f"Even fp32 accumulation is off by {fp32_acc32['abs_error']:.2g}. Whether the upcast is explicit or "
    f"implicit makes no difference here ({row.loc[('fp32', 'fp16', False), 'result']:.8g} vs "
    f"{fp32_acc16['result']:.8g}): what matters is the accumulator's dtype. This is why matmul kernels "
    f"accumulate in fp32 even when their inputs are fp16/bf16.")

# %% [markdown]
# ## 2. What autocast does to each tensor
#
# The toy model is `Linear → ReLU → LayerNorm → Linear`. Forward hooks record the dtype of each module's
# output, a tensor hook records the dtype of the gradient arriving at the logits, and after the backward
# the parameters' `.grad` dtypes are read. Nothing is asserted: this is what the current device's autocast
# does. (The same probe is run on the CPU as well when a GPU is present: the two autocast op lists differ.)

# %%
probe_devices = [dev] + ([torch.device("cpu")] if dev.type == "cuda" else [])
probe = {d.type: precision.autocast_dtype_table(device=d) for d in probe_devices}
for d, table in probe.items():
    report.say(f"**Observed dtypes on {d}**")
    report.show_table(table)
probe_long = pd.concat([t.assign(device=d) for d, t in probe.items()], ignore_index=True)
results.save_results(probe_long, "mixed_precision_autocast_dtypes", results_dir, params)

# %%
t = probe[dev.type].set_index("tensor")
def observed(tensor, col):
    return t.loc[tensor, col]
ln16, lnb = observed("ln output", "autocast fp16"), observed("ln output", "autocast bf16")
report.say(
    f"On {dev.type}, under fp16 autocast the parameters stay **{observed('param fc1.weight', 'autocast fp16')}** "
    f"(autocast casts copies for each op, never the weights), the first Linear's output is "
    f"**{observed('fc1 output', 'autocast fp16')}**, the LayerNorm output is **{ln16}**, the logits are "
    f"**{observed('logits', 'autocast fp16')}**, the loss is **{observed('loss', 'autocast fp16')}** and the "
    f"parameter gradients are **{observed('grad fc1.weight', 'autocast fp16')}** (a gradient has its "
    f"parameter's dtype; the gradient arriving at the logits is "
    f"{observed('grad logits', 'autocast fp16')}). bf16 autocast gives the same pattern with "
    f"{observed('fc1 output', 'autocast bf16')} activations and a {lnb} LayerNorm output.")
if "cpu" in probe and dev.type == "cuda":
    tc = probe["cpu"].set_index("tensor")
    report.say(
        f"The LayerNorm output differs between devices: **{t.loc['ln output', 'autocast bf16']}** on CUDA, where "
        f"`layer_norm` is on autocast's run-in-fp32 list, but **{tc.loc['ln output', 'autocast bf16']}** on the "
        f"CPU, whose autocast list lets `layer_norm` run in the low dtype (its kernel still accumulates the "
        f"statistics in fp32 internally).")

# %% [markdown]
# ## 3. Why normalisation statistics stay in fp32
#
# LayerNorm needs the mean and the variance of each row, RMSNorm the mean of squares. Below they are
# computed *naively* in each dtype (every elementwise result rounded to that dtype) for three kinds of
# activation, and compared with fp64: ordinary N(0, 1) values; large N(0, 300²) values, as residual streams
# of deep models reach; and N(100, 1) values, whose large mean LayerNorm must subtract.

# %%
norm = precision.norm_statistics_demo(d_model=norm_width)
results.save_results(norm, "mixed_precision_norm_statistics", results_dir, params)
report.show_table(norm.pivot_table(index=["input", "statistic"], columns="dtype", values="rel_error",
                                   aggfunc="first").reset_index(), floatfmt=".3g")

# %%
def n(inp, dt, st, col="value"):
    return norm[(norm["input"] == inp) & (norm["dtype"] == dt) & (norm["statistic"] == st)][col].iloc[0]
big = "N(0, 300^2)"
shift = next(i for i in norm["input"].unique() if i.startswith("N(") and i.endswith(", 1)"))
report.say(
    f"With activations of scale 300 the squares exceed fp16's largest finite value (65504): the fp16 mean of "
    f"squares is **{n(big, 'fp16', 'mean_square')}** and the normalised output is wrong by up to "
    f"{n(big, 'fp16', 'rms_output_max_error'):.3g} (it collapses to zero), while bf16, which has fp32's exponent "
    f"range, is within {n(big, 'bf16', 'mean_square', 'rel_error'):.2%}. bf16 pays for that range with "
    f"resolution: for {shift} activations the variance E[x²] − E[x]² should be "
    f"{n(shift, 'bf16', 'variance', 'reference'):.3g}, but bf16 gives **{n(shift, 'bf16', 'variance'):.3g}** and "
    f"fp16 {n(shift, 'fp16', 'variance'):.3g}, against fp32's {n(shift, 'fp32', 'variance'):.4g}: both squares "
    f"are near 10⁴, where one bf16 step is 64, so their difference is pure rounding (catastrophic "
    f"cancellation). Hence `lab.model.transformer.RMSNorm` upcasts to fp32 for its statistics, and CUDA autocast runs "
    f"`layer_norm` in fp32.")

# %% [markdown]
# ## 4. fp32 vs bf16 autocast: forward and forward+backward time for every size
#
# `lab.bench.lm.benchmark_lm` with modes `forward` and `forward_backward`; forward and forward+backward are
# separate runs, so a size whose backward does not fit still reports its forward. Rows go into the
# headline table `lm_step.csv`.

# %%
timings = precision.mixed_precision_timings(sizes, context=context, batch=batch, warmup=warmup, steps=steps,
                                            device=str(dev))
# keep notebook 01's train-step time where it measured the same configuration (same key in lm_step.csv)
results.save_results(timings, "lm_step", results_dir, params)  # keeps columns other notebooks measured
report.show_table(timings[["size", "dtype", "params", "fwd_ms", "fwd_std_ms", "fwdbwd_ms", "fwdbwd_std_ms",
                           "peak_gib", "status"]], floatfmt=".4g")

# %%
speed = precision.speedup_table(timings)
fig, ax = plt.subplots()
sns.lineplot(data=speed, x="params", y="speedup", hue="mode", marker="o", ax=ax)
for _, r in speed[speed["mode"] == "forward"].iterrows():
    if not math.isnan(r["speedup"]):
        ax.annotate(str(r["size"]), (r["params"], r["speedup"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
ax.axhline(1.0, color="grey", linestyle=":")
ax.set_xscale("log")
ax.set_xlabel("parameters")
ax.set_ylabel("speedup of bf16 autocast over fp32 (×)")
ax.set_title(f"bf16 autocast speedup, context {context}, batch {batch}")
plots.save_figure(fig, "02_bf16_speedup", results_dir)
plt.show()
report.show_table(speed, floatfmt=".3g")

# %%
ok = speed.dropna(subset=["speedup"])
fb = ok[ok["mode"] == "forward+backward"]
oom = timings[timings["status"] != "ok"]
if len(fb):
    lo, hi = fb.loc[fb["speedup"].idxmin()], fb.loc[fb["speedup"].idxmax()]
    verdict = "faster" if hi["speedup"] > 1 else "slower"
    report.say(
        f"bf16 autocast makes forward+backward between **{lo['speedup']:.2f}×** ({lo['size']}) and "
        f"**{hi['speedup']:.2f}×** ({hi['size']}) as fast as fp32 on {timings['device'].iloc[0]}; at the largest "
        f"measured size it is {verdict}. "
        + ("Larger models gain more: their time is dominated by matmuls, which run on bf16 tensor cores, while "
           "small models spend relatively more time in elementwise kernels and casts that autocast does not "
           "speed up (it adds casts)."
           if len(fb) > 1 and fb.sort_values("params")["speedup"].iloc[-1] > fb.sort_values("params")["speedup"].iloc[0]
           else "The gain does not grow with size here: at these sizes the step is not dominated by matmuls "
                "(casts and elementwise kernels are not faster in bf16)."))
if len(oom):
    report.say("Out of memory: " + "; ".join(f"{r['size']} {r['dtype']} ({r['error'].split(':')[0]})"
                                             for _, r in oom.iterrows()) + ".")
