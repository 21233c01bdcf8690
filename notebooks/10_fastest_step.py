# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · The fastest step: the book's parts composed
#
# Notebooks 05 and 08 measured the book's kernels and sharding one by one. Here they are composed into one
# training step and set against what a PyTorch user writes, measured side by side in the same run on the
# same GPUs:
#
# * **the course's 2026 leaderboard step**: 8.1 B parameters (d_model 4,096, d_ff 11,008, 34 layers, 32
#   heads, vocabulary 151,936), context 32,768, bf16 parameters, one sequence per GPU on two GPUs, AdamW,
#   the cross-entropy summed; one complete step (zero_grad, forward, loss, backward, optimizer step) timed
#   with `triton.testing.do_bench`;
# * **the 2.7B step on one GPU**: batch 4, context 512.
#
# Every comparison holds the precision, the configuration (model, context, batch, ranks) and the timer fixed:
# the book's step (bf16 parameters and AdamW state) is set against the fastest stock step *at its own
# precision*. On one GPU the stock steps therefore run twice, with the course's fp32 master weights under bf16
# autocast (`stock_eager`, `stock_compiled`) and with bf16 parameters (`stock_eager_bf16`,
# `stock_compiled_bf16`); on the leaderboard every step keeps bf16 parameters. Where the book's step differs
# from that stock step in a choice any PyTorch user can make (a dtype, a checkpointing policy, a compile
# scope), the text says so.
#
# The book's recipe (`lab.recipes.fastest_step.PROJECT`): the fused LM-head cross-entropy (the 10 GB of
# logits never exist), `lab.FSDP` (one all-gather and one reduce-scatter per block, prefetched), selective
# activation checkpointing that keeps each block's attention output and the outputs of the two projections
# that write the residual stream and recomputes the rest, except in the first quarter of the blocks, whose
# saved activations go to pinned host memory during the forward and come back a block ahead of the backward
# (offloading, on a side stream: those blocks are not recomputed), `torch.compile` of the modules without
# matrices, fused AdamW, and the attention chosen by measurement: SDPA's cuDNN kernel, which notebook 05's
# Triton FlashAttention-2 kernels did not beat inside either rung's step, so that the ablation
# `flash_triton_attention` measures the choice again below (and `no_offload` the offloading). The stock step: FSDP2
# `fully_shard` per block and at the root, SDPA, `torch.utils.checkpoint` on every block, materialized
# logits with `F.cross_entropy` in their own dtype (bf16), fused AdamW, eager and with each block compiled.
# Every optimization is then changed alone. The quick (CPU) book compiles nothing, so it runs no stock
# "compiled" step, and it times each recipe once: interpreted Triton on a CPU says nothing about GPUs, so its
# comparisons are left undecided rather than paid for with minutes of interpreted steps.

# %% tags=["parameters"]
quick = True                      # CPU-sized stand-ins on gloo with Triton interpreted; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: re-render from results/ without measuring; or the tables to read back
configs = None                    # None: ["leaderboard", "2.7B"] (full) or ["tiny"] (quick); "leaderboard_hsdp": 4 GPUs
carry = []                        # read back from the last render, not measured: "2.7B" or "leaderboard:headline"
ablate = True                     # each optimization switched off alone: True, False, config names, or {config: names}
rep_ms = {"leaderboard": 13000, "2.7B": 3000, "leaderboard_hsdp": 13000, "tiny": 3000, "tiny_one_rank": 3000,
          "tiny_hsdp": 3000}  # do_bench budgets (ms)
goal = {"leaderboard": 0.8, "2.7B": 0.85, "leaderboard_hsdp": 1.0, "tiny": 0.8, "tiny_one_rank": 0.85,
        "tiny_hsdp": 1.0}  # book / fastest stock, equal precision (on two nodes: ahead of FSDP2's HSDP)
loss_shapes = None                # (vocab, d_model, tokens) of the loss benchmark; None: the defaults below
scaling_goal = 0.95               # on several nodes: the book's step's tokens/s per GPU, at least this share of one node's
samples = None                    # host-timed steps a recipe; None: the rule's minimum, 5 (full) or 1 (quick: no verdicts)
attention_shape = None            # [batch, heads, seq, d] of the attention calls timed alone; None: the 2.7B model's
                                  # (full) or 1 x 2 x 32 x 16 (quick), causal, as notebook 05 times them
attention_impls = ["triton", "sdpa"]  # the book's FlashAttention-Triton and SDPA's default backend
host_busy = None                  # neighbours busy on the host for the ablations' second timing; None: half the
                                  # host's cores on a GPU, 0 (no second timing) on the CPU, whose ranks are the host

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
import os

import matplotlib.pyplot as plt

from lab.bench import fastest as bench
from lab.bench import fused_loss
from lab.bench.attention_grid import GRAPH_MAX_SEQ, SHAPE_2_7B, Shape, time_attention_grid
from lab.book import ledger, plots, report
from lab.book.fastest import compare
from lab.book.fastest import present as fastest
from lab.measure.device import resolve_device
from lab.measure.machine import half_the_cores
from lab.recipes import plan

dev = resolve_device(device)
on_gpu = dev.type == "cuda"
configs = configs or (["tiny"] if quick else ["leaderboard", "2.7B"])
loss_shapes = loss_shapes or ([(128, 16, 32)] if quick else [(151_936, 4096, 32_768), (10_000, 2560, 16_384)])
samples = samples or (1 if quick else bench.MIN_SAMPLES)
attention_shape = Shape(*attention_shape) if attention_shape else Shape(1, 2, 32, 16) if quick else SHAPE_2_7B
host_busy = half_the_cores() if host_busy is None and on_gpu else host_busy or 0
params = dict(quick=quick, device=str(dev), configs=configs, carry=carry, ablate=ablate, rep_ms=rep_ms, goal=goal,
              loss_shapes=loss_shapes, scaling_goal=scaling_goal, samples=samples,
              attention_shape=attention_shape.label, attention_impls=attention_impls, host_busy=host_busy)
book = report.Chapter("10_fastest_step", params, results_dir, replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()

# %% [markdown]
# ## The configurations
#
# Model FLOPs count every matmul once forward and twice backward, with the causal half of the attention
# scores, and no recomputation: the numerator of MFU.

# %%
report.show_table(fastest.config_table(configs), floatfmt=".4g")

# %% [markdown]
# ## Stock PyTorch against the book's step
#
# Each recipe of a configuration runs in the same processes one after the other, the model rebuilt for each.
# The book's step and the stock steps are timed with `triton.testing.do_bench` (the median of whole steps, with
# their spread) and profiled once; the ablations with do_bench too on one GPU (a step of milliseconds) and with
# host-timed steps on several (a step of seconds; CUDA graphs always with do_bench). `first_step_s` is the
# first step including compilation and autotuning, and `wall_s` the recipe's whole benchmark (build, first
# step, timing). On a machine with a GPU for every rank of every configuration the configurations run side by
# side, each on GPUs of its own (`gpus`), sharing only the host; there the book's step is the first recipe of
# its processes and compiles from empty Inductor and Triton caches, as the leaderboard's 10-minute rule counts
# it. Every recipe's processes, stock included, run with the CUDA allocator's expandable segments
# (`alloc_conf`), which reuse freed memory whatever its size.
#
# `leaderboard_hsdp` is the leaderboard on two nodes of two GPUs (four ranks spawned on one machine, grouped
# as two nodes: the book's HSDP shards within a node and replicates across, FSDP2's on a 2-D mesh); beside its
# goal against FSDP2's HSDP, its tokens per second per GPU are set against the one-node leaderboard step.
#
# The second table sets each copy of the book's step against the fastest stock step of equal precision,
# configuration, batch, timer and cards, and splits their differences into options any PyTorch user can set
# and the book's own parts. The stock 2.7B steps (eager and compiled, bf16 autocast) are the train steps that
# notebooks 01, 02, 04 and 05 time too, and the eager one's peak is 03's: they enter the book's ledger, where
# the same measurement in two reports must agree (by GPU time where the host set the wall time).

# %%
runs = book.table("fastest_step", lambda: bench.benchmark_configs(
    plan.measured_recipes(configs, carry, quick, ablate), device=str(dev), rep_ms=rep_ms, trace_dir=artifacts_dir,
    samples=samples),
    save=bench.results_table, carry=(lambda saved: plan.carried_rows(saved, configs, carry)) if carry else None)
on_gpu = fastest.measured_on_gpu(runs, on_gpu)  # a replay judges the GPU rows it reads back
book.ledger(compare.ledger_entries(runs), table="fastest_step")
for name in configs:
    table = runs[runs["config"] == name]
    report.show_table(table[fastest.RUN_COLUMNS].dropna(axis=1, how="all"), floatfmt=".4g")
    report.show_table(compare.like_for_like_table(table), floatfmt=".4g")
    book.answer(compare.goal_claim(table, name, goal[name], on_gpu), section="Stock PyTorch against the book's step")
    book.state(*compare.other_precision_claims(table))
    book.state(fastest.compile_claim(table, name, on_gpu))
scaling = compare.scaling_claim(runs, target=scaling_goal, on_gpu=on_gpu)  # None unless a configuration spans nodes
if scaling is not None:
    book.answer(scaling, section="Stock PyTorch against the book's step")

# %% [markdown]
# ## Where the time goes
#
# One profiled step: each GPU kernel's time assigned to recomputation or the optimizer by where it was
# launched, else to attention, matmuls or the loss by its name; communication counts only where no compute
# ran beside it; `idle` is the time no kernel ran (launch gaps, waiting for the host). The
# tables below each plot set the book's step against each stock step of its precision phase by phase: one
# profiled step each, so they say where the time goes, not which step is faster.

# %%
for name in configs:
    table = runs[runs["config"] == name]
    fastest.plot_phases(table, f"{name}: time by phase (ms per step)")
    plt.show()
    book.answer(fastest.phase_claim(table), section="Where the time goes")
    for reference in compare.stocks_like(table):
        gap = fastest.gap_table(table, reference=reference)
        if not gap.empty:
            report.show_table(gap, floatfmt=".4g")
            book.state(fastest.gap_claim(table, reference=reference))
    others = fastest.other_kernels_table(table, ["project", *compare.stocks_like(table)[:1]])
    if not others.empty:
        report.show_table(others, floatfmt=".4g")
    book.answer(fastest.mfu_claim(table, on_gpu), section="Where the time goes")

# %% [markdown]
# ## The attention calls, timed alone
#
# The profile sees attention only as a phase of each step. Here the 2.7B step's attention calls (4 × 32 heads of 80
# over 512 tokens, causal, bf16) are timed alone, as notebook 05 times them: the book's FlashAttention-Triton
# (`kernel` and `bwd_kernel` say which of its kernels ran the forward and the backward) and SDPA's default
# backend, forward and forward+backward replayed from CUDA graphs on a GPU (kernels of tens of microseconds: timed
# eagerly, the host's launches would be timed instead; a replay's backward is derived, not sampled). They enter the
# book's ledger beside 05's rows.

# %%
calls = book.table("fastest_attention", lambda: time_attention_grid(
    attention_impls, [attention_shape], ["bf16"], device=dev, graph_max_seq=GRAPH_MAX_SEQ, sweep="attention call"))
report.show_table(report.shown(calls[[c for c in ["impl", "kernel", "bwd_kernel", "timing", "status", "fwd_ms",
                                                  "fwd_spread_ms", "fwd_n", "e2e_ms", "e2e_spread_ms", "e2e_n"]
                                      if c in calls]]))
book.ledger(ledger.attention_entries(calls, attention_shape), table="fastest_attention")

# %% [markdown]
# ## Memory by category
#
# Parameters, gradients and AdamW state on one GPU (sharded where the recipe shards them), and everything
# else at the step's peak: activations kept for backward, the recomputed block, gathered weights, the loss.

# %%
for name in configs:
    fastest.plot_memory(runs[runs["config"] == name], f"{name}: peak memory per GPU")
    plt.show()

# %% [markdown]
# ## Ablations: what each optimization is worth
#
# The book's step with one thing changed alone (`change` says what), measured in the same run against the
# book's step timed the same way on the same cards (`base_ms`; where the ablations run on GPUs of their own,
# the book's step measured again there, `ablation_base`). The verdict is on the change: `slower` means the
# step with the change is slower (so the recipe keeps its choice), `faster` that it is faster. The last table
# says what offloading moved, whether a step was captured in CUDA graphs, and what each rank of a sharded step
# sends within its node and across nodes (from the shapes). The offload and optimizer-in-the-backward
# ablations are profiled once too, so the phases say where their time goes.

# %%
for name in configs:
    table = runs[runs["config"] == name]
    ablated = compare.ablation_table(table)
    if not ablated.empty:
        report.show_table(ablated, floatfmt=".4g")
    book.answer(compare.ablation_claim(table, name, on_gpu), section="Ablations: what each optimization is worth")
    moved = fastest.ablation_phase_claim(table)
    if moved is not None:
        book.state(moved)
    choices = fastest.choices_table(table)
    if not choices.empty:
        report.show_table(choices, floatfmt=".4g")

# %% [markdown]
# A step of tens of milliseconds can be set by the host's kernel launches rather than by the GPU, and an
# optimization that moves work between the two (the optimizer inside the backward, CUDA graphs, compiling) can
# win on a quiet host and lose on a busy one. So each one-GPU ablation is timed a second time, led by the book's
# step again, beside `host_busy` processes that each keep a core of the host busy copying buffers (what another
# job's data loaders take from a host). A verdict that changes depends on the host. The leaderboard's steps of
# seconds are the GPUs' own, and are not timed twice.

# %%
busy_jobs = plan.host_ablations(configs, quick, ablate) if host_busy else {}
if busy_jobs:
    busy = book.table("fastest_step_busy", lambda: bench.benchmark_configs(
        busy_jobs, device=str(dev), rep_ms=rep_ms, trace_dir=os.path.join(artifacts_dir, "busy_host"),
        samples=samples, busy=host_busy), save=bench.results_table)
    for name in busy_jobs:
        report.show_table(compare.ablation_table(busy[busy["config"] == name]), floatfmt=".4g")
        book.answer(compare.host_claim(runs[runs["config"] == name], busy[busy["config"] == name], name, on_gpu),
                    section="Ablations: what each optimization is worth")

# %% [markdown]
# ## The loss without the logits
#
# The fused LM head + cross-entropy against PyTorch with materialized logits (eager and compiled) and a
# chunked PyTorch loss, forward+backward, at the leaderboard's vocabulary and at the course models' 10,000.
# `peak_extra_gib` is the memory the loss needs beyond its inputs and outputs. On a CPU the Triton kernels run
# interpreted: the fused rows are checked against an fp32 reference and not timed.

# %%
losses = book.table("fused_loss", lambda: fused_loss.add_ratios(fused_loss.sweep(
    shapes=loss_shapes, device=dev, check=True, untimed=() if on_gpu else ("fused", "fused_recompute"))))
report.show_table(losses.drop(columns=["fwdbwd_samples_ms"]), floatfmt=".4g")
book.answer(fastest.fused_loss_claim(losses, fastest.measured_on_gpu(losses, dev.type == "cuda")),
            section="The loss without the logits")
