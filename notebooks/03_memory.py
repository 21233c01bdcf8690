# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Memory: snapshots, residuals and activation checkpointing
#
# Where does a training step's memory go? We record allocator snapshots (the pickles that
# [pytorch.org/memory_viz](https://pytorch.org/memory_viz) opens) and read them here without a browser:
# active-memory timelines with each phase named, the largest allocations and the code that made them, peak
# memory by phase and across context lengths and dtypes. Then we account for what autograd saves for the
# backward pass ("residuals") and trade it for recomputation with activation checkpointing.
#
# The full profile measures the 2.7B model (d_model 2560, 32 blocks; some courses call it "xl") on a GPU;
# the quick profile a 4-block toy on the CPU. On a CPU, snapshots come from `torch.profiler`'s memory
# timeline converted to the memory_viz format (the CPU has no caching allocator to record), so sizes there
# are exact tensor sizes without the CUDA allocator's rounding.
#
# Snapshot pickles and their HTML pages go to `artifacts_dir` (git-ignored, regenerable by re-running this
# notebook); the report shows plots and tables derived from them. Every answer is stated from the tables
# (`lab.book.claims`), and the answers at the top link to the section that measured them. Peak memory enters
# the book's ledger, which checks it against the other reports that measure it. With `replay=True` the
# tables are read back from `results_dir` instead of measured.

# %% tags=["parameters"]
quick = True                      # a toy model on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: read this notebook's tables from results_dir instead of measuring
size = None                       # None: "2.7B" (full) or the 4-block "mini" toy (quick)
batch = 4
dtype = "fp32"                    # training dtype of the timelines, block accounting and checkpointing sweep
timeline_context = None           # None: 512 (full) or 64 (quick)
peak_contexts = None              # None: 128, 256, 512, 2048 (full) or 32, 64 (quick)
peak_dtypes = ["fp32", "bf16"]
block_context = None              # context of the saved-tensor accounting; None: the checkpoint context
checkpoint_context = None         # None: 2048 (full) or 64 (quick)
checkpoint_group_sizes = None     # None: no checkpointing and every divisor of the number of blocks
compile_rmsnorm = True            # RMSNorm saved tensors eager vs torch.compile'd
max_entries = 1_000_000           # allocator events kept by the snapshot recorder
timing_steps = 5                  # timed steps per checkpointing configuration (at least 5 for a verdict)
top_allocations = 10

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
from lab.book import plots, report
from lab.book.memory import bench as bench_memory
from lab.book.memory import present as memory_book
from lab.book.memory import workload as memory_setup
from lab.book.report import shown
from lab.measure.memory_pages import export_snapshot_pages

setup = memory_setup.MemorySetup.resolve(
    quick, size=size, batch=batch, dtype=dtype, timeline_context=timeline_context, peak_contexts=peak_contexts,
    peak_dtypes=peak_dtypes, block_context=block_context, checkpoint_context=checkpoint_context,
    checkpoint_group_sizes=checkpoint_group_sizes, compile_rmsnorm=compile_rmsnorm, max_entries=max_entries,
    timing_steps=timing_steps)
exp = bench_memory.MemoryExperiment(setup, device, artifacts_dir)
book = report.Chapter("03_memory", dict(quick=quick, device=str(exp.device), **report.settings_params(setup)),
                      results_dir, replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()

# %% [markdown]
# ## The residual stream
#
# Every block reads and writes one `batch × context × d_model` activation, the residual stream. It is what
# a checkpointed group keeps for the backward, so its size sets the price of a checkpoint. In fp32 (4 bytes
# per element):

# %%
residual = book.table("memory_residual_stream", lambda: memory_setup.residual_stream_table(setup))
report.show_table(shown(residual), floatfmt=".4g")
claim = memory_book.residual_claim(residual, setup)
book.answer(claim, section="The residual stream")
book.state(claim)

# %% [markdown]
# ## Timelines: a forward pass, and two training steps
#
# `MemoryExperiment.record_timelines` runs the region under `lab.measure.memory_snapshot.record_memory_snapshot`
# (on CUDA, `torch.cuda.memory._record_memory_history`) and marks each phase of the one phased `TrainStep`:
# `forward`, `backward`, `optimizer step`. The plots stack the largest groups of allocations as coloured bands
# at the bottom, as memory_viz does; the black line is all active memory, and each phase's peak is marked.

# %%
phases = book.table("memory_timeline_phases", exp.record_timelines)
report.show_table(memory_book.phase_peaks_display(phases, "forward"), floatfmt=".4g")
memory_book.show_timeline(exp.snapshot_path("forward"),
                          f"{setup.size}: one forward pass (context {setup.timeline_context}, {setup.dtype})")

# %%
report.show_table(memory_book.phase_peaks_display(phases, "train_step"), floatfmt=".4g")
book.answer(memory_book.timeline_claim(phases), section="Timelines: a forward pass, and two training steps")
book.state(memory_book.timeline_claim(phases), memory_book.phases_claim(phases, setup.parameter_bytes))
memory_book.show_timeline(exp.snapshot_path("train_step"),
                          f"{setup.size}: two AdamW steps (context {setup.timeline_context}, {setup.dtype})")

# %% [markdown]
# ### Opening a snapshot in a browser, online or not
#
# torch's memory_viz page (`torch.cuda._memory_viz.trace_plot`) embeds the snapshot but imports its viewer
# script, `MemoryViz.js`, from a CDN: without a network it is a blank page. So each snapshot also gets a
# self-contained page, `lab.measure.memory_pages.offline_snapshot_html`: the timeline above as an embedded PNG,
# the peak of each phase and the largest allocations, no script at all. The table says what each page loads
# from the web, read off the pages themselves.

# %%
pages = export_snapshot_pages(exp.artifacts, ["forward", "train_step"])
report.show_table(pages)
claim = memory_book.pages_claim(pages)
book.answer(claim, section="Opening a snapshot in a browser, online or not")
book.state(claim)

# %% [markdown]
# ### The largest allocations of the forward pass, and where they come from
#
# Torch internals are filtered out of each allocation's stack; `origin` shows the first frames of our
# own code (innermost first).

# %%
largest = book.table("memory_largest_forward_allocations", lambda: exp.largest_allocations(top_allocations))
origins = book.table("memory_allocations_by_origin", exp.allocations_by_origin)
report.show_table(shown(largest), floatfmt=".4g")
report.show_table(shown(origins), floatfmt=".4g")
claim = memory_book.allocations_claim(largest, origins, setup)
book.answer(claim, section="The largest allocations of the forward pass, and where they come from")
book.state(claim)

# %% [markdown]
# ### Peak memory by phase
#
# `lab.measure.step.peak_memory_by_phase` resets the peak statistic before each phase (on CUDA,
# `max_memory_allocated`; on the CPU it reads the same numbers off a recorded timeline). `init` is what
# exists before the first step: the parameters (and, from the second step on, AdamW's state).

# %%
by_phase = book.table("memory_phase_peaks", exp.phase_peaks)
report.show_table(shown(by_phase), floatfmt=".4g")

# %% [markdown]
# ### Gradient memory per block, read off the backward timeline
#
# A full backward pre-hook on each block marked where its backward began. What a block's window allocates
# and still holds when the optimizer step begins is that block's gradients; the expectation is one
# gradient per parameter (block 0's window also computes the embedding's gradient).

# %%
grads = book.table("memory_gradients_per_block", exp.gradients_per_block)
report.show_table(shown(grads, head=4), floatfmt=".4g")
claim = memory_book.gradients_claim(grads, setup)
book.answer(claim, section="Gradient memory per block, read off the backward timeline")
book.state(claim)
memory_book.gradients_figure(grads)

# %% [markdown]
# ## Peak memory across context lengths, fp32 vs bf16 autocast
#
# Forward pass (with autograd recording, as in training) and a full training step (AdamW's state created
# first, so every measured step carries it). Configurations that do not fit are rows with `status = oom`,
# shown with the memory the device had. Each peak enters the book's ledger (with the checkpointing sweep's
# below), so another report that measures the same step must agree.

# %%
peaks = book.table("memory_peaks", exp.peak_memory)
report.show_table(memory_book.peak_pivot(peaks))
claim = memory_book.mixed_precision_claim(peaks)
book.answer(claim, section="Peak memory across context lengths, fp32 vs bf16 autocast")
book.state(claim)

# %% [markdown]
# ## What a block saves for the backward pass
#
# `lab.measure.saved_tensors.saved_tensor_report` installs `torch.autograd.graph.saved_tensors_hooks` and names
# the operation (grad_fn) that saved each tensor by walking the autograd graph. Tensors that share storage
# (a view, or one input saved by the q, k and v projections) are counted once, since autograd keeps the
# whole storage alive; parameters that are saved (a matmul's weight) are not counted because they exist
# anyway.

# %%
ops = book.table("memory_block_saved_by_op", exp.block_saved_by_op)
modules = book.table("memory_block_saved_by_module", exp.block_saved_by_module)
report.show_table(shown(ops, head=8), floatfmt=".3g")
report.show_table(shown(modules, head=8), floatfmt=".3g")

# %% [markdown]
# ### RMSNorm, eager vs `torch.compile`
#
# Eager RMSNorm is several ops (`pow`, `mean`, `rsqrt`, two `mul`s), each saving what its own backward
# needs. Compiled, the whole norm becomes one fused function whose backward recomputes the cheap parts.

# %%
norm = book.table("memory_rmsnorm_saved", exp.rmsnorm_saved)
report.show_table(shown(norm), floatfmt=".4g")
claim = memory_book.saved_claim(ops, norm)
book.answer(claim, section="What a block saves for the backward pass")
book.state(claim)

# %% [markdown]
# ## Activation checkpointing
#
# `lab.model.checkpointing.activation_checkpointing(model, group_size=k)` swaps the model's block list for
# groups of `k` blocks, each run under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`; the
# model's code is untouched. A checkpointed group keeps only its input; its activations are recomputed
# when the backward reaches it.
#
# **Which strategy is memory-optimal?** With N blocks, r the bytes of one block input and A the bytes one
# block saves (measured above), single-level checkpointing with groups of k keeps N/k group inputs plus one
# group's activations while it is recomputed: (N/k)·r + k·A, minimised at k* = √(N·r/A), i.e. O(√N)
# memory for one extra forward. Nesting does better: split the blocks in halves, checkpoint each half and
# recurse (`lab.model.checkpointing.nested_checkpoint_forward`):
#
# ```python
# def nested_checkpoint_forward(blocks, x, leaf_size=1):
#     if len(blocks) <= leaf_size:
#         for block in blocks:
#             x = block(x)
#         return x
#     mid = len(blocks) // 2
#     x = checkpoint(nested_checkpoint_forward, blocks[:mid], x, leaf_size, use_reentrant=False)
#     return checkpoint(nested_checkpoint_forward, blocks[mid:], x, leaf_size, use_reentrant=False)
# ```
#
# Only the boundaries on one root-to-leaf path of the recursion are alive at a time, O(log N)·r + A, at
# the price of O(log N) recomputations of each block ((L+1)/2 per block on average for N = 2^L with
# PyTorch's early-stopping recomputation). The tests check that both strategies give gradients identical
# (`torch.equal`) to the plain model.

# %%
ck_model = book.table("memory_checkpoint_model",
                      lambda: memory_setup.checkpoint_model(setup, ops["bytes"].sum(), ops["context"].iloc[0]))
report.show_table(shown(ck_model), floatfmt=".4g")
book.state(memory_book.checkpoint_model_claim(ck_model))

# %% [markdown]
# ### Measured: peak memory of a training step for each group size
#
# The AdamW state is created first, so every measured step carries parameters, gradients and optimizer
# state as in steady-state training. The model's prediction adds 4 × the fp32 parameters (weights, gradients,
# two AdamW moments) to the modelled activations; it leaves out the logits and other temporaries. Each
# configuration's step time is the median of `timing_steps` steps, with its spread.

# %%
sweep = book.table("memory_checkpoint_sweep", lambda: exp.checkpoint_sweep(ck_model))
book.ledger(memory_book.ledger_entries(peaks, sweep), table="memory_peaks")
report.show_table(shown(sweep.drop(columns=["step_samples_ms", "error", "limit_gib"])), floatfmt=".4g")
claim = memory_book.checkpoint_claim(sweep, setup.parameter_bytes)
book.answer(claim, section="Measured: peak memory of a training step for each group size")
book.state(claim)
memory_book.checkpoint_figure(sweep, f"{setup.size}, batch {setup.batch}, context {setup.checkpoint_context}, "
                              f"{setup.dtype}")
