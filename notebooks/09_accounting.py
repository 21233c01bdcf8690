# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Accounting: the arithmetic of memory, FLOPs and parallelism
#
# Before running anything on a cluster one can predict most of what it will do with a few formulas:
# how many bytes the training state takes, how many FLOPs a step costs, how long a ring collective
# needs, and at which batch size a parallel layout stops waiting on the network. This notebook derives
# those formulas with sympy (`lab.accounting`), answers the XXL questions about a very large
# FFN-only model on H100s and TPU v5p, checks the collective formulas step by step with a small ring
# simulator (`lab.accounting.ring_sim`), and finally compares predicted memory with what the GPU notebooks
# (01 profiling, 08 sharding) measured, reading their current results with the commit and GPU that measured
# them.
#
# Nothing here needs a GPU: the full profile renders on a CPU from the committed results. Every answer is
# stated from the tables (`lab.book.claims`), and the answers at the top link to their sections.

# %% tags=["parameters"]
quick = True                      # formulas are cheap: the quick and full profiles compute the same tables
device = "auto"                   # unused: this notebook computes, it does not measure on a GPU
results_dir = "results/quick"     # the full render passes "results" (where 01's and 08's GPU results are)
artifacts_dir = "artifacts/quick"
replay = False                    # True: read this notebook's tables from results_dir instead of computing
sizes = None                      # model sizes for the memory and FLOP tables (None: every size in the spec)
batch = 4                         # sequences per step for the memory and FLOP tables
context = 512
collective_size_bytes = 1e9       # S for the collective table and plot
ring_bandwidth = 450e9            # W, bytes/s each device sends (H100 NVLink 4: 450 GB/s per direction)
ring_devices = list(range(2, 65))  # N for the collective table and plot
sim_devices = [2, 3, 4, 8]        # N checked by the simulator
sim_sizes_bytes = [8 * 240, 8 * 24_000, 8 * 2_400_000]  # S checked by the simulator
xxl_tokens = 2048                 # tokens whose activations one device holds (one 2048-token sequence)
xxl_token_counts = [0, 1, 512, 2048, 8192]
tpu_mesh = {"X": 16, "Y": 4, "M_X": 2, "M_Y": 1}  # the question's FSDP (X over M_X axes) and TP (Y over M_Y) mesh
ffn_matrices = 3                  # the FFN of section 4: SwiGLU's three matrices, as in the book's model
gpu_flops = 989e12                # C of an H100 SXM, dense bf16 FLOP/s, for the GPU FFN example
ffn_tokens = 65536                # B for the GPU FFN example (tokens per step)
check_model = {"d_model": 128, "d_ff": 352, "num_layers": 2, "num_heads": 4}  # model whose saved tensors are counted
check_batch, check_context = 2, 64

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
from lab import accounting as acc
from lab.accounting.ring_sim import check_closed_forms
from lab.bench.predicted_memory import predicted_vs_measured, saved_activations_check
from lab.book import plots, report
from lab.book.accounting import present as acc_book
from lab.book.accounting import xxl as xxl_book
from lab.book.report import shown
from lab.model.transformer import MODEL_SIZES, ModelConfig, config_for

book = report.Chapter("09_accounting", dict(
    quick=quick, device=device, sizes=sizes, batch=batch, context=context, collective_size_bytes=collective_size_bytes,
    ring_bandwidth=ring_bandwidth, sim_devices=sim_devices, sim_sizes_bytes=sim_sizes_bytes, xxl_tokens=xxl_tokens,
    xxl_token_counts=xxl_token_counts, tpu_mesh=tpu_mesh, ffn_matrices=ffn_matrices, gpu_flops=gpu_flops,
    ffn_tokens=ffn_tokens, check_model=check_model, check_batch=check_batch, check_context=check_context),
    results_dir, replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()

# %% [markdown]
# ## 1 · Memory and FLOPs of the language model
#
# `TransformerLM` has an untied embedding and LM head, and per block the q/k/v/o projections, SwiGLU's
# three matrices and two RMSNorm weights (no biases). FLOPs count matrix multiplications only, $2mnk$ each:
# per token and block the forward does $2\cdot 4D^2$ (projections) $+\,2\cdot 3DF$ (SwiGLU)
# $+\,2\cdot 2TD$ (the two $T\times T$ score matmuls, the full square), and the LM head $2DV$; backward is
# twice the forward. The tests match these counts with the real model and `torch.utils.flop_counter`.

# %%
acc_book.show_parameter_count()

# %% [markdown]
# Per parameter, AdamW training keeps the weight, its gradient and two moments (m, v). Three precision
# policies:
#
# | policy | weights | gradients | AdamW m + v | extra |
# |---|---|---|---|---|
# | `fp32` | 4 B | 4 B | 8 B | — |
# | `bf16_autocast` | 4 B (fp32 master) | 4 B | 8 B | bf16 copy of every matrix (2 B), kept for backward |
# | `bf16` (pure) | 2 B | 2 B | 4 B | — |
#
# Saved activations are counted tensor by tensor from what `lab.model.transformer` does (section 6 checks
# the count against `torch.autograd.graph.saved_tensors_hooks` byte for byte). Per token and block with SDPA
# in fp32 that is $11D + 4F + H + 2$ elements: each RMSNorm saves its input, the normalised input, the
# reciprocal RMS and its output; attention q, k, v, its output and the log-sum-exp; the o_proj input; and
# SwiGLU four $F$-wide tensors. Autocast saves most of them in bf16 but keeps the norms in fp32, and every
# Linear saves its own bf16 cast of its input.

# %%
configs = {s: config_for(s, context_length=context) for s in sizes or MODEL_SIZES}
memory = book.table("accounting_memory", lambda: acc.memory_table(configs, batch, context))
flops = book.table("accounting_flops", lambda: acc.flops_table(configs, batch, context))
report.show_table(shown(memory))
claim = acc_book.memory_claim(memory)
book.answer(claim, section="1 · Memory and FLOPs of the language model")
book.state(claim)
report.show_table(shown(flops))
book.state(acc_book.flops_claim(flops))
acc_book.memory_figure(memory, batch, context)

# %% [markdown]
# ## 2 · The XXL FFN-only model
#
# The question: $D = 16384$, $F = 53248$, 126 blocks, each FFN **two linear layers**, up ($D\times F$) and
# down ($F\times D$), no activation function; attention, embeddings and the output layer are left out. No
# activation checkpointing; master weights, accumulated gradients and AdamW state in fp32 (16 bytes per
# parameter), saved activations and gradient communication in bf16. Each block saves the inputs of its two
# matrices, $D + F$ elements per token. Memory is counted in decimal GB as devices are sold (H100: 80 GB,
# TPU v5p: 95 GB). Beside it stands the SwiGLU variant (three matrices, $D + 4F$ saved elements per token),
# the FFN of the book's own model.
#
# **(a)** fp32 state, bf16 activations and H100s:

# %%
xxl_book.show_xxl_equations()
xxl = book.table("accounting_xxl_memory", lambda: acc.xxl_table(xxl_tokens))
report.show_table(xxl_book.xxl_display(xxl), floatfmt=".4g")
claim = xxl_book.xxl_claim(xxl)
book.answer(claim, section="2 · The XXL FFN-only model")
book.state(claim)

# %% [markdown]
# **(b) FSDP.** Shard the weights, gradients and optimizer state, and half of the activations (in practice
# every other layer's), over $N$ devices; the expression above, $M_{\mathrm{device}}(N)$, must stay under
# 95 GB. The activations depend on how many tokens a device holds, so the table gives $N$ for several.

# %%
fsdp = book.table("accounting_xxl_fsdp", lambda: acc.xxl_fsdp_table(xxl_token_counts))
report.show_table(xxl_book.fsdp_display(fsdp))
claim = xxl_book.fsdp_claim(fsdp)
book.answer(claim, section="2 · The XXL FFN-only model")
book.state(claim)

# %% [markdown]
# **(c) When is the forward compute bound on TPU v5p?** The scaling book's mesh notation:
# $W_{\mathrm{ici}} = 2\cdot 9\cdot 10^{10}$ B/s (both directions of a link), $C = 4.6\cdot 10^{14}$ FLOP/s,
# FSDP over $X = 16$ chips spanning $M_X = 2$ mesh axes (bandwidth $M_X W_{\mathrm{ici}}$), TP over $Y = 4$
# chips on $M_Y = 1$ axis; bf16 weights and activations ($p = 2$); $(n-1)/n \approx 1$. The input is sharded
# $B$ over $X$ and $D$ over $Y$, so each chip works on $B/X$ tokens and $F/Y$ columns. Per chip, for one FFN
# forward of the question's two matrices:

# %%
xxl_book.show_tpu_equations()

# %% [markdown]
# Compute bound means both communications hide behind the math:
# $T_{\mathrm{math}} \ge T_{\mathrm{FSDP}} \iff \frac{B}{X} \ge \frac{C}{W_{\mathrm{ici}} M_X}$, and
# $T_{\mathrm{math}} \ge T_{\mathrm{TP}} \iff Y \le \frac{F M_Y W_{\mathrm{ici}}}{C}$ for two matrices (no $B$
# in it; $\frac{3 F M_Y W_{\mathrm{ici}}}{2C}$ for SwiGLU's three).

# %%
tpu = book.table("accounting_tpu_batch", lambda: acc.tpu_batch_table(**tpu_mesh))
report.show_table(shown(tpu))
claim = xxl_book.tpu_claim(tpu, tpu_mesh)
book.answer(claim, section="2 · The XXL FFN-only model")
book.state(claim)

# %% [markdown]
# **(d) Keeping throughput at a smaller batch.** The binding constraint is the FSDP one,
# $B \ge X\,\frac{C}{W_{\mathrm{ici}} M_X}$: weights must arrive as fast as the math consumes them. Each
# trick attacks one factor of it:

# %%
tricks = book.table("accounting_tpu_tricks", lambda: acc.tpu_tricks_table(**tpu_mesh))
report.show_table(shown(tricks).assign(condition="$" + tricks["condition"] + "$"))
claim = xxl_book.tricks_claim(tricks)
book.answer(claim, section="2 · The XXL FFN-only model")
book.state(claim)

# %% [markdown]
# ## 3 · Ring collectives
#
# $N$ devices on a ring, each sending $W$ bytes/s to its neighbour; $S$ is the size of the full array
# (the all-gathered result, or the array every device reduces). In each step every device sends one
# chunk, and steps are synchronous.
#
# * **all-gather** and **reduce-scatter**: $N-1$ steps of one $S/N$ chunk;
# * **all-reduce** = reduce-scatter + all-gather: $2(N-1)$ steps of $S/N$, bandwidth optimal;
# * **alternate all-reduce** (the naive ring): whole arrays travel the ring; each device forwards the full
#   $S$ bytes it last received and adds what arrives; $N-1$ steps of $S$.

# %%
acc_book.show_collective_equations()
coll = book.table("accounting_collectives",
                  lambda: acc.collective_table(collective_size_bytes, ring_devices, ring_bandwidth))
report.show_table(acc_book.collectives_pivot(coll))
claim = acc_book.collectives_claim(coll)
book.answer(claim, section="3 · Ring collectives")
book.state(claim)
acc_book.collectives_figure(coll)

# %% [markdown]
# **The simulator** (`lab.accounting.ring_sim`) moves real numpy arrays chunk by chunk around the ring, checks every
# device's result against a direct sum or concatenation, counts bytes sent, and adds up the step times
# (a per-step latency of 1 µs included, to check the $\alpha$ terms too).

# %%
sim = book.table("accounting_ring_sim_check",
                 lambda: check_closed_forms(sim_sizes_bytes, sim_devices, ring_bandwidth, latency=1e-6))
report.show_table(shown(sim), floatfmt=".6g")
claim = acc_book.simulator_claim(sim)
book.answer(claim, section="3 · Ring collectives")
book.state(claim)

# %% [markdown]
# ## 4 · One SwiGLU FFN under DP, FSDP, TP and 2-D parallelism
#
# $B$ tokens, $W_1, W_3 \in \mathbb{R}^{D\times F}$, $W_2 \in \mathbb{R}^{F\times D}$; forward $6BDF$ FLOPs,
# backward $12BDF$. $C$ is each device's FLOP/s, $W$ its bandwidth, $p$ bytes per communicated element.
#
# * **DP**: tokens split, weights replicated; all-reduce the $3DF$ gradients after backward.
# * **FSDP**: tokens split, weights sharded; all-gather the weights before forward and again before
#   backward, reduce-scatter the gradients.
# * **TP** (Megatron with sequence-sharded activations): $W_1, W_3$ split by columns, $W_2$ by rows;
#   all-gather the $B\times D$ input and reduce-scatter the $B\times D$ output, and the mirror pair in backward.
# * **2-D**: FSDP over $X$ devices (bandwidth $W_X$) of weights already split $Y$ ways by TP over $Y$
#   devices (bandwidth $W_Y$), which see $B/X$ tokens.
#
# Communication dominates once it takes longer than the compute it could hide behind. With separate links
# per axis (**overlapped**), each axis must satisfy $T_{\mathrm{comm}} \le T_{\mathrm{compute}}$ on its
# own; on one **shared** link the two axes' times add.

# %%
report.show_table(acc_book.ffn_cost_table(ffn_matrices))

# %% [markdown]
# Setting $T_{\mathrm{compute}} = T_{\mathrm{comm}}$ and solving for the device count gives the largest $N$
# before communication dominates (training, forward + backward). DP and FSDP stop scaling when the tokens
# per device fall below about $pC/(3W)$ and $pC/(2W)$: their traffic is a fixed amount of weights while the
# compute per device shrinks. TP's limit does not depend on the batch at all, only on $F$: its traffic and
# its compute both scale with the tokens. That is why 2-D parallelism multiplies the two limits.

# %%
acc_book.show_max_device_equations(ffn_matrices)

# %% [markdown]
# Numbers for the XXL FFN's sizes on H100s connected by NVLink (bf16 communication, $p = 2$):

# %%
limits = book.table("accounting_ffn_limits",
                    lambda: acc.ffn_limits_table(ffn_tokens, gpu_flops, ring_bandwidth, ffn_matrices))
report.show_table(shown(limits))
claim = acc_book.limits_claim(limits)
book.answer(claim, section="4 · One SwiGLU FFN under DP, FSDP, TP and 2-D parallelism")
book.state(claim)
ffn_sweep = book.table("accounting_ffn_sweep", lambda: acc.ffn_sweep_table(
    ffn_tokens, gpu_flops, ring_bandwidth, matrices=ffn_matrices))
book.state(acc_book.ffn_sweep_claim(ffn_sweep))
acc_book.ffn_sweep_figure(ffn_sweep, ffn_tokens)

# %% [markdown]
# ## 5 · Predicted vs measured memory
#
# **Saved activations, exactly.** First the part of the prediction that can be checked to the byte on any
# machine: run a forward + loss on the CPU under `lab.measure.saved_tensors.saved_tensor_report` (which sees every
# tensor autograd saves) and compare with the formula, for both attention implementations and all three
# precision policies. (The CPU's autocast keeps softmax in bf16; on CUDA it runs in fp32, which the formula
# knows through `device_type`.)

# %%
saved_check = book.table("accounting_saved_activations_check", lambda: saved_activations_check(
    {"check": ModelConfig(**check_model)}, check_batch, check_context))
report.show_table(shown(saved_check))
book.state(acc_book.saved_check_claim(saved_check))

# %% [markdown]
# **Peak memory on the GPU.** 01 profiling stores, for each configuration, each mode's own peak allocated
# memory (`fwd_peak_gib`, `fwdbwd_peak_gib`, `step_peak_gib`, measured in the same steps as that mode's time)
# in `lm_step.csv`; 08 sharding stores per-rank peaks by phase in `sharding_benchmark.csv`. Both are read as
# they are now in `results/`, each named with the commit and GPU that measured it. For each lm_step mode we
# predict its peak from what it holds: parameters, autocast's weight copies and saved activations, the
# gradients (forward + backward) and AdamW's state (train step). The benchmark drops the gradients before
# each forward, and the backward frees each block's activations as that block's gradients appear, so the
# peak is parameters (+ AdamW state) + the larger of *activations + weight copies* (the backward's start)
# and *gradients* (its end), not their sum (`lab.accounting.step_peak_bytes`). For each sharding row we
# predict a steady-state step per rank (state divided by the ranks where the implementation shards it; the
# wrappers' gradient buffers live through the step, so there the parts add up) and set it against the
# largest of its peaks. The prediction counts no temporaries (logits and their gradient, AdamW scratch,
# allocator rounding). The rows furthest from their prediction are shown as they are.

# %%
lm_step = acc_book.measured_results(book, "lm_step", "01_profiling")
sharding = acc_book.measured_results(book, "sharding_benchmark", "08_sharding")
check = predicted_vs_measured(lm_step, sharding)
acc_book.save_memory_check(book, check)
claim = acc_book.memory_check_claim(check)
book.answer(claim, section="5 · Predicted vs measured memory")
book.state(claim)
acc_book.show_memory_check(check, furthest=5)

# %% [markdown]
# Every comparison, and the same as a plot:

# %%
acc_book.show_memory_check(check)
acc_book.memory_check_figure(check)
