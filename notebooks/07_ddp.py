# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Data-parallel training: hiding the all-reduce behind the backward pass
#
# Each rank holds the whole model and trains on its own part of the batch; before the optimizer step the
# gradients are averaged over ranks so every replica takes the same step. `lab.parallel.ddp` has four wrappers,
# each fixing a cost of the previous one:
#
# | wrapper | communication | what it costs |
# |---|---|---|
# | `NaiveDDP` | one blocking all-reduce per parameter, after backward | per-call latency × #parameters, no overlap |
# | `FlatDDP` | one all-reduce of all gradients flattened, after backward | one call, but still no overlap |
# | `DDPIndividualParameters` | async all-reduce per parameter from a post-accumulate-grad hook | overlaps backward, but many calls |
# | `DDPBucketed(bucket_size_mb)` | async all-reduce per bucket (reverse parameter order) as soon as it is full | overlap *and* few calls |
#
# and `torch.nn.parallel.DistributedDataParallel` is the reference. All of them match single-process
# training bit for bit in fp32 on the CPU (`tests/test_ddp.py`: gloo, 2 processes, tied and frozen
# parameters, gradient accumulation with `no_sync()`). Here we measure them: time per AdamW step, time
# spent in communication kernels, how much of it ran during backward, and the bucket size that balances
# per-call overhead against overlap. `batch` is per rank, and `single_gpu` is the same step on one device
# with that per-rank batch: the ideal a data-parallel step can approach.

# %% tags=["parameters"]
quick = True                      # tiny model with gloo on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"
artifacts_dir = "artifacts/quick"
world_size = 2
configs = None                    # None: xl fp32 and 2.7B bf16, batch 2 per rank, context 512 (full)
bucket_sizes_mb = None            # None: 1, 10, 100, 1000 (full) or 0.1, 1, 10 (quick)
warmup = 3
steps = 12

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch

from lab.bench import ddp as ddp_bench
from lab import paths
from lab.book import plots, report
from lab.measure import results

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
on_gpu = not quick and device != "cpu" and gpus >= world_size
if not quick and not on_gpu:
    report.say(f"The full profile needs {world_size} GPUs and this machine has {gpus}; running the CPU-sized "
               "version with gloo instead.")
if on_gpu:
    configs = configs or [dict(size="xl", dtype="fp32", batch=2, context=512),
                          dict(size="2.7B", dtype="bf16", batch=2, context=512)]
    bucket_sizes_mb = bucket_sizes_mb or [1, 10, 100, 1000]
else:
    configs = configs or [dict(size="tiny", dtype="fp32", batch=2, context=32)]
    bucket_sizes_mb = bucket_sizes_mb or [0.1, 1, 10]
    warmup, steps = min(warmup, 1), min(steps, 3)
run_device = "cuda" if on_gpu else "cpu"

params = dict(quick=quick, device=device, world_size=world_size, configs=configs,
              bucket_sizes_mb=bucket_sizes_mb, warmup=warmup, steps=steps, run_device=run_device)
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## Step time and communication time
#
# One launch per model: every wrapper in turn on the same model, `warmup` untimed steps, `steps` timed
# ones (a step's time is that of the slowest rank), then one step under `torch.profiler` on rank 0, whose
# communication kernels (NCCL on GPUs; gloo's worker-thread spans on the CPU) give `comm_ms`, and whose
# overlap with compute kernels gives `overlap_frac`. Chrome traces of every profiled step are saved under
# the artifacts folder (open them in Perfetto).

# %%
tables, timelines = [], {}
for cfg in configs:
    df, tl = ddp_bench.benchmark_ddp(cfg["size"], context=cfg["context"], batch=cfg["batch"], dtype=cfg["dtype"],
                                     world_size=world_size, device=run_device, bucket_sizes_mb=bucket_sizes_mb,
                                     warmup=warmup, steps=steps, artifacts_dir=artifacts_dir)
    tables.append(df)
    timelines[f"{cfg['size']} {cfg['dtype']}"] = tl
bench = pd.concat(tables, ignore_index=True)
bench["config"] = bench["size"] + " " + bench["dtype"]
bench["label"] = [f"{i} {b:g} MB" if i == "bucketed" else i for i, b in zip(bench["impl"], bench["bucket_mb"])]
cols = ["impl", "bucket_mb", "world_size", "size", "context", "batch", "dtype", "step_ms", "step_std_ms",
        "comm_ms", "overlap_frac", "n_buckets", "grad_mb", "status"]
results.save_results(bench[cols + ["trace"]], "ddp_benchmark", results_dir, params)
report.show_table(bench[["config", "label"] + cols[7:]], floatfmt=".3g")
report.say("Chrome traces: " + ", ".join(f"`{paths.resolve(p).name}`" for p in bench["trace"].dropna().unique()[:4])
           + f" … in `{artifacts_dir}/ddp_traces/`.")

# %%
ok = bench[bench["status"] == "ok"]
fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
for ax, (config, part) in zip(axes[0], ok.groupby("config", sort=False)):
    order = part.sort_values("step_ms")
    ax.barh(order["label"], order["step_ms"], color="tab:blue", label="step")
    ax.barh(order["label"], order["comm_ms"], color="tab:orange", alpha=0.8, label="communication kernels")
    single = part.loc[part["impl"] == "single_gpu", "step_ms"]
    if len(single):
        ax.axvline(single.item(), color="k", ls="--", lw=1, label="single device")
    ax.set(title=config, xlabel="ms per AdamW step")
    ax.invert_yaxis()
axes[0][0].legend(loc="lower right", fontsize=8)
fig.tight_layout()
plt.show()

for config, part in ok.groupby("config", sort=False):
    p = part.set_index("label")
    single = p.loc["single_gpu", "step_ms"] if "single_gpu" in p.index else math.nan
    bucketed = part[part["impl"] == "bucketed"].sort_values("step_ms")
    text = [f"**{config}:** the single-device step takes {single:.1f} ms."]
    if "naive" in p.index and "flat" in p.index:
        text.append(f"Naive DDP takes {p.loc['naive', 'step_ms']:.1f} ms ({p.loc['naive', 'n_buckets']:.0f} "
                    f"all-reduce calls, {p.loc['naive', 'comm_ms']:.1f} ms in communication kernels); one flat "
                    f"call takes {p.loc['flat', 'step_ms']:.1f} ms.")
    if "individual" in p.index:
        text.append(f"Overlapping per-parameter all-reduces with backward: {p.loc['individual', 'step_ms']:.1f} ms, "
                    f"with {100 * p.loc['individual', 'overlap_frac']:.0f}% of the communication time running "
                    "beside compute.")
    if len(bucketed):
        best = bucketed.iloc[0]
        text.append(f"The best bucket size measured is {best.bucket_mb:g} MB ({best.n_buckets:.0f} "
                    f"bucket{'s' if best.n_buckets != 1 else ''}): "
                    f"{best.step_ms:.1f} ms, {100 * best.overlap_frac:.0f}% of its communication overlapped.")
    if "torch_ddp" in p.index:
        text.append(f"PyTorch's DistributedDataParallel: {p.loc['torch_ddp', 'step_ms']:.1f} ms.")
    report.say(" ".join(text))

# %% [markdown]
# ## Timelines: does communication overlap the backward pass?
#
# Rank 0's profiled step, drawn from the profiler's events: the step's phases (from `record_function`
# ranges), the compute kernels and the communication kernels. Naive communicates only after backward has
# finished; the hook-based wrappers start during backward.

# %%
# the last configuration that has profiled timelines (a configuration whose runs all ran out of memory has none)
key = [k for k in timelines if timelines[k]][-1]
tl = timelines[key]
cfg_rows = ok[ok["config"] == key]
best_bucket = cfg_rows[cfg_rows["impl"] == "bucketed"].sort_values("step_ms")
shown = [k for k in ["naive", "flat", "individual",
                     f"bucketed_{best_bucket.iloc[0].bucket_mb:g}" if len(best_bucket) else None, "torch_ddp"]
         if k in tl]
fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.9 * len(shown)), sharex=True)
for ax, name in zip(np.atleast_1d(axes), shown):
    summary = ddp_bench.summarize_timeline(tl[name])
    ddp_bench.plot_timeline(tl[name], ax, f"{key}: {name.replace('_', ' ')} MB".replace("MB MB", "MB")
                            if name.startswith("bucketed") else f"{key}: {name}")
fig.tight_layout()
plots.save_figure(fig, "ddp_timelines", results_dir)
plt.show()

overlap = pd.DataFrame([{"impl": name, **ddp_bench.summarize_timeline(tl[name])} for name in shown])
report.show_table(overlap, floatfmt=".3g")
naive_overlap = overlap.set_index("impl")["overlap_frac"].get("naive", math.nan)
hooked = overlap[overlap["impl"].str.startswith(("individual", "bucketed"))]
if len(hooked) and not math.isnan(naive_overlap):
    lo, hi = hooked["overlap_frac"].min(), hooked["overlap_frac"].max()
    verdict = ("their all-reduces start while backward is still producing gradients" if lo > naive_overlap + 0.1
               else "here not all of them manage to run beside compute: a bucket can only start when its last "
                    "gradient is ready, and with few buckets (or a fast backward) that is at the very end")
    report.say(f"In {key}, {100 * naive_overlap:.0f}% of naive DDP's communication time runs beside compute, "
               f"against {100 * lo:.0f}–{100 * hi:.0f}% for the hook-based wrappers: {verdict}.")


# %% [markdown]
# ## The bucketed overhead model
#
# Let the gradients total $s$ bytes in $n$ buckets, each all-reduce call cost a fixed overhead $o$ plus
# its bytes over the bandwidth $w$. If backward produces gradients about as fast as the links carry them,
# each bucket's transfer hides behind the backward of the next one, except that (i) every call's fixed
# overhead is not hidden and the delays pile up, $n\,o$, and (ii) the last bucket can only start when
# backward ends, $s/(n w)$. The time a data-parallel step adds to the single-device step is then
#
# $$T_{\text{overhead}}(n) \approx n\,o + \frac{s}{n\,w},\qquad
#   n^\star = \sqrt{\frac{s}{w\,o}},\qquad b^\star = \frac{s}{n^\star} = \sqrt{s\,w\,o},\qquad
#   T^\star = 2\sqrt{\frac{s\,o}{w}}.$$
#
# Flat DDP is the point $n = 1$ (one call, all of it after backward) and the per-parameter wrapper the
# point $n = \#\text{parameters}$. We fit $o$ and $w$ to the measured overheads (step − single-device
# step) of these wrappers and compare with the latency and bandwidth measured for a lone all-reduce in
# notebook 06.

# %%
try:
    alpha_beta = results.load_results("collectives_latency_bandwidth", results_dir)
    backend = "nccl" if on_gpu else "gloo"
    ab = alpha_beta[(alpha_beta["backend"] == backend) & (alpha_beta["op"] == "all_reduce")
                    & (alpha_beta["world_size"] == world_size)]
except FileNotFoundError:
    ab = pd.DataFrame()

model_rows, curves = [], []
for config, part in ok.groupby("config", sort=False):
    single = part.loc[part["impl"] == "single_gpu", "step_ms"]
    points = part[part["impl"].isin(["flat", "individual", "bucketed"])].copy()
    if single.empty or len(points) < 2:
        continue
    total = points["grad_mb"].iloc[0] * 2**20
    points["overhead_ms"] = points["step_ms"] - single.item()
    fit = ddp_bench.fit_bucket_overhead(points["n_buckets"], points["overhead_ms"], total)
    row = {"config": config, "grad_mb": total / 2**20, "fit_o_ms": fit["o_ms"], "fit_w_gbps": fit["w_gbps"]}
    if fit["o_ms"] > 0 and fit["w_gbps"] > 0:
        opt = ddp_bench.optimal_bucket(total, fit["o_ms"], fit["w_gbps"])
        row.update(fit_best_bucket_mb=opt["bucket_mb"], fit_best_overhead_ms=opt["overhead_ms"])
    if len(ab):
        o6, w6 = ab["latency_ms"].item(), ab["bandwidth_gbps"].item()
        row.update(nb06_o_ms=o6, nb06_w_gbps=w6)
        if o6 > 0 and w6 > 0:
            row["nb06_best_bucket_mb"] = ddp_bench.optimal_bucket(total, o6, w6)["bucket_mb"]
    best = points[points["impl"] == "bucketed"].sort_values("step_ms")
    row["measured_best_bucket_mb"] = best.iloc[0]["bucket_mb"] if len(best) else math.nan
    model_rows.append(row)
    points["predicted_ms"] = fit["predicted_ms"]
    points["config"] = config
    curves.append(points)
model_table = pd.DataFrame(model_rows)
if len(model_table):
    report.show_table(model_table, floatfmt=".3g")
    results.save_results(model_table, "ddp_overhead_model", results_dir, params)

# %%
if curves:
    pts = pd.concat(curves, ignore_index=True)
    fig, axes = plt.subplots(1, pts["config"].nunique(), figsize=(6 * pts["config"].nunique(), 4), squeeze=False)
    for ax, ((config, part), mrow) in zip(axes[0], zip(pts.groupby("config", sort=False), model_rows)):
        sns.scatterplot(data=part, x="n_buckets", y="overhead_ms", hue="impl", s=60, ax=ax)
        grid = np.logspace(0, np.log10(max(part["n_buckets"].max(), 2) * 1.5), 100)
        o, w = mrow["fit_o_ms"], mrow["fit_w_gbps"]
        o = 0.0 if math.isnan(o) else o
        model = o * grid + (mrow["grad_mb"] * 2**20 / grid / (w * 1e6) if not math.isnan(w) else 0 * grid)
        ax.plot(grid, model, "k--", lw=1, label="fitted n·o + s/(n·w)")
        for _, r in part[part["impl"] == "bucketed"].iterrows():
            ax.annotate(f"{r.bucket_mb:g} MB", (r.n_buckets, r.overhead_ms), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set(xscale="log", title=config, xlabel="number of all-reduce calls (buckets)",
               ylabel="step − single-device step (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

    def duration(ms):
        return f"{ms:.3g} ms" if ms >= 1 else f"{ms * 1e3:.3g} µs"

    for mrow in model_rows:
        o, w = mrow["fit_o_ms"], mrow["fit_w_gbps"]
        text = f"**{mrow['config']}** ({mrow['grad_mb']:.0f} MiB of gradients): "
        if not math.isnan(o) and not math.isnan(w):
            text += (f"the fit gives o = {duration(o)} per call and w = {w:.3g} GB/s, so the model's optimal "
                     f"bucket is {mrow['fit_best_bucket_mb']:.3g} MB (overhead {mrow['fit_best_overhead_ms']:.3g} ms); ")
        else:
            text += ("the measured overheads do not support both terms of the model (one fitted coefficient is "
                     "not positive: overlap hides more, or noise is larger, than the model assumes); ")
        text += f"the best measured bucket size is {mrow['measured_best_bucket_mb']:g} MB."
        if "nb06_o_ms" in mrow and not math.isnan(mrow.get("nb06_best_bucket_mb", math.nan)):
            text += (f" A lone all-reduce in notebook 06 had {duration(mrow['nb06_o_ms'])} latency and "
                     f"{mrow['nb06_w_gbps']:.3g} GB/s, which would put the optimum at "
                     f"{mrow['nb06_best_bucket_mb']:.3g} MB.")
        report.say(text)

# %% [markdown]
# ## The performance goal
#
# The best bucketed step should be no slower than PyTorch DDP's and within 1.1× of the single-device step
# at the same per-rank batch (the goal is set for the 2.7B model in bf16 autocast, batch 2 per rank,
# context 512, on two GPUs).

# %%
goal_key = next((k for k in ok["config"].unique() if k.startswith("2.7B")), ok["config"].unique()[-1])
g = ok[ok["config"] == goal_key]
best = g[g["impl"] == "bucketed"].sort_values("step_ms")
torch_ddp = g.loc[g["impl"] == "torch_ddp", "step_ms"]
single = g.loc[g["impl"] == "single_gpu", "step_ms"]
if len(best) and len(torch_ddp) and len(single):
    b = best.iloc[0]
    vs_torch, vs_single = b.step_ms / torch_ddp.item(), b.step_ms / single.item()
    met = vs_torch <= 1.0 and vs_single <= 1.1
    report.say(f"**{goal_key}, {world_size} ranks on {'GPUs' if on_gpu else 'CPU processes (gloo)'}:** best bucketed "
               f"({b.bucket_mb:g} MB) {b.step_ms:.1f} ± {b.step_std_ms:.1f} ms, PyTorch DDP {torch_ddp.item():.1f} ms, "
               f"single device {single.item():.1f} ms: {vs_torch:.2f}× PyTorch DDP and {vs_single:.2f}× the "
               f"single-device step. Goal {'met' if met else 'not met'}"
               + ("." if met else f" ({'slower than PyTorch DDP' if vs_torch > 1 else ''}"
                  f"{' and ' if vs_torch > 1 and vs_single > 1.1 else ''}"
                  f"{'more than 1.1x the single-device step' if vs_single > 1.1 else ''})."))
    spread = b.step_std_ms + g.loc[g["impl"] == "torch_ddp", "step_std_ms"].item()
    if abs(b.step_ms - torch_ddp.item()) < spread:
        report.say(f"The gap to PyTorch DDP ({abs(b.step_ms - torch_ddp.item()):.1f} ms) is within the two "
                   f"measurements' combined standard deviation ({spread:.1f} ms): treat them as equal.")
else:
    report.say("The goal comparison needs bucketed, torch_ddp and single_gpu rows; some are missing or OOM.")
