# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Communication: how fast ranks can exchange tensors
#
# Data parallelism and sharding are built from three collectives: **all-reduce** (every rank ends with the
# sum of everyone's tensor: gradient averaging), **all-gather** (every rank ends with everyone's shard:
# FSDP's weights) and **reduce-scatter** (every rank ends with the sum of one shard: FSDP's gradients).
# Here we time them for float32 tensors from 1 MiB to 1 GiB, with gloo between CPU processes and with NCCL
# between GPUs, and turn the times into bandwidths that can be compared with the hardware.
#
# Conventions (those of nccl-tests): *size* is the full tensor (the all-reduced buffer, the gathered
# output, the reduce-scatter input). **Algorithm bandwidth** is size / time. **Bus bandwidth** rescales it
# by the traffic each link carries on an optimal ring: ×2(n−1)/n for all-reduce (a reduce-scatter followed
# by an all-gather) and ×(n−1)/n for all-gather and reduce-scatter, so it can be compared with a link's
# bandwidth whatever the number of ranks. Each timed call starts after a barrier and ends with a device
# synchronize; a call's time is that of its **slowest** rank (the collective is done when its last rank
# is), averaged over iterations. Before timing, one call on known integer inputs checks the result values.

# %% tags=["parameters"]
quick = True                      # gloo with small tensors only; the full render sets False
device = "auto"                   # "auto": NCCL on the GPUs if there are any, gloo on the CPU always
results_dir = "results/quick"
artifacts_dir = "artifacts/quick"
ops = ["all_reduce", "all_gather", "reduce_scatter"]
sizes_mb = [1, 10, 100, 1024]     # MiB of float32 (1024 MiB is 1 GiB)
gloo_sizes_mb = None              # None: [1, 10] (quick) or [1, 10, 100] (full: gloo at 1 GiB takes minutes)
world_sizes = [2, 4, 6]           # NCCL: one rank per GPU, as many as the machine has
gloo_world_sizes = [2]            # CPU processes
warmup = 5
iters = 10

# %%
import pandas as pd
import matplotlib.pyplot as plt
import seaborn as sns
import torch

from lab.bench import collectives
from lab.book import report, plots
from lab.measure import results

if quick:
    gloo_sizes_mb = gloo_sizes_mb or [1, 10]
    warmup, iters = min(warmup, 2), min(iters, 5)
else:
    gloo_sizes_mb = gloo_sizes_mb or [s for s in sizes_mb if s <= 100]
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
use_nccl = device != "cpu" and gpus > 0 and not quick

params = dict(quick=quick, device=device, ops=ops, sizes_mb=sizes_mb, gloo_sizes_mb=gloo_sizes_mb,
              world_sizes=world_sizes, gloo_world_sizes=gloo_world_sizes, warmup=warmup, iters=iters)
plots.set_style()
report.show_machine(params)

# %% [markdown]
# ## gloo between CPU processes
#
# gloo moves tensors through host memory and TCP on the loopback device; it is what the quick profile and
# the CPU tests use. Fewer warm-up and timed iterations on the CPU keep the run short.

# %%
gloo = collectives.benchmark_collectives(ops, gloo_sizes_mb, gloo_world_sizes, device="cpu",
                                         warmup=min(warmup, 2), iters=min(iters, 5))
report.show_table(gloo[["backend", "op", "world_size", "size_mb", "time_ms", "time_ms_rank_mean", "algbw_gbps",
                        "busbw_gbps", "correct", "status"]])

# %% [markdown]
# ## NCCL between GPUs
#
# One rank per GPU; world sizes larger than the GPU count are skipped.

# %%
if use_nccl:
    nccl_world_sizes, skipped_msg = collectives.plan_world_sizes(world_sizes, "cuda")
    nccl = collectives.benchmark_collectives(ops, sizes_mb, nccl_world_sizes, device="cuda", warmup=warmup,
                                             iters=iters) if nccl_world_sizes else pd.DataFrame()
    if skipped_msg:
        report.say(skipped_msg)
    if not nccl.empty:
        report.show_table(nccl[["backend", "op", "world_size", "size_mb", "time_ms", "time_ms_rank_mean",
                                "algbw_gbps", "busbw_gbps", "correct", "status"]])
else:
    nccl = pd.DataFrame()
    report.say("NCCL part skipped: " + ("the quick profile measures gloo only." if quick else
               f"this machine has {gpus} GPU(s) and device={device!r}."))

# %%
table = pd.concat([gloo, nccl], ignore_index=True)
results.save_results(table, "collectives", results_dir, params)
fits = collectives.latency_bandwidth_fit(table)
results.save_results(fits, "collectives_latency_bandwidth", results_dir, params)
assert table.loc[table["status"] == "ok", "correct"].all(), "a collective returned wrong values"
ok = table[table["status"] == "ok"]
report.say(f"All {len(ok)} measured collectives returned the values expected from their inputs "
           f"(checked element by element against closed forms).")

# %% [markdown]
# ## Bandwidth against message size

# %%
g = sns.relplot(data=ok, x="size_mb", y="busbw_gbps", hue="op", style="world_size", col="backend",
                kind="line", markers=True, facet_kws=dict(sharey=False), height=3.8, aspect=1.2)
g.set(xscale="log", xlabel="tensor size (MiB)", ylabel="bus bandwidth (GB/s)")
plt.show()

g = sns.relplot(data=ok, x="size_mb", y="time_ms", hue="op", style="world_size", col="backend",
                kind="line", markers=True, facet_kws=dict(sharey=False), height=3.8, aspect=1.2)
g.set(xscale="log", yscale="log", xlabel="tensor size (MiB)", ylabel="time per call (ms, slowest rank)")
plt.show()

# %% [markdown]
# ## What the numbers say
#
# A call costs a fixed latency plus size / bandwidth (the alpha-beta model, fitted below per backend, op
# and world size). Small messages are dominated by the latency, large ones by the bandwidth; the fitted
# latency is what every extra collective call costs, which is why data parallelism groups gradients into
# buckets (notebook 07).

# %%
report.show_table(fits, floatfmt=".4g")


def describe(backend):
    part = ok[ok["backend"] == backend]
    if part.empty:
        return
    ar = part[part["op"] == "all_reduce"]
    n = int(ar["world_size"].min())
    ar = ar[ar["world_size"] == n].sort_values("size_mb")
    small, big = ar.iloc[0], ar.iloc[-1]
    report.say(f"**{backend}, {n} ranks:** all-reduce of {small.size_mb:g} MiB takes {small.time_ms:.3g} ms "
               f"({small.busbw_gbps:.3g} GB/s bus bandwidth), of {big.size_mb:g} MiB {big.time_ms:.3g} ms "
               f"({big.busbw_gbps:.3g} GB/s): {big.size_mb / small.size_mb:.0f}x the data for "
               f"{big.time_ms / small.time_ms:.3g}x the time, so the small call is "
               f"{'latency-bound' if big.busbw_gbps > 2 * small.busbw_gbps else 'already near the bandwidth limit'}.")
    f = fits[(fits["backend"] == backend) & (fits["op"] == "all_reduce") & (fits["world_size"] == n)]
    if not f.empty:
        lat = f.latency_ms.item()
        lat_text = (f"{lat:.3g} ms" if lat >= 1 else f"{lat * 1e3:.3g} µs" if lat > 0 else
                    "too small to resolve at these sizes (fitted intercept ≤ 0)")
        report.say(f"Fitted all-reduce model for {backend}: latency {lat_text} per call, "
                   f"algorithm bandwidth {f.bandwidth_gbps.item():.3g} GB/s.")
    # all-reduce = reduce-scatter + all-gather on a ring: compare the measured times at the largest size
    largest = part[(part["world_size"] == n) & (part["size_mb"] == big.size_mb)].set_index("op")["time_ms"]
    if {"reduce_scatter", "all_gather", "all_reduce"} <= set(largest.index):
        parts = largest["reduce_scatter"] + largest["all_gather"]
        ratio = largest["all_reduce"] / parts
        verdict = ("about one reduce-scatter plus one all-gather, as on a ring, so splitting an all-reduce into "
                   "the two (ZeRO, FSDP) costs no extra communication time" if 0.75 <= ratio <= 1.33 else
                   "less than the two separately: this backend's all-reduce is better tuned than its "
                   "reduce-scatter/all-gather pair, so on it splitting the all-reduce (ZeRO, FSDP) costs time"
                   if ratio < 0.75 else
                   "more than the two separately: this backend's all-reduce is not the ring ideal")
        report.say(f"At {big.size_mb:g} MiB, reduce-scatter + all-gather take {parts:.3g} ms against "
                   f"{largest['all_reduce']:.3g} ms for the all-reduce (ratio {ratio:.2f}): the all-reduce "
                   f"costs {verdict}.")


describe("gloo")
describe("nccl")
if not nccl.empty:
    common = sorted(set(gloo["size_mb"]) & set(nccl["size_mb"]))
    if common:
        s = common[-1]
        pick = lambda b: ok[(ok["backend"] == b) & (ok["op"] == "all_reduce") & (ok["world_size"] == 2)
                            & (ok["size_mb"] == s)]["time_ms"]
        if len(pick("gloo")) and len(pick("nccl")):
            report.say(f"At {s:g} MiB with 2 ranks, NCCL's all-reduce is {pick('gloo').item() / pick('nccl').item():.0f}x "
                       "faster than gloo's: GPU-to-GPU links versus copies through host memory and TCP.")
    by_n = ok[(ok["backend"] == "nccl") & (ok["op"] == "all_reduce") & (ok["size_mb"] == ok["size_mb"].max())]
    if by_n["world_size"].nunique() > 1:
        report.show_table(by_n[["world_size", "time_ms", "algbw_gbps", "busbw_gbps"]])
        report.say("With more ranks the algorithm bandwidth falls while the bus bandwidth stays roughly "
                   f"constant ({by_n.busbw_gbps.min():.3g}–{by_n.busbw_gbps.max():.3g} GB/s): each link carries "
                   "2(n−1)/n of the data, which is what the bus-bandwidth convention normalizes away.")
