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
# Data parallelism and sharding are built from three collectives:
#
# * **all-reduce**: every rank ends with the sum of everyone's tensor (gradient averaging in DDP);
# * **all-gather**: every rank ends with everyone's shard (FSDP's weights before use, ZeRO-1's updated
#   parameters);
# * **reduce-scatter**: every rank ends with the sum of one shard (FSDP's and ZeRO-1's gradients).
#
# Here we time them for float32 tensors, with gloo between CPU processes (2, 4 and 6 of them) and with NCCL
# between the GPUs the machine has, and turn the times into bandwidths that can be compared with the
# hardware. Notebooks 07 and 08 read this render's fitted latency and bandwidth.
#
# Conventions (those of nccl-tests): *size* is the full tensor (the all-reduced buffer, the gathered
# output, the reduce-scatter input). **Algorithm bandwidth** is size / time. **Bus bandwidth** rescales it
# by the traffic each link carries on an optimal ring: ×2(n−1)/n for all-reduce (a reduce-scatter followed
# by an all-gather) and ×(n−1)/n for all-gather and reduce-scatter, so it can be compared with a link's
# bandwidth whatever the number of ranks. Each timed call starts after a barrier and ends with a device
# synchronize; a call's time is that of its **slowest** rank (the collective is done when its last rank
# is); a row's time is the median over the timed calls with its spread, and every call's time is kept for
# the verdicts below, which follow the rule stated at the top. Before timing, one call on known integer
# inputs checks the result values.

# %% tags=["parameters"]
quick = True                      # gloo with small tensors only; the full render sets False
device = "auto"                   # "auto": NCCL on the GPUs if there are any (full profile), gloo always
results_dir = "results/quick"
artifacts_dir = "artifacts/quick"
replay = False                    # True: read this notebook's tables from results_dir instead of measuring
ops = ["all_reduce", "all_gather", "reduce_scatter"]
world_sizes = [2, 4, 6]           # gloo: CPU processes, all of them; NCCL: one rank per GPU, as many as there are
gpu_sizes_mb = [1, 10, 100, 1024]  # MiB of float32 (1024 MiB is 1 GiB)
cpu_sizes_mb = None               # None: 1/16, 1/2, 4 MiB (quick) or 1, 10, 100 MiB (full: gloo at 1 GiB takes minutes)
warmup = 5
iters = 20

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
from lab.bench import collectives  # noqa: E402 - after the parameters cell
from lab.book import plots, report  # noqa: E402 - after the parameters cell
from lab.book.communication import present as comm  # noqa: E402 - after the parameters cell

machine = comm.measuring_machine(results_dir, replay)  # a replay plans for the machine that measured
grid_plan = comm.plan_grid(quick, device, world_sizes, ops, gpu_sizes_mb, cpu_sizes_mb, warmup, iters,
                           gpus=machine["gpus"])
params = dict(quick=quick, device=device, **grid_plan.params())
book = report.Chapter("06_communication", params, results_dir, replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()

# %% [markdown]
# ## The grid
#
# gloo moves tensors through host memory and TCP on the loopback device; it is what the quick profile and
# the CPU tests use, and it runs any number of processes. NCCL runs one rank per GPU over NVLink or PCIe.

# %%
report.say(grid_plan.note)
grid = book.table("collectives", grid_plan.measure)
report.show_table(comm.grid_table(grid), floatfmt=".4g")
book.state(*comm.grid_findings(grid, machine["cores"]))

# %% [markdown]
# ## Bandwidth against message size
#
# Small messages cannot fill the links: each call pays a fixed cost (launching the collective, the
# handshakes of the ring) before any byte moves, so the bandwidth climbs with the size until the links are
# the limit.

# %%
bandwidth_plot = comm.plot_bandwidth(grid)

# %% [markdown]
# ## The alpha-beta model
#
# A call costs a fixed latency α plus size / bandwidth β: $T(s) = \alpha + s/\beta$, fitted below per
# backend, op and world size (weighted least squares). Small messages are dominated by α, large ones by β;
# the size $\alpha\beta$ at which both terms are equal separates latency-bound from bandwidth-bound calls.
# α is what every extra collective call costs, which is why data parallelism groups gradients into buckets
# (notebook 07 fits the same model to its bucket sizes and compares with this one).

# %%
fits = book.table("collectives_latency_bandwidth", lambda: collectives.latency_bandwidth_fit(grid))
report.show_table(fits, floatfmt=".4g")
comm.plot_times_with_fit(grid, fits)
book.state(*comm.fits_findings(fits), *comm.backend_findings(grid))
book.answer(comm.latency_claim(fits), section="The alpha-beta model")

# %% [markdown]
# ## All-reduce, or reduce-scatter then all-gather?
#
# On a ring, an all-reduce *is* a reduce-scatter followed by an all-gather, so the two should take the same
# time. ZeRO-1 and FSDP rely on this: they replace DDP's all-reduce by the two halves (with an optimizer step
# or a forward pass in between). Below, each timed reduce-scatter plus all-gather against the all-reduce at
# the largest size, judged against the spread of the timed calls.

# %%
split = comm.split_comparisons(grid)
report.show_table(comm.comparison_table(split, "reduce-scatter + all-gather", "all-reduce"))
book.answer(comm.split_claim(split), section="All-reduce, or reduce-scatter then all-gather?")

# %% [markdown]
# ## More ranks
#
# With $n$ ranks an all-reduce moves $2(n-1)/n$ of the tensor over each link, so the algorithm bandwidth
# falls as ranks are added even on ideal links; the bus bandwidth divides that factor out and should stay
# flat. Below, each world size's bus bandwidth per timed call against the fewest ranks' (higher is better).

# %%
by_ranks = comm.rank_comparisons(grid)
report.show_table(comm.comparison_table(by_ranks, "bus bandwidth", "at the fewest ranks"))
book.answer(comm.ranks_claim(by_ranks), section="More ranks")
