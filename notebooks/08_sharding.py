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
# * **ZeRO-1** (`lab.parallel.zero1.ZeRO1Optimizer`): the same saving, but the all-reduce becomes a
#   reduce-scatter (bucketed, overlapping backward), the update happens on the local slice, and an all-gather
#   returns the parameters, so it communicates exactly what DDP does.
# * **`lab.FSDP`**: parameters and gradients are sharded too; each layer's weights (a layer is a transformer
#   block: seven matrices in one collective) are all-gathered just before use (two layers ahead) and
#   dropped right after, and gradients are reduce-scattered, one collective per block.
#
# Each is compared with PyTorch's own: `DistributedDataParallel`, `ZeroRedundancyOptimizer` and FSDP2
# (`fully_shard`). Every number in the prose is computed from the result tables.
#
# **How it is measured** (`lab.bench.sharding`). Memory: each implementation in fresh processes, so that no
# other one's allocations pollute its peaks, over several steady-state steps (a peak's samples). Step time:
# all six in the same processes, taking turns round after round in an order rotated every round
# (`lab.bench.interleaved`; step by step when all the models fit, otherwise rebuilt for each turn), so that
# the host's drifting load cannot rank them; each reports the median and spread over rounds. Two
# implementations ran in the same rounds, so their times are compared round by round: the *ratio* is the
# median of their per-round time ratios. Every verdict and goal follows the rule stated at the top of this
# report.

# %% tags=["parameters"]
quick = True                      # tiny model, gloo on the CPU; the full render sets False
device = "auto"                   # "auto": NCCL on GPUs when there are enough (full profile), else gloo on the CPU
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: read this notebook's tables from results_dir instead of measuring
sizes = None                      # None: xl and 2.7B (full) or tiny (quick)
impls = ["ddp", "sharded_optimizer", "zero1", "fsdp", "torch_zero", "torch_fsdp2"]
world_size = 2
context = None                    # None: 512 (full) or 64 (quick)
batch = 2                         # per rank
dtype = "bf16"                    # autocast dtype (and FSDP's compute dtype)
fsdp_reduce_dtype = None          # None: reduce-scatter in the compute dtype, as FSDP2 does by default
rounds = None                     # None: 6 (full) or 20 (quick) interleaved rounds (at least 5 for a verdict)
steps_per_round = None            # None: 3 (full) or 1 (quick) timed steps per turn
warmup = None                     # None: 2 (full) or 1 (quick) untimed steps before timing (and before memory)
schedule = "auto"                 # "resident" (all models kept, step by step), "rebuild", or "auto" (by memory)
profile_impl = "fsdp"             # its step is profiled: compute vs communication on a timeline
fsdp_memory_factor = 1.1          # goal: FSDP's peak at most this many times FSDP2's

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
import pandas as pd  # noqa: E402 - after the parameters cell

from lab.bench import traffic as sharding_traffic  # noqa: E402 - after the parameters cell
from lab.book import claims, plots, report  # noqa: E402 - after the parameters cell
from lab.book.sharding import bench as sharding_bench  # noqa: E402 - after the parameters cell
from lab.book.sharding import present as sharding_book  # noqa: E402 - after the parameters cell

run = sharding_bench.plan_run(quick, device, world_size, sizes, impls, context, batch, dtype, fsdp_reduce_dtype, rounds,
                              steps_per_round, warmup, schedule, profile_impl)
params = dict(quick=quick, device=device, fsdp_memory_factor=fsdp_memory_factor, **run.params())
book = report.Chapter("08_sharding", params, results_dir, replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()
report.say(run.note)

# %% [markdown]
# ## What each scheme should save: the closed form
#
# Per rank, with $P$ parameters and $N$ ranks: parameters $4P$, gradients $4P$, AdamW state $8P$ bytes;
# optimizer sharding divides the $8P$ by $N$, FSDP divides all three. Parameter counts come from the model
# built on the meta device (no memory). *Computed, not measured: this table is the same on any machine.*

# %%
expected = run.expected_state()
report.show_table(expected)
book.state(*sharding_book.state_findings(expected))

# %% [markdown]
# ## What each scheme communicates
#
# Bytes each rank sends per step on a ring (all-reduce $2\frac{N-1}{N}S$, reduce-scatter and all-gather
# $\frac{N-1}{N}S$ each, a pipelined broadcast $\frac{N-1}{N}S$ per rank on average). The closed form
# (`lab.parallel.sharded_optimizer.optimizer_traffic`) for the largest model, next to the bytes the code
# actually issued in one step of the tiny model (`lab.bench.traffic.measure_traffic`: every collective is
# counted by a `TrafficLog`). *Both tables are computed, not measured on this render's GPUs: the counting runs
# the tiny model on CPU processes with gloo, and byte counts depend on the model and the number of ranks, not
# on the machine.*
#
# How the simple sharded optimizer differs from ZeRO stage 1: both keep the optimizer state of $1/N$ of the
# parameters per rank, but the sharded optimizer keeps DDP's all-reduce and then broadcasts every parameter
# from its owner, while ZeRO-1 reduce-scatters the gradients into the slice each rank updates and all-gathers
# the result (their bytes against DDP's are below). ZeRO-1 needs no DDP wrapper: its gradients live in
# bucketed flat buffers, and each bucket's reduce-scatter starts during backward as soon as the bucket's
# gradients exist (as DDP's bucketed all-reduce does). Both then update chunk by chunk and launch each chunk's
# broadcast (sharded optimizer) or all-gather (ZeRO-1) while the next chunk is being updated, which also keeps
# a foreach AdamW's temporaries to one chunk instead of the whole share; torch's ZeroRedundancyOptimizer steps
# its whole share first and broadcasts after.

# %%
closed = sharding_traffic.closed_form_traffic(run.sizes[-1], world_size)
report.show_table(closed[["impl", "gradient_collective", "gradient_gib", "parameter_collective", "parameter_gib",
                          "total_gib", "ratio_to_ddp"]])
traffic = sharding_traffic.measure_traffic("tiny", world_size, 64, "cpu")
report.show_table(traffic)
traffic_claim = sharding_book.traffic_claim(closed, traffic)
book.state(traffic_claim)
book.answer(traffic_claim, section="What each scheme communicates")

# %% [markdown]
# ## The benchmark: memory by phase and step time
#
# Each implementation trains with AdamW under `dtype` autocast on `batch` sequences per rank. Memory: the
# CUDA allocator's peak during model + optimizer construction (init), and in each of several steady-state
# steps during forward + backward (before the optimizer step) and during the optimizer step (medians over
# the steps), each implementation in fresh processes. Step time: the interleaved rounds, each step counted at
# its slowest rank. Out-of-memory is a row, not a crash.

# %%
df = book.table("sharding_benchmark", lambda: run.measure(artifacts_dir))
book.ledger(sharding_book.ledger_entries(df), table="sharding_benchmark")
report.show_table(sharding_book.benchmark_table(df))
book.state(*sharding_book.failures(df))
sharding_book.plot_step_times(df)
sharding_book.plot_peaks(df, results_dir)

# %% [markdown]
# ## Where the memory goes: parameters, gradients, optimizer state, activations
#
# The bytes of this rank's parameter, gradient and optimizer-state tensors (counted from the tensors
# themselves; the largest rank), next to the closed form. "Activations + transients" is the peak before
# the step minus those three: saved activations, autocast's bf16 weight copies, gathered weights and
# communication buffers at the moment of the peak.

# %%
breakdown = sharding_book.memory_breakdown(df)
report.show_table(breakdown)
book.state(sharding_book.breakdown_claim(breakdown))
sharding_book.plot_breakdown(breakdown)
book.state(sharding_book.peak_claim(df))
memory_claim = sharding_book.memory_claim(df)
book.state(memory_claim)
book.answer(memory_claim, section="Where the memory goes: parameters, gradients, optimizer state, activations")

# %% [markdown]
# ## Sharded optimizer vs ZeRO-1 vs the references: step time
#
# Each implementation's per-round step times against DDP's (what sharding costs) and against its PyTorch
# counterpart (torch's `ZeroRedundancyOptimizer` for the sharded optimizer and ZeRO-1, FSDP2 for FSDP).

# %%
times = sharding_book.time_comparisons(df)
report.show_table(pd.DataFrame(claims.verdict_table(times)))
book.state(*(f for _, f in times))
time_claim = sharding_book.time_claim(df)
book.answer(time_claim, section="Sharded optimizer vs ZeRO-1 vs the references: step time")

# %% [markdown]
# ## The performance goals
#
# Sharded optimizer and ZeRO-1: no more memory after the step than `ZeroRedundancyOptimizer`, and at least
# as fast. FSDP with bf16 compute: at least as fast as FSDP2, with at most 1.1x its peak memory. Times are
# compared round by round, peaks step against step, each under the rule at the top of this report (the memory
# goals need the GPU's allocator peaks).

# %%
goals = sharding_book.goal_comparisons(df, fsdp_memory_factor)
report.show_table(pd.DataFrame(claims.verdict_table(goals)))
book.answer(sharding_book.goals_claim(goals, sharding_book.has_peaks(df)), section="The performance goals")

# %% [markdown]
# ## FSDP: do the all-gathers finish before the forward needs them?
#
# One profiled training step of `profile_impl` (rank 0), in the fresh processes of its memory measurement.
# On a GPU the lanes are CUDA streams: compute kernels in blue, NCCL kernels in orange; on the CPU they are
# the main thread's operators and gloo's worker threads. If the prefetched all-gathers arrive in time, the
# compute lane has no gaps during the forward (shaded green) and the communication hides under compute. One
# profiled step has no spread: read it as an illustration of the timed steps above, not as a measurement of
# them.

# %%
overlap, forward_claim = sharding_book.fsdp_overlap(df, profile_impl, results_dir)
report.show_table(overlap)
book.state(forward_claim)
book.answer(forward_claim, section="FSDP: do the all-gathers finish before the forward needs them?")

# %% [markdown]
# ## FSDP memory saving: expected vs measured

# %%
book.state(sharding_book.saving_claim(df))
