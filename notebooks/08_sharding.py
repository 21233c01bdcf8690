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
# **How it is measured.** Memory: each implementation in fresh processes, so that no other one's allocations
# pollute its peaks. Step time: all six in the same processes, taking turns round after round in an order
# rotated every round (`lab.bench.interleaved`; step by step when all the models fit, otherwise rebuilt for
# each turn), so that the host's drifting load cannot rank them; each reports the median and spread over
# rounds, and "faster", "slower" and "goal met" are verdicts on those per-round samples
# (`lab.measure.verdicts`), paired by round: the *ratio* is the median over rounds of the two
# implementations' time ratio within the same round, with a bootstrap 95 % interval.

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
rounds = None                     # None: 6 (full) or 20 (quick) interleaved rounds of step time
steps_per_round = None            # None: 3 (full) or 1 (quick) timed steps per turn
warmup = None                     # None: 2 (full) or 1 (quick) untimed steps before timing (and before memory)
schedule = "auto"                 # "resident" (all models kept, step by step), "rebuild", or "auto" (by memory)
profile_impl = "fsdp"             # its step is profiled: compute vs communication on a timeline
fsdp_memory_factor = 1.1          # goal: FSDP's peak at most this many times FSDP2's

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
from lab.book import plots, report  # noqa: E402 - after the parameters cell
from lab.book.sharding import bench as sharding_bench  # noqa: E402 - after the parameters cell
from lab.book.sharding import present as sharding_book  # noqa: E402 - after the parameters cell
from lab.book.sharding import traffic as sharding_traffic  # noqa: E402

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
# built on the meta device (no memory).

# %%
expected = run.expected_state()
report.show_table(expected, floatfmt=".3g")
report.say(sharding_book.state_sentence(expected, world_size))

# %% [markdown]
# ## What each scheme communicates
#
# Bytes each rank sends per step on a ring (all-reduce $2\frac{N-1}{N}S$, reduce-scatter and all-gather
# $\frac{N-1}{N}S$ each, a pipelined broadcast $\frac{N-1}{N}S$ per rank on average). The closed form
# (`lab.parallel.sharded_optimizer.optimizer_traffic`) next to what the code actually issued in one step of a
# tiny model (`lab.book.sharding.traffic.measure_traffic`: every collective is recorded by a `TrafficLog`).

# %%
closed = sharding_traffic.closed_form_traffic(run.sizes[-1], world_size)
report.show_table(closed[["impl", "gradient_collective", "gradient_gib", "parameter_collective", "parameter_gib",
                          "total_gib", "ratio_to_ddp"]], floatfmt=".3g")
traffic = book.table("sharding_traffic", lambda: sharding_traffic.measure_traffic("tiny", world_size, 64, "cpu"))
report.show_table(traffic, floatfmt=".4g")
report.say(sharding_book.traffic_sentences(closed, traffic))
book.answer("What does each scheme communicate?", sharding_book.traffic_answer(closed, traffic),
            section="What each scheme communicates")

# %% [markdown]
# ## The benchmark: memory by phase and step time
#
# Each implementation trains with AdamW under `dtype` autocast on `batch` sequences per rank. Memory: the
# CUDA allocator's peak during model + optimizer construction (init), during forward + backward of a
# steady-state step (before the optimizer step) and during the optimizer step, each implementation in fresh
# processes. Step time: the interleaved rounds, each step counted at its slowest rank. Out-of-memory is a
# row, not a crash.

# %%
df = book.table("sharding_benchmark", lambda: run.measure(artifacts_dir))
report.show_table(sharding_book.benchmark_table(df), floatfmt=".3g")
report.say(sharding_book.failures(df))
sharding_book.plot_step_times(df)
sharding_book.plot_peaks(df, results_dir)
report.say(sharding_book.peaks_sentence(df))

# %% [markdown]
# ## Where the memory goes: parameters, gradients, optimizer state, activations
#
# The bytes of this rank's parameter, gradient and optimizer-state tensors (counted from the tensors
# themselves; the largest rank), next to the closed form. "Activations + transients" is the peak before
# the step minus those three: saved activations, autocast's bf16 weight copies, gathered weights and
# communication buffers at the moment of the peak.

# %%
breakdown = sharding_bench.memory_breakdown(df)
report.show_table(breakdown, floatfmt=".3g")
report.say(sharding_book.breakdown_sentence(breakdown, world_size))
sharding_book.plot_breakdown(breakdown)
report.say(sharding_book.memory_sentences(df))
book.answer("How much memory does each scheme save per rank?", sharding_book.memory_answer(df),
            section="Where the memory goes: parameters, gradients, optimizer state, activations")

# %% [markdown]
# ## Sharded optimizer vs ZeRO-1 vs the references: step time
#
# Each implementation's per-round step times against DDP's (what sharding costs) and against its PyTorch
# counterpart (torch's `ZeroRedundancyOptimizer` for the sharded optimizer and ZeRO-1, FSDP2 for FSDP).

# %%
times = sharding_book.time_comparisons(df)
report.show_table(times, floatfmt=".3g")
report.say(sharding_book.time_sentences(times))
report.say(sharding_traffic.reduce_precision_note(df))
report.say(sharding_book.difference_sentence(closed, world_size))
book.answer("What does sharding cost in step time?", sharding_book.time_answer(times),
            section="Sharded optimizer vs ZeRO-1 vs the references: step time")

# %% [markdown]
# ## The performance goals
#
# Sharded optimizer and ZeRO-1: no more memory after the step than `ZeroRedundancyOptimizer`, and at least
# as fast. FSDP with bf16 compute: at least as fast as FSDP2, with at most 1.1x its peak memory. A time goal
# is *met* only when the 95 % interval of the time ratio lies within it, *missed* when it lies outside, and
# *undecided* otherwise; memory peaks repeat to the byte, so they are compared directly (and cannot be on
# the CPU).

# %%
goals = sharding_book.goals(df, fsdp_memory_factor)
report.show_table(goals, floatfmt=".3g")
book.answer("Are the performance goals met?", sharding_book.goals_answer(goals), section="The performance goals")

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
overlap, overlap_text = sharding_book.fsdp_overlap(df, profile_impl, results_dir)
report.show_table(overlap, floatfmt=".3g")
report.say(overlap_text)
book.answer("Do FSDP's all-gathers finish before the forward needs them?", sharding_book.forward_answer(overlap),
            section="FSDP: do the all-gathers finish before the forward needs them?")

# %% [markdown]
# ## FSDP memory saving: expected vs measured

# %%
saving = sharding_book.fsdp_saving(df, expected)
report.show_table(saving, floatfmt=".3g")
report.say(sharding_book.fsdp_saving_sentences(saving))
