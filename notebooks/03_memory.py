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
# Snapshot pickles and the memory_viz HTML pages go to `artifacts_dir` (git-ignored); this report shows
# plots and tables derived from them. Every number in the prose is computed from the tables.

# %% tags=["parameters"]
quick = True                      # a toy model on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
size = None                       # None: "2.7B" (full) or a 4-block toy (quick)
batch = 4
dtype = "fp32"                    # dtype of the timelines and of the checkpointing sweep
timeline_context = None           # None: 512 (full) or 64 (quick)
peak_contexts = None              # None: 128, 256, 512, 2048 (full) or 32, 64 (quick)
peak_dtypes = ["fp32", "bf16"]
block_context = None              # context of the saved-tensor accounting; None: the checkpoint context
checkpoint_context = None         # None: 2048 (full) or 64 (quick)
checkpoint_group_sizes = None     # None: no checkpointing and every divisor of the number of blocks
compile_rmsnorm = True            # RMSNorm saved tensors eager vs torch.compile'd
max_entries = 1_000_000           # allocator events kept by the snapshot recorder

# %%
import math
import os

import matplotlib.pyplot as plt
import pandas as pd
import torch

from lab.model import checkpointing
from lab.measure import memory, results
from lab import paths
from lab.book import plots, report
from lab.measure.step import random_batch
from lab.measure.device import empty_cache, resolve_device
from lab.model.transformer import ModelConfig, RMSNorm, TransformerLM, config_for
from lab.measure.saved_tensors import saved_tensor_report

dev = resolve_device(device)
if quick:
    cfg = ModelConfig(d_model=64, d_ff=256, num_layers=4, num_heads=4, context_length=64, vocab_size=1000)
    size_name = size or "toy (d64, 4 blocks)"
    timeline_context = timeline_context or 64
    peak_contexts = peak_contexts or [32, 64]
    checkpoint_context = checkpoint_context or 64
else:
    size_name = size or "2.7B"
    timeline_context = timeline_context or 512
    peak_contexts = peak_contexts or [128, 256, 512, 2048]
    checkpoint_context = checkpoint_context or 2048
    cfg = config_for(size_name)
block_context = block_context or checkpoint_context
cfg = ModelConfig(**{**cfg.__dict__, "context_length": max([timeline_context, checkpoint_context, block_context]
                                                           + list(peak_contexts))})
checkpoint_group_sizes = checkpoint_group_sizes or [None] + [k for k in range(1, cfg.num_layers + 1)
                                                             if cfg.num_layers % k == 0]
autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
art = paths.artifacts_dir(f"{artifacts_dir}/03_memory")

params = dict(quick=quick, device=str(dev), size=size_name, d_model=cfg.d_model, num_layers=cfg.num_layers,
              batch=batch, dtype=dtype, timeline_context=timeline_context, peak_contexts=list(peak_contexts),
              peak_dtypes=list(peak_dtypes), block_context=block_context, checkpoint_context=checkpoint_context,
              checkpoint_group_sizes=[k for k in checkpoint_group_sizes], compile_rmsnorm=compile_rmsnorm)
plots.set_style()
report.show_machine(params)
if dev.type == "cpu":
    report.say("_On the CPU, snapshots come from `torch.profiler`'s memory timeline converted to the "
               "memory_viz format (the CPU has no caching allocator to record); the sizes are exact tensor "
               "sizes, without the CUDA allocator's rounding._")

# %% [markdown]
# ## The residual stream
#
# Every block reads and writes one `batch × context × d_model` activation, the residual stream. In fp32
# (4 bytes per element) its size is:

# %%
MiB, GiB = 2**20, 2**30
fmt = memory.format_bytes
residual = pd.DataFrame([dict(context=c, batch=batch, d_model=cfg.d_model,
                              residual_mib=checkpointing.residual_stream_bytes(batch, c, cfg.d_model, 4) / MiB)
                         for c in sorted(set(peak_contexts) | {timeline_context, checkpoint_context})])
results.save_results(residual, "memory_residual_stream", results_dir, params)
report.show_table(residual, floatfmt=".4g")
r_ck = residual.set_index("context").loc[checkpoint_context, "residual_mib"] * MiB
report.say(f"For the {size_name} model (d_model {cfg.d_model}) at batch {batch} and context {checkpoint_context}, "
           f"one residual-stream activation is {batch} × {checkpoint_context} × {cfg.d_model} × 4 bytes = "
           f"**{fmt(r_ck)}** ({r_ck / MiB:,.4g} MiB); the {cfg.num_layers} block inputs alone are "
           f"{fmt(cfg.num_layers * r_ck)}.")

# %% [markdown]
# ## Timelines: a forward pass, and two full training steps
#
# `lab.measure.memory.record_training_snapshot` runs the region under `record_memory_snapshot` (on CUDA,
# `torch.cuda.memory._record_memory_history`; the pickle opens in memory_viz) and marks each phase.
# The plot stacks the largest allocations as coloured bands at the bottom, as memory_viz does; the
# black line is all active memory, and each phase's peak is marked.

# %%
torch.manual_seed(0)
with torch.device(dev):
    model = TransformerLM(cfg)
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
tokens, targets = random_batch(cfg, batch, dev, context=timeline_context)

fwd_rec = memory.record_training_snapshot(model, (tokens, targets), art / "forward.pickle", forward_only=True,
                                          autocast_dtype=autocast_dtype, max_entries=max_entries)
fig, ax = plt.subplots(figsize=(11, 4.5))
memory.plot_active_memory_timeline(fwd_rec.snapshot, fwd_rec.marks, ax=ax,
                                   title=f"{size_name}: one forward pass (context {timeline_context}, {dtype})")
plots.save_figure(fig, "03_timeline_forward", results_dir)
plt.show()
fwd_peaks = memory.peaks_by_phase(memory.active_memory_timeline(fwd_rec.snapshot, marks=fwd_rec.marks))
report.show_table(fwd_peaks, floatfmt=".4g")

# %%
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
step_rec = memory.record_training_snapshot(model, (tokens, targets), art / "train_step.pickle", optimizer=optimizer,
                                           steps=2, autocast_dtype=autocast_dtype, blocks=model.blocks,
                                           max_entries=max_entries)
fig, ax = plt.subplots(figsize=(11, 4.5))
memory.plot_active_memory_timeline(step_rec.snapshot, step_rec.marks, ax=ax,
                                   title=f"{size_name}: two AdamW training steps (context {timeline_context}, {dtype})")
plots.save_figure(fig, "03_timeline_train_step", results_dir)
plt.show()
step_peaks = memory.peaks_by_phase(memory.active_memory_timeline(step_rec.snapshot, marks=step_rec.marks))
step_peaks = step_peaks[step_peaks["phase"].isin([m[0] for m in step_rec.marks if m[0] != "end"])]
results.save_results(step_peaks.assign(context=timeline_context, dtype=dtype), "memory_timeline_phases",
                     results_dir, params)
report.show_table(step_peaks, floatfmt=".4g")
html = [memory.export_memory_viz_html(rec.snapshot, art / f"{name}.html")
        for name, rec in (("forward", fwd_rec), ("train_step", step_rec))]
shown = [os.path.relpath(h, paths.REPO_ROOT) if paths.resolve(h).is_relative_to(paths.REPO_ROOT) else str(h)
         for h in html]
report.say(f"memory_viz pages for offline viewing: `{shown[0]}`, `{shown[1]}` (the snapshot is embedded; the viewer "
           f"script loads from a CDN); the pickles beside them open in pytorch.org/memory_viz.")

# %%
sp = step_peaks.set_index("phase")
g = lambda phase, col: sp.loc[phase, col] * GiB
top = sp["peak_gib"].idxmax()
state = g("optimizer step 1", "end_gib") - g("forward 1", "start_gib")  # grads are freed again by zero_grad
second = g("optimizer step 2", "end_gib") - g("optimizer step 1", "end_gib")
report.say(
    f"The highest peak of the two steps is in **{top}** ({fmt(g(top, 'peak_gib'))}). The forward pass builds up "
    f"{fmt(g('forward 1', 'end_gib') - g('forward 1', 'start_gib'))} of activations saved for the backward "
    f"(peak {fmt(g('forward 1', 'peak_gib'))}); the backward frees them while it allocates the gradients "
    f"(peak {fmt(g('backward 1', 'peak_gib'))}). After the first optimizer step (and `zero_grad`), memory is "
    f"{fmt(state)} above where step 1 started: AdamW's state, created on first use — two moment buffers, "
    f"expected {fmt(2 * param_bytes)} (2 × the parameters). After the second step it is "
    f"{fmt(abs(second))} {'higher' if second >= 0 else 'lower'} than after the first: no new state. "
    f"That is why step 2's peaks (forward {fmt(g('forward 2', 'peak_gib'))}, backward "
    f"{fmt(g('backward 2', 'peak_gib'))}) exceed step 1's: the optimizer state now lives through the whole step.")

# %% [markdown]
# ### The largest allocations of the forward pass, and where they come from
#
# Torch internals are filtered out of each allocation's stack; `origin` shows the first frames of our
# own code (innermost first).

# %%
largest = memory.largest_allocations(fwd_rec.snapshot, n=10, marks=fwd_rec.marks, phase="forward 1")
results.save_results(largest, "memory_largest_forward_allocations", results_dir, params)
report.show_table(largest.drop(columns=["category"] if not largest["category"].any() else []), floatfmt=".4g")
origins = memory.allocations_by_origin(fwd_rec.snapshot, marks=fwd_rec.marks, phase="forward 1")
report.show_table(origins.head(10), floatfmt=".4g")
logits_mib = batch * timeline_context * cfg.vocab_size * 4 / MiB
ffn_mib = batch * timeline_context * cfg.d_ff * 4 / MiB
report.say(
    f"The largest forward allocation is {largest['size_mib'].iloc[0]:,.4g} MiB, from `{largest['origin'].iloc[0]}`. "
    f"For comparison, the logits are batch × context × vocab × 4 bytes = {logits_mib:,.4g} MiB and one FFN "
    f"hidden activation batch × context × d_ff × 4 bytes = {ffn_mib:,.4g} MiB "
    f"({cfg.d_ff // cfg.d_model}× the residual stream). By origin, `{origins['origin'].iloc[0]}` allocates the most "
    f"in the forward pass: {origins['count'].iloc[0]} allocations, {origins['total_mib'].iloc[0]:,.4g} MiB in all "
    f"({origins['share'].iloc[0]:.0%} of the forward's allocations).")

# %% [markdown]
# ### Peak memory by phase
#
# `lab.measure.memory.peak_memory_by_phase` resets the peak statistic before each phase (on CUDA,
# `max_memory_allocated`; on the CPU it reads the same numbers off a recorded timeline).

# %%
by_phase = memory.peak_memory_by_phase(model, (tokens, targets), optimizer, steps=1 if quick else 2,
                                       autocast_dtype=autocast_dtype)
report.show_table(by_phase, floatfmt=".4g")

# %% [markdown]
# ### Gradient memory per block, read off the backward timeline
#
# A full backward pre-hook on each block marked where its backward began. What a block's window allocates
# and still holds when the optimizer step begins is that block's gradients; the expectation is one
# gradient per parameter (block 0's window also computes the embedding's gradient).

# %%
grads = memory.gradient_memory_per_block(step_rec.snapshot, step_rec.marks, step_rec.detail_marks, model.blocks)
results.save_results(grads, "memory_gradients_per_block", results_dir, params)
report.show_table(grads.head(4), floatfmt=".4g")
fig, ax = plt.subplots(figsize=(9, 3.5))
ax.bar(grads["block"], grads["measured_mib"], label="measured (survives the backward)")
ax.plot(grads["block"], grads["expected_mib"], "k_", markersize=14, label="expected: parameter bytes")
ax.set_xlabel("block")
ax.set_ylabel("gradient memory (MiB)")
ax.set_title("Gradient memory per block, from the backward timeline")
ax.legend(loc="lower right")
plots.save_figure(fig, "03_gradients_per_block", results_dir)
plt.show()
inner = grads[grads["block"] > 0]
report.say(
    f"Blocks 1–{cfg.num_layers - 1} each leave {inner['measured_mib'].median():,.4g} MiB of gradients "
    f"(min {inner['measured_mib'].min():,.4g}, max {inner['measured_mib'].max():,.4g}) against "
    f"{inner['expected_mib'].iloc[0]:,.4g} MiB expected from their parameters (ratio "
    f"{inner['ratio'].median():.3f}); block 0 leaves {grads.loc[grads['block'] == 0, 'measured_mib'].item():,.4g} "
    f"MiB, the extra {grads.loc[grads['block'] == 0, 'measured_mib'].item() - grads['expected_mib'].iloc[0]:,.4g} "
    f"MiB being the embedding's gradient ({model.embedding.weight.numel() * 4 / MiB:,.4g} MiB).")
del optimizer, fwd_rec, step_rec
empty_cache()

# %% [markdown]
# ## Peak memory across context lengths, fp32 vs bf16 autocast
#
# Forward pass (with autograd recording, as in training) and a full training step (two AdamW steps, so the
# optimizer state is included). Configurations that do not fit are rows with `status = oom`.

# %%
peaks = memory.peak_memory_table(model, peak_contexts, peak_dtypes, batch=batch)
results.save_results(peaks.assign(size=size_name), "memory_peaks", results_dir, params)
table = peaks.assign(peak=lambda d: d.apply(lambda r: f"{r['peak_gib']:.4g}" if r["status"] == "ok" else "OOM",
                                              axis=1)).pivot_table(index=["mode", "context"], columns="dtype",
                                                                   values="peak", aggfunc="first")
report.say(f"**Peak memory (GiB)** of {size_name}, batch {batch}")
report.show_table(table.reset_index())

# %%
ok = peaks[peaks["status"] == "ok"].pivot_table(index=["mode", "context"], columns="dtype", values="peak_gib")
oom_rows = peaks[peaks["status"] != "ok"]
if {"fp32", "bf16"} <= set(ok.columns):
    both = ok.dropna(subset=["fp32", "bf16"]).assign(change=lambda d: d["bf16"] / d["fp32"] - 1)
    lines = []
    for mode in ("forward", "train_step"):
        if mode not in both.index.get_level_values(0):
            continue
        m = both.loc[mode]
        parts = [f"{m.loc[c, 'change']:+.1%} at context {c} ({m.loc[c, 'fp32']:.3g} → {m.loc[c, 'bf16']:.3g} GiB)"
                 for c in sorted({m.index.min(), m.index.max()})]
        lines.append(f"{'the forward pass' if mode == 'forward' else 'a training step'}: " + ", ".join(parts))
    changes = both["change"]
    report.say(
        f"bf16 autocast changes peak memory by between {changes.min():+.1%} and {changes.max():+.1%} — "
        + "; ".join(lines) + ". It is far from halving it: autocast saves the activations for the backward in "
        "bf16 (half the bytes of the matmul outputs), but parameters, gradients and AdamW's two moments stay "
        "fp32, autocast caches a bf16 copy of every weight for the duration of the forward (half the parameter "
        "bytes more), and the norms, softmax and loss still produce fp32 tensors. "
        + ("So the saving grows with the activations' share of memory, i.e. with the context length"
           if both["change"].groupby(level=0).apply(lambda c: c.iloc[-1] <= c.iloc[0]).all()
           else "Here the saving does not grow steadily with the context length")
        + (", and where the activations are small the weight copies make bf16 use *more* memory."
           if changes.max() > 0 else "."))
if len(oom_rows):
    report.say(f"Out of memory: {', '.join(f'{r.mode} at context {r.context} in {r.dtype}' for r in oom_rows.itertuples())}.")

# %% [markdown]
# ## What a block saves for the backward pass
#
# `lab.measure.saved_tensors.saved_tensor_report` installs `torch.autograd.graph.saved_tensors_hooks` and names
# the operation (grad_fn) that saved each tensor by walking the autograd graph. Tensors that share storage
# (a view, or one input saved by the q, k and v projections) are counted once, since autograd keeps the
# whole storage alive once; parameters that are saved (a matmul's weight) are listed apart because they
# exist anyway.

# %%
block = model.blocks[0]
x = torch.randn(batch, block_context, cfg.d_model, device=dev, requires_grad=True)
ctx_cast = torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype else torch.autocast(dev.type,
                                                                                                enabled=False)
with ctx_cast:
    saved = saved_tensor_report(block, x)
ops = saved.by_op()
results.save_results(ops.assign(context=block_context, dtype=dtype), "memory_block_saved_by_op", results_dir,
                     params)
report.show_table(ops.head(8), floatfmt=".3g")
report.show_table(saved.by_module(depth=2).head(8), floatfmt=".3g")
top5 = ops.head(5)
report.say(
    f"One block at batch {batch}, context {block_context} saves **{fmt(saved.total_bytes)}** for the backward "
    f"({saved.total_bytes / checkpointing.residual_stream_bytes(batch, block_context, cfg.d_model, 4):.1f}× its "
    f"input). The five largest contributors: "
    + ", ".join(f"`{r.op}` {fmt(r.bytes)} ({r.share:.0%})" for r in top5.itertuples())
    + f" — together {top5['share'].sum():.0%}.")
del x, saved
empty_cache()

# %% [markdown]
# ### RMSNorm, eager vs `torch.compile`
#
# Eager RMSNorm is several ops (`pow`, `mean`, `rsqrt`, two `mul`s), each saving what its own backward
# needs. Compiled, the whole norm becomes one fused function whose backward recomputes the cheap parts.

# %%
norm = RMSNorm(cfg.d_model).to(dev)
xn = torch.randn(batch, block_context, cfg.d_model, device=dev, requires_grad=True)
norm_rows = []
for label, fn in [("eager", norm)] + ([("compiled", torch.compile(norm))] if compile_rmsnorm else []):
    rep = saved_tensor_report(norm, xn, forward=fn)
    norm_rows.append(dict(rmsnorm=label, saved_mib=rep.total_bytes / MiB,
                          saved_inputs=rep.total_bytes / (xn.numel() * 4),
                          ops=", ".join(f"{o} ({b / MiB:,.3g} MiB)" for o, b in rep.by_op()[["op", "bytes"]].values)))
norm_table = pd.DataFrame(norm_rows)
results.save_results(norm_table.assign(context=block_context), "memory_rmsnorm_saved", results_dir, params)
report.show_table(norm_table, floatfmt=".4g")
nt = norm_table.set_index("rmsnorm")
if "compiled" in nt.index:
    report.say(f"Eager RMSNorm saves {fmt(nt.loc['eager', 'saved_mib'] * MiB)} "
               f"({nt.loc['eager', 'saved_inputs']:.2f}× its input); compiled, "
               f"{fmt(nt.loc['compiled', 'saved_mib'] * MiB)} ({nt.loc['compiled', 'saved_inputs']:.2f}×): fusion keeps "
               f"the input and the per-row statistic and recomputes the normalised activations in the backward.")
del xn, norm
empty_cache()

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
A = ops["bytes"].sum() * (checkpoint_context / block_context)
r = checkpointing.residual_stream_bytes(batch, checkpoint_context, cfg.d_model, 4)
model_table = checkpointing.checkpoint_memory_table(cfg.num_layers, r, A)
k_star = math.sqrt(cfg.num_layers * r / A)
report.show_table(model_table, floatfmt=".4g")
report.say(f"With r = {fmt(r)} and A = {fmt(A)} per block at context {checkpoint_context}, the "
           f"model's optimum is k* = √(N·r/A) = {k_star:.2f}, so among divisors of {cfg.num_layers} it predicts "
           f"k = {checkpointing.best_group_size(cfg.num_layers, r, A)} "
           f"({fmt(model_table.loc[model_table['strategy'] == 'single', 'modelled_bytes'].min())} of activations, "
           f"vs {fmt(model_table.loc[model_table['strategy'] == 'none', 'modelled_bytes'].item())} without "
           f"checkpointing and {fmt(model_table.loc[model_table['strategy'] == 'nested', 'modelled_bytes'].item())} "
           f"nested).")

# %% [markdown]
# ### Measured: peak memory of a training step for each group size
#
# The AdamW state is created first, so every measured step carries parameters, gradients and optimizer
# state as in steady-state training.

# %%
ck_batch = random_batch(cfg, batch, dev, context=checkpoint_context)
sweep = checkpointing.checkpoint_sweep(model, ck_batch, checkpoint_group_sizes, include_nested=True,
                                       autocast_dtype=autocast_dtype)
static_gib = 4 * param_bytes / GiB  # parameters, gradients and AdamW's two moments, all fp32
sweep = sweep.merge(model_table[["strategy", "group_size", "modelled_mib"]], on=["strategy", "group_size"],
                    how="left")
sweep["modelled_peak_gib"] = static_gib + sweep["modelled_mib"] / 1024
results.save_results(sweep.assign(size=size_name, context=checkpoint_context, batch=batch, dtype=dtype),
                     "memory_checkpoint_sweep", results_dir, params)
report.show_table(sweep.drop(columns=["error"]), floatfmt=".4g")

# %%
single = sweep[(sweep["strategy"] == "single") & (sweep["status"] == "ok")].sort_values("group_size")
fig, ax = plt.subplots()
ax.plot(single["group_size"], single["peak_gib"], "o-", label="measured peak")
ax.plot(single["group_size"], single["modelled_peak_gib"], "s--", label="model: 4×params + (N/k)·r + k·A")
for label, row in sweep[sweep["strategy"].isin(["none", "nested"])].set_index("strategy").iterrows():
    if row["status"] == "ok":
        ax.axhline(row["peak_gib"], linestyle=":", color="grey")
        ax.text(single["group_size"].max(), row["peak_gib"], f" {label}", va="bottom", ha="right", fontsize=9)
ax.set_xscale("log", base=2)
ax.set_xlabel("blocks per checkpointed group (k)")
ax.set_ylabel("peak memory of a train step (GiB)")
ax.set_title(f"{size_name}, batch {batch}, context {checkpoint_context}, {dtype}")
ax.legend()
plots.save_figure(fig, "03_checkpoint_sweep", results_dir)
plt.show()

# %%
if len(single):
    best = single.loc[single["peak_gib"].idxmin()]
    ks = single["group_size"].tolist()
    i = ks.index(best["group_size"])
    def describe(j):
        row = single.iloc[j]
        return f"k = {int(row['group_size'])}: {fmt(row['peak_gib'] * GiB)} ({row['step_ms'] / 1e3:.3g} s)"
    neighbours = [describe(j) for j in (i - 1, i + 1) if 0 <= j < len(single)]
    none = sweep[sweep["strategy"] == "none"].iloc[0]
    nested = sweep[sweep["strategy"] == "nested"].iloc[0]
    fails = sweep[sweep["status"] != "ok"]
    report.say(
        f"The best single-level group size is **k = {int(best['group_size'])}**, peaking at "
        f"**{fmt(best['peak_gib'] * GiB)}** ({best['step_ms'] / 1e3:.3g} s per step); its neighbours: "
        + "; ".join(neighbours) + ". "
        + (f"Without checkpointing the step peaks at {fmt(none['peak_gib'] * GiB)} ({none['step_ms'] / 1e3:.3g} s). "
           if none["status"] == "ok" else "Without checkpointing the step does not fit (OOM). ")
        + (f"Nested checkpointing peaks at {fmt(nested['peak_gib'] * GiB)} ({nested['step_ms'] / 1e3:.3g} s, "
           f"{nested['step_ms'] / best['step_ms']:.2f}× the time of k = {int(best['group_size'])}). "
           if nested["status"] == "ok" else "Nested checkpointing ran out of memory. ")
        + (f"It saves no memory over k = {int(best['group_size'])} here (within 2%): with groups that small the "
           f"{cfg.num_layers} saved group inputs are only {fmt(cfg.num_layers * r)}, and the peak is set by "
           f"parameters, gradients and optimizer state ({fmt(4 * param_bytes)}) plus the activations of the one "
           f"block being recomputed and the logits, which nesting does not shrink. "
           if nested["status"] == "ok" and abs(nested["peak_gib"] / best["peak_gib"] - 1) < 0.02 else "")
        + (f"Out of memory: {', '.join(str(int(g)) if not math.isnan(g) else s for s, g in zip(fails['strategy'], fails['group_size']))}."
           if len(fails) else ""))
