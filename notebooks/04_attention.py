# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Attention: the PyTorch baselines
#
# Attention written the obvious way, `softmax(Q Kᵀ / √d) V` as three PyTorch ops, materializes a
# `seq × seq` score matrix per sequence. Here we time it (no heads, batch 8) over head dimensions and
# sequence lengths, watch its memory grow with the square of the length until it no longer fits, account
# for that memory term by term, and see what `torch.compile` does to it: first to the attention function
# alone, then to the whole language model at every size.
#
# Every answer is stated from this render's tables (`lab.book.claims`): times are medians with their spread,
# and every "faster"/"slower" follows the rule stated at the top. Eager and compiled are always measured one
# right after the other in this notebook, never taken from another one.

# %% tags=["parameters"]
quick = True                      # tiny grid and model on the CPU; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: re-render from results/ without measuring
ds = None                         # head dimensions; None: 16, 32, 64, 128 (full) or 16, 32 (quick)
seqs = None                       # sequence lengths; None: 256, 1024, 4096, 8192, 16384 (full) or 64, 128 (quick)
batch = 8
dtype = "fp32"
causal = False                    # the grid measures plain (unmasked) attention
passes = None                     # forward and backward passes per configuration; None: 100 (full) or 5
warmup = None                     # untimed passes first; None: 5 (full) or 1
compile_grid = True               # also run every configuration through torch.compile, right after eager
lm_sizes = None                   # whole model eager vs compiled; None: every size (full) or ["tiny"] (quick)
lm_context = None                 # None: 512 (full) or 64 (quick)
lm_batch = 4
lm_dtype = None                   # None: "bf16" autocast (full) or "fp32" (quick: the CPU)
lm_warmup = None                  # None: 2 (full; the first step of a compiled model compiles) or 1
lm_steps = None                   # timed steps per mode (at least 5 for a verdict); None: 5

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
import matplotlib.pyplot as plt

from lab.bench.attention import naive_attention, run_naive_grid
from lab.book import ledger, plots, report
from lab.book.attention import present, whole_model
from lab.measure.device import resolve_device

dev = resolve_device(device)
cfg = report.with_profile_defaults(dict(ds=ds, seqs=seqs, passes=passes, warmup=warmup, lm_sizes=lm_sizes,
                                        lm_context=lm_context, lm_dtype=lm_dtype, lm_warmup=lm_warmup,
                                        lm_steps=lm_steps), present.QUICK if quick else present.FULL)
book = report.Chapter("04_attention", dict(quick=quick, device=str(dev), batch=batch, dtype=dtype, causal=causal,
                                           compile_grid=compile_grid, lm_batch=lm_batch, **cfg), results_dir,
                      replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()

# %% [markdown]
# ## Naive attention over d × seq
#
# `lab.model.attention.naive_attention` (the model's `"naive"` attention: scores, softmax, weighted sum) on
# `(batch, seq, d)` inputs. For every configuration `lab.bench.attention.run_naive_grid` times `passes` forward
# passes (gradients enabled, as in training), then runs one forward, reads the memory in use
# (`torch.cuda.memory_allocated`) before the backward starts, and times `passes` backward passes on that
# graph: each time is the median of its passes with its spread. Out-of-memory is a row with `status="oom"` and
# the pass it happened in. It also counts, with autograd's saved-tensor hooks, how many bytes the forward keeps
# for the backward (`saved_mib`, on any device). With `compile_grid` each configuration is measured again
# through `torch.compile` right after its eager run (the section below the memory study); this table shows the
# eager rows.

# %%
grid = book.table("attention_naive_grid", lambda: run_naive_grid(
    naive_attention, ds=cfg["ds"], seqs=cfg["seqs"], batch=batch, dtype=dtype, causal=causal, passes=cfg["passes"],
    warmup=cfg["warmup"], compile=(False, True) if compile_grid else (False,), impl="naive", device=dev))
eager = present.rows(grid)
report.show_table(present.grid_table(eager))
claim = present.fit_and_time_claim(eager)
book.answer(claim, section="Naive attention over d × seq")
book.state(claim)

# %% [markdown]
# ## Memory accounting
#
# What the naive forward leaves for the backward, term by term (`naive_attention_memory`): the softmax
# output `P` (`batch × seq² × bytes`, saved once and used by both the softmax backward and the `P @ V`
# backward), plus, beside it, the live inputs, the upstream gradient and the output. The backward then
# needs two more score-sized tensors (`dP` and `dS`). We work it for the smallest configuration that did
# not fit or, if everything fit, for the largest one, and compare with the measurement (memory above the
# configuration's baseline, so cuBLAS's workspace is not charged to it).

# %%
row, kind = present.accounting_config(eager)
report.show_table(present.memory_terms(row))
report.show_table(present.naive_memory_check(row))
claim = present.accounting_claim(eager)
book.answer(claim, section="Memory accounting")
book.state(claim)

# %% [markdown]
# ## How the saved memory scales with length, and what removes it
#
# The fitted exponent of `saved ~ seqᵖ` (from autograd's own count). FlashAttention never materializes
# `P`: it keeps Q, K, V, the output and one logsumexp per query row (`flash_attention_saved_bytes`), and
# recomputes the scores tile by tile in the backward pass: memory linear in the length, paid for with
# one extra `Q Kᵀ` matmul (notebook 05).

# %%
report.show_table(present.saved_memory_scaling(eager))
present.plot_saved_memory(present.saved_memory_curves(eager),
                          f"Memory kept for the backward pass, batch {batch}, {dtype}")
plt.show()
claim = present.scaling_claim(eager)
book.answer(claim, section="How the saved memory scales with length, and what removes it")
book.state(claim)

# %% [markdown]
# ## The same grid through `torch.compile`
#
# Each shape is compiled on its own (`dynamic=False`, after `torch._dynamo.reset()`), right after its eager
# run, so `compile_s` is the one-off cost of the first forward+backward of that shape. Compiled backward
# graphs normally donate saved buffers, which forbids re-running the backward on one graph; the runner
# switches donation off. Each pass compares the compiled median with the eager one (ratio compiled / eager:
# below 1 compiling helps) under the rule at the top.

# %%
versus = present.compile_table(grid)
report.show_table(versus)
present.plot_compile_ratios(versus)
plt.show()
claim = present.compile_claim(grid)
book.answer(claim, section="The same grid through torch.compile")
book.state(claim)

# %% [markdown]
# ## The whole model: eager vs compiled
#
# `lab.bench.lm.compare_variants` times the language model's forward, forward+backward and full AdamW train
# step eagerly and then with `torch.compile(model)` (PyTorch SDPA attention inside), one after the other
# in this process, for every size; a size that does not fit is a row with `status="oom"` whose modes that
# fit keep their numbers. Every time is the median of the timed steps with its spread. (The 2.7B model is the
# one some courses call "xl".) The rows join the book's headline table `lm_step.csv` with this notebook as
# their source, and enter the book's ledger: another report's measurement of the same step must agree. Each
# row is logged as it is measured (`book.rows`), so a render that a time limit stops continues at the next row
# when resumed at the same commit on the same kind of machine (`lab.render --resume`).

# %%
lm = book.table("lm_step", lambda: whole_model.lm_eager_vs_compiled(
    cfg["lm_sizes"], context=cfg["lm_context"], batch=lm_batch, dtype=cfg["lm_dtype"], warmup=cfg["lm_warmup"],
    steps=cfg["lm_steps"], device=dev, log=book.rows("lm_step")))
book.ledger(ledger.lm_step_entries(lm), table="lm_step")
report.show_table(whole_model.lm_table(lm))
whole_model.plot_lm_compile(lm)
plt.show()
claim = whole_model.lm_claim(lm)
book.answer(claim, section="The whole model: eager vs compiled")
book.state(claim)
