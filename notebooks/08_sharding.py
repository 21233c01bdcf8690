# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Sharding: optimizer state, ZeRO-1 and FSDP
#
# Data parallelism keeps a full copy of everything on every GPU: fp32 parameters (4 bytes each), their
# gradients (4) and AdamW's two moments (8). This notebook divides those copies over the ranks, one piece
# at a time, and measures what it saves and what it costs:
#
# * **`lab.ShardedOptimizer`**: each rank keeps AdamW's state for only its share of the parameters
#   (balanced by size), updates that share and broadcasts it. Gradients are still all-reduced by DDP.
# * **ZeRO-1** (`lab.parallel.zero1.ZeRO1Optimizer`): the same saving, but the all-reduce becomes a reduce-scatter
#   (bucketed, overlapping backward), the update happens on the local slice, and an all-gather returns the
#   parameters, so it communicates exactly what DDP does.
# * **`lab.FSDP`**: parameters and gradients are sharded too; each layer's weights (a layer is a transformer
#   block: seven matrices in one collective) are all-gathered just before use (two layers ahead) and
#   dropped right after, and gradients are reduce-scattered, one collective per block.
#
# Each is compared with PyTorch's own: `DistributedDataParallel`, `ZeroRedundancyOptimizer` and FSDP2
# (`fully_shard`). Every number in the prose is computed from the result tables.

# %% tags=["parameters"]
quick = True                      # tiny model, gloo on the CPU; the full render sets False
device = "auto"                   # "auto": NCCL on GPUs when there are enough, else gloo on the CPU
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
sizes = None                      # None: xl and 2.7B (full) or tiny (quick)
impls = ["ddp", "sharded_optimizer", "zero1", "fsdp", "torch_zero", "torch_fsdp2"]
world_size = 2
context = None                    # None: 512 (full) or 64 (quick)
batch = 2                         # per rank
dtype = "bf16"                    # autocast dtype (and FSDP's compute dtype)
fsdp_reduce_dtype = None          # None: reduce-scatter in the compute dtype, as FSDP2 does by default
warmup = 2
steps = 8
profile_impl = "fsdp"             # its step is profiled: compute vs communication on a timeline

# %%
import math

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from lab.book import plots, report
from lab.measure import results
from lab.bench import sharding as sb
from lab.model.transformer import TransformerLM, config_for
from lab.parallel.sharded_optimizer import optimizer_traffic

if quick:
    sizes = sizes or ["tiny"]
    context = context or 64
    warmup, steps = min(warmup, 1), min(steps, 3)
else:
    sizes = sizes or ["xl", "2.7B"]
    context = context or 512
if device == "auto":
    device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"

params = dict(quick=quick, device=device, sizes=sizes, impls=impls, world_size=world_size, context=context,
              batch=batch, dtype=dtype, fsdp_reduce_dtype=fsdp_reduce_dtype, warmup=warmup, steps=steps,
              profile_impl=profile_impl)
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## What each scheme should save: the closed form
#
# Per rank, with $P$ parameters and $N$ ranks: parameters $4P$, gradients $4P$, AdamW state $8P$ bytes;
# optimizer sharding divides the $8P$ by $N$, FSDP divides all three. Parameter counts come from the model
# built on the meta device (no memory).

# %%
def count_params(size):
    with torch.device("meta"):
        return TransformerLM(config_for(size)).num_parameters()

GiB = 2**30
expected = pd.DataFrame([{"size": s, "impl": i, "params_M": count_params(s) / 1e6,
                          **{f"{k}_gib": v / GiB for k, v in sb.expected_state_bytes(i, count_params(s), world_size).items()}}
                         for s in sizes for i in impls])
report.show_table(expected, floatfmt=".2f")
e = expected.set_index(["size", "impl"])
s0 = sizes[-1]
report.say(f"For the {s0} model ({e.loc[(s0, 'ddp'), 'params_M']:.0f} M parameters) on {world_size} ranks, "
           f"DDP holds {e.loc[(s0, 'ddp'), 'total_gib']:.2f} GiB of state per rank; sharding the optimizer state "
           f"cuts that to {e.loc[(s0, 'zero1'), 'total_gib']:.2f} GiB "
           f"({1 - e.loc[(s0, 'zero1'), 'total_gib'] / e.loc[(s0, 'ddp'), 'total_gib']:.0%} less) and FSDP to "
           f"{e.loc[(s0, 'fsdp'), 'total_gib']:.2f} GiB ({1 - e.loc[(s0, 'fsdp'), 'total_gib'] / e.loc[(s0, 'ddp'), 'total_gib']:.0%} less), "
           "before activations.")

# %% [markdown]
# ## What each scheme communicates
#
# Bytes each rank sends per step on a ring (all-reduce $2\frac{N-1}{N}S$, reduce-scatter and all-gather
# $\frac{N-1}{N}S$ each, a pipelined broadcast $\frac{N-1}{N}S$ per rank on average). The closed form
# (`lab.parallel.sharded_optimizer.optimizer_traffic`) next to what the code actually issued in one step of a tiny
# model (`lab.bench.sharding.measure_traffic`: every collective is recorded by a `TrafficLog`).

# %%
closed = optimizer_traffic(count_params(s0), world_size)
closed_gib = closed.assign(gradient_gib=closed["gradient_bytes"] / GiB, parameter_gib=closed["parameter_bytes"] / GiB,
                           total_gib=closed["total_bytes"] / GiB)
report.show_table(closed_gib[["impl", "gradient_collective", "gradient_gib", "parameter_collective", "parameter_gib",
                              "total_gib", "ratio_to_ddp"]], floatfmt=".2f")
traffic = sb.measure_traffic("tiny", world_size, context=64, device="cpu")
report.show_table(traffic, floatfmt=".4g")
ct = closed.set_index("impl")
tt = traffic.groupby("impl")["measured_ratio_to_ddp"].first()
matches = traffic.dropna(subset=["expected_bytes"])
agree = bool((matches["measured_bytes"] == matches["expected_bytes"]).all())
report.say(f"The recorded collectives {'match' if agree else 'do NOT match'} the closed form for DDP, the "
           "sharded optimizer and ZeRO-1 byte for byte.")
report.say(f"Per step on the {s0} model, DDP sends {ct.loc['ddp', 'total_bytes'] / GiB:.2f} GiB per rank. "
           f"The simple sharded optimizer adds a broadcast of every parameter: "
           f"{ct.loc['sharded_optimizer', 'total_bytes'] / GiB:.2f} GiB ({ct.loc['sharded_optimizer', 'ratio_to_ddp']:.2f}x DDP). "
           f"ZeRO-1 replaces the all-reduce by a reduce-scatter and an all-gather and sends "
           f"{ct.loc['zero1', 'total_bytes'] / GiB:.2f} GiB ({ct.loc['zero1', 'ratio_to_ddp']:.2f}x). Measured on the tiny "
           f"model: {tt['sharded_optimizer']:.2f}x and {tt['zero1']:.2f}x DDP; FSDP (fp32, parameters gathered in "
           f"forward and again in backward) {tt['fsdp']:.2f}x.")

# %% [markdown]
# ## The benchmark: memory by phase and step time
#
# Each implementation runs in fresh processes (one per GPU), trains with AdamW under `dtype` autocast on
# `batch` sequences per rank, and records the CUDA allocator's peak during model + optimizer construction
# (init), during forward + backward of a steady-state step (before the optimizer step), and during the
# optimizer step. Step time is the mean over `steps` steps after `warmup`, each step counted at its slowest
# rank. Out-of-memory is a row, not a crash.

# %%
df, timelines = sb.run_sharding_benchmark(impls, sizes, world_size, context, batch, dtype, warmup, steps,
                                          device=device, artifacts_dir=artifacts_dir, profile_impl=profile_impl,
                                          fsdp_reduce_dtype=fsdp_reduce_dtype)
results.save_results(df, "sharding_benchmark", results_dir, params)
report.show_table(df[["impl", "size", "status", "step_ms", "step_std_ms", "peak_init_gib", "peak_before_step_gib",
                      "peak_after_step_gib", "reduce_dtype"]], floatfmt=".3g")
failed = df[df["status"] != "ok"]
if len(failed):
    report.show_table(failed[["impl", "size", "status", "error"]])

# %%
ok = df[df["status"] == "ok"]
have_peaks = ok["peak_after_step_gib"].notna().any()
long = ok.melt(id_vars=["impl", "size"], value_vars=["peak_init_gib", "peak_before_step_gib", "peak_after_step_gib"],
               var_name="phase", value_name="gib")
long["phase"] = long["phase"].str.replace("peak_", "").str.replace("_gib", "")
if have_peaks:
    g = sns.catplot(long, x="impl", y="gib", hue="phase", col="size", kind="bar", height=3.8, aspect=1.5,
                    errorbar=None)
    g.set_xticklabels(rotation=30)
    g.set_axis_labels("", "peak memory per rank (GiB)")
    plots.save_figure(g.figure, "sharding_peak_memory", results_dir)
    plt.show()
else:
    report.say("No CUDA allocator statistics on the CPU: the peak columns stay empty in this render.")
g = sns.catplot(ok, x="impl", y="step_ms", col="size", kind="bar", height=3.8, aspect=1.5, errorbar=None,
                sharey=False)
g.set_xticklabels(rotation=30)
g.set_axis_labels("", "step time (ms)")
plt.show()

# %% [markdown]
# ## Where the memory goes: parameters, gradients, optimizer state, activations
#
# The bytes of this rank's parameter, gradient and optimizer-state tensors (counted from the tensors
# themselves; the largest rank), next to the closed form. "Activations + transients" is the peak before
# the step minus those three: saved activations, autocast's bf16 weight copies, gathered weights and
# communication buffers at the moment of the peak.

# %%
breakdown = sb.memory_breakdown(df)
report.show_table(breakdown, floatfmt=".3g")
states = breakdown[breakdown["part"] != "activations + transients"]
worst = (states["ratio"] - 1).abs().max()
report.say(f"Across {len(ok)} configurations the measured parameter, gradient and optimizer-state bytes are "
           f"within {worst:.2%} of the closed form (4 + 4 + 8 bytes per parameter, divided by {world_size} where "
           "sharded); the small excess is padding to a multiple of the world size and the size balance of the "
           "sharded optimizer.")
if have_peaks:
    pivot = breakdown.pivot_table(index=["size", "impl"], columns="part", values="measured_gib").reset_index()
    fig, ax = plt.subplots(figsize=(11, 4))
    parts = ["parameters", "gradients", "optimizer state", "activations + transients"]
    bottom = 0
    labels = pivot["impl"] + " / " + pivot["size"]
    for part in parts:
        ax.bar(labels, pivot[part], bottom=bottom, label=part)
        bottom = bottom + pivot[part]
    ax.set_ylabel("GiB per rank at the peak before the step")
    ax.tick_params(axis="x", rotation=40)
    ax.legend()
    plt.show()

# %% [markdown]
# ## Sharded optimizer vs ZeRO-1 vs the references

# %%
t = ok.set_index(["size", "impl"])


def gib(x):
    return "n/a (no GPU)" if pd.isna(x) else f"{x:.1f} GiB"


for size in sizes:
    def get(impl, col, size=size):
        return t[col].get((size, impl), math.nan)
    report.say(
        f"**{size}**: DDP steps in {get('ddp', 'step_ms'):.1f} ms with a peak during the optimizer step of "
        f"{gib(get('ddp', 'peak_after_step_gib'))}. The sharded optimizer: {get('sharded_optimizer', 'step_ms'):.1f} ms, "
        f"{gib(get('sharded_optimizer', 'peak_after_step_gib'))}; ZeRO-1: {get('zero1', 'step_ms'):.1f} ms, "
        f"{gib(get('zero1', 'peak_after_step_gib'))}; torch's ZeroRedundancyOptimizer: {get('torch_zero', 'step_ms'):.1f} ms, "
        f"{gib(get('torch_zero', 'peak_after_step_gib'))}. FSDP: {get('fsdp', 'step_ms'):.1f} ms, overall peak "
        f"{gib(get('fsdp', 'peak_gib'))}; FSDP2: {get('torch_fsdp2', 'step_ms'):.1f} ms, {gib(get('torch_fsdp2', 'peak_gib'))}.")
report.say(
    "How the simple sharded optimizer differs from ZeRO stage 1: both keep the optimizer state of "
    f"1/{world_size} of the parameters per rank (the optimizer-state rows above), but the sharded optimizer "
    "keeps DDP's all-reduce and then broadcasts every parameter from its owner, "
    f"{ct.loc['sharded_optimizer', 'ratio_to_ddp']:.2f}x DDP's traffic, while ZeRO-1 reduce-scatters the gradients "
    f"into the slice each rank updates and all-gathers the result, {ct.loc['zero1', 'ratio_to_ddp']:.2f}x. "
    "ZeRO-1 needs no DDP wrapper: its gradients live in bucketed flat buffers, and each bucket's reduce-scatter "
    "starts during backward as soon as the bucket's gradients exist (as DDP's bucketed all-reduce does). Both "
    "then update chunk by chunk and launch each chunk's broadcast (sharded optimizer) or all-gather (ZeRO-1) "
    "while the next chunk is being updated, which also keeps a foreach AdamW's temporaries to one chunk "
    "instead of the whole share; torch's ZeroRedundancyOptimizer steps its whole share first and broadcasts after.")

# %% [markdown]
# ## The performance goals
#
# Sharded optimizer and ZeRO-1: no more memory after the step than `ZeroRedundancyOptimizer`, and at least
# as fast. FSDP with bf16 compute: at least as fast as FSDP2, with at most 1.1x its peak memory.

# %%
goals = sb.performance_goals(df)
report.show_table(goals, floatfmt=".3g")
decided = goals.dropna(subset=["met"])
if len(decided):
    met = decided[decided["met"].astype(bool)]
    report.say(f"{len(met)} of {len(decided)} checks are met on this machine"
               + ("" if len(met) == len(decided) else ": not met — " + "; ".join(
                   f"{r.impl} {r.goal} on {r.size} ({r.value:.3g} vs {r.reference:.3g})"
                   for r in decided[~decided["met"].astype(bool)].itertuples())) + ".")
undecided = goals[goals["met"].isna()]
if len(undecided):
    report.say(f"{len(undecided)} checks cannot be decided from this run (peak memory needs the CUDA allocator, "
               "or a configuration did not run).")

# %% [markdown]
# ## FSDP: do the all-gathers finish before the forward needs them?
#
# One profiled training step of `profile_impl` (rank 0). On a GPU the lanes are CUDA streams: compute
# kernels in blue, NCCL kernels in orange; on the CPU they are the main thread's operators and gloo's worker
# threads. If the prefetched all-gathers arrive in time, the compute lane has no gaps during the forward
# (shaded green) and the communication hides under compute.

# %%
def verdict(size, summary, fwd) -> str:
    """What keeps the compute lane idle in the forward: late all-gathers, or the host not launching kernels."""
    idle, exposed = fwd["compute_idle_ms"], fwd["exposed_communication_ms"]
    if idle <= 0.1 * fwd["window_ms"]:
        return "The all-gathers finish before the layers need them and the compute lane has no gaps to speak of."
    if exposed >= 0.5 * idle:
        return "Most of the idle time is exposed communication: the gathers are on the critical path at this size."
    text = (f"Exposed communication accounts for only {exposed / idle:.0%} of the idle time: the gathers arrive "
            "in time, and the rest of the gap is the host launching kernels one after another slower than the GPU "
            "runs them (a host-bound step at this batch size).")
    step = summary.set_index("phase")["window_ms"].get("step")
    if (size, profile_impl) in t.index and step is not None:
        timed = t.loc[(size, profile_impl), "step_ms"]
        text += (f" The profiler adds host work of its own: this profiled step took {step:.0f} ms, the timed steps "
                 f"{timed:.0f} ms.")
    return text


for size, tl in timelines.items():
    fig, ax = plt.subplots(figsize=(12, 3.4))
    sb.plot_timeline(tl, title=f"{profile_impl}, {size}: one training step on rank 0", ax=ax)
    plots.save_figure(fig, f"sharding_timeline_{profile_impl}_{size}", results_dir)
    plt.show()
    summary = sb.overlap_summary(tl)
    report.show_table(summary, floatfmt=".3g")
    fwd = summary.set_index("phase").loc["forward"] if "forward" in set(summary["phase"]) else None
    if fwd is not None:
        report.say(f"{size}: in the forward ({fwd['window_ms']:.1f} ms) the compute lane is busy "
                   f"{fwd['compute_ms']:.1f} ms and idle {fwd['compute_idle_ms']:.1f} ms "
                   f"({fwd['compute_idle_ms'] / fwd['window_ms']:.0%}); {fwd['overlap_share']:.0%} of the "
                   f"{fwd['communication_ms']:.1f} ms of communication overlaps compute, "
                   f"{fwd['exposed_communication_ms']:.1f} ms is exposed. " + verdict(size, summary, fwd))

# %% [markdown]
# ## FSDP memory saving: expected vs measured

# %%
if have_peaks:
    rows = []
    for size in sizes:
        d, f = t.loc[(size, "ddp")] if (size, "ddp") in t.index else None, \
            t.loc[(size, "fsdp")] if (size, "fsdp") in t.index else None
        if d is None or f is None:
            continue
        exp_d, exp_f = e.loc[(size, "ddp"), "total_gib"], e.loc[(size, "fsdp"), "total_gib"]
        meas_d = d["param_gib"] + d["grad_gib"] + d["optimizer_state_gib"]
        meas_f = f["param_gib"] + f["grad_gib"] + f["optimizer_state_gib"]
        rows.append(dict(size=size, expected_saving_gib=exp_d - exp_f, measured_state_saving_gib=meas_d - meas_f,
                         measured_peak_saving_gib=d["peak_gib"] - f["peak_gib"]))
    saving = pd.DataFrame(rows)
    report.show_table(saving, floatfmt=".2f")
    for r in saving.itertuples():
        report.say(f"{r.size}: the closed form says FSDP saves {r.expected_saving_gib:.1f} GiB of state per rank "
                   f"over DDP; the state tensors measure {r.measured_state_saving_gib:.1f} GiB less and the peak is "
                   f"{r.measured_peak_saving_gib:.1f} GiB lower (the peak also moves with activations and transient "
                   "buffers: autocast's weight copies in DDP, gathered weights in FSDP).")
else:
    report.say("Peak memory needs the CUDA allocator's statistics; this render ran on the CPU, so only the "
               "tensor accounting above is measured. The full render on GPUs fills this section.")
