# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · FlashAttention-2: Triton against PyTorch
#
# `lab.kernels.flash_triton.FlashAttentionTriton` computes attention tile by tile with an online softmax and
# never writes the `seq × seq` matrix of notebook 04 to memory; its backward recomputes the scores from the
# saved logsumexp. Here we
#
# 1. check every implementation against a float64 reference, head dims 80 and 96 included;
# 2. time it against PyTorch's fused attention (SDPA: its default backend, and its FlashAttention-2 and cuDNN
#    backends by name) and the tiled PyTorch FlashAttention-2 on LM-like shapes in the dtypes of `dtypes`
#    (bf16 and fp16 by default);
# 3. sweep a few lengths in fp32 against naive PyTorch and SDPA;
# 4. decide the performance goals, run the course's timing test, and put the kernel inside the 2.7B model.
#
# Every answer is a claim read from this render's tables, judged by the one rule stated at the top (medians with
# their spread; "faster" or "slower" only beyond the noise, a goal met only where its whole interval clears it).

# %% tags=["parameters"]
quick = True                      # tiny shapes, Triton interpreted on the CPU, no compile; the full render sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: re-render from results/ without measuring
check_impls = None                # correctness; None: every implementation (full), all but compiled ones (quick)
check_ds = None                   # None: 64, 80, 96, 128 (full) or 16, 80, 96 (quick)
check_dtypes = ["bf16", "fp32"]
check_seq = None                  # None: 1024 (full) or 64 (quick); batch 4, causal
impls = None                      # None: triton, sdpa (default backend), sdpa_flash, sdpa_cudnn, pytorch_flash,
                                  # and compiled FlexAttention "flex" (full only: it needs torch.compile)
shapes = None                     # [batch, heads, seq, d, causal]; None: lab.book.flash.bench.LM_SHAPES or two tiny ones
dtypes = None                     # None: bf16 and fp16 (full) or bf16 (quick)
pytorch_flash_max_seq = None      # longer: its Python tile loop is too slow (a row says so); None: 2048 or 64
pytorch_flash_dtypes = ["bf16"]   # the tile loop's time barely depends on the dtype: one is enough
fp32_impls = ["triton", "sdpa", "pytorch_naive"]
fp32_seqs = None                  # batch 1, one head, causal; None: 1024, 4096, 16384 (full) or 32, 64 (quick)
fp32_ds = None                    # None: 64, 128 (full) or 16 (quick)
warmup_ms = 5                     # triton.testing.do_bench budgets per pass (ms); each call runs at least once
rep_ms = 20
cpu_steps = 5                     # timed calls per pass on the CPU (five: the fewest a verdict takes)
course_shape = None               # (batch, seq, d); None: (16, 16384, 64) (full) or (1, 64, 16) (quick)
course_compile = None             # None: [True, False] (full) or [False] (quick)
course_goal_ms = 4.6              # the course's goal for its timing test, on an H100
lm_size = None                    # None: "2.7B" (full) or "tiny" (quick)
lm_context = None                 # None: 512 (full) or 32 (quick)
lm_batch = None                   # None: 4 (full) or 2 (quick)
lm_dtype = None                   # None: "bf16" autocast (full) or "fp32" (quick)
lm_compile = None                 # None: [False, True] (full) or [False] (quick)
lm_warmup = None                  # None: 2 (full; the first compiled step compiles) or 1
lm_steps = None                   # None: 7 (full) or 5
ceiling_n = None                  # matmul ceiling: one n x n x n torch.mm; None: 8192 (full) or 256 (quick)

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
import matplotlib.pyplot as plt

from lab.bench import flash_variants as fv
from lab.bench.attention_grid import correctness_grid
from lab.bench.lm import compare_variants
from lab.book import ledger, plots, report
from lab.book.flash import bench as fl
from lab.book.flash import goals, grid, present
from lab.measure.device import resolve_device

dev = resolve_device(device)
cfg = present.settings(
    quick, dev, check_impls=check_impls, check_ds=check_ds, check_dtypes=check_dtypes, check_seq=check_seq,
    impls=impls, shapes=shapes, dtypes=dtypes, pytorch_flash_max_seq=pytorch_flash_max_seq,
    pytorch_flash_dtypes=pytorch_flash_dtypes, fp32_impls=fp32_impls, fp32_seqs=fp32_seqs, fp32_ds=fp32_ds,
    warmup_ms=warmup_ms, rep_ms=rep_ms, cpu_steps=cpu_steps, course_shape=course_shape, course_compile=course_compile,
    course_goal_ms=course_goal_ms, lm_size=lm_size, lm_context=lm_context, lm_batch=lm_batch, lm_dtype=lm_dtype,
    lm_compile=lm_compile, lm_warmup=lm_warmup, lm_steps=lm_steps, ceiling_n=ceiling_n)
book = report.Chapter("05_flash", cfg.params(), results_dir, replay=replay)
plots.set_style()
book.show_machine()
book.show_answers()

# %% [markdown]
# ## Correct first
#
# Output and the three gradients of each implementation against naive attention computed in float64 on the
# same (rounded) inputs, causal: the Triton kernels (`triton`, and `triton_compiled_bwd` whose backward is
# compiled PyTorch), the tiled PyTorch FlashAttention-2, naive PyTorch and every SDPA backend. A
# low-precision result is expected to differ at the level of its rounding (bf16 keeps 8 significant bits),
# so each error is compared with naive PyTorch's own error in the same dtype and head dimension (at least
# one machine epsilon): within 4× of it, an implementation "agrees". An implementation that cannot run an
# input (a head dimension its kernels lack, an SDPA backend without a kernel for this dtype or device) is a
# row that says so.

# %%
errors = book.table("flash_correctness", lambda: correctness_grid(
    cfg.check_impls, cfg.check_ds, cfg.check_dtypes, seq=cfg.check_seq, device=dev))
report.show_table(errors)
correct = present.correctness_summary(errors)
report.show_table(correct)
book.answer(present.correctness_claim(correct), section="Correct first")

# %% [markdown]
# ## Counting FLOPs
#
# `attention_flops` counts matmul FLOPs (a multiply-add is 2): the forward's `Q Kᵀ` and `P V` are
# `4 · pairs · d`, where `pairs` is the number of (query, key) pairs the mask keeps, `seq(seq+1)/2` for
# causal attention (the papers round it to `seq²/2`). The backward is counted as FlashAttention-2 does it,
# five matmuls including the recomputed `Q Kᵀ`: 2.5× the forward; end-to-end is 3.5×. Every implementation
# is credited with the same count, so TFLOP/s is a speed, not the work each one does.

# %%
report.show_table(present.flops_example(), floatfmt=".4g")

# %% [markdown]
# ## The grid: LM-like shapes
#
# Each implementation on shapes a language model meets (batch × heads ≥ 16, 2k–32k tokens, d 64/80/128,
# causal and not; the leaderboard model's 32 heads of 128 over 32k tokens and the 2.7B model's 4 × 32 heads of
# 80 over 512 tokens among them) in the dtypes of `dtypes`: forward, backward (on one retained forward graph)
# and end-to-end forward+backward, each with `triton.testing.do_bench` (CUDA events, L2 flushed between calls;
# at least 5 samples, their median and spread kept). On a GPU, shapes of at most 1,024 tokens (the 2.7B model's)
# are then timed again as CUDA-graph replays, which replace the eager times for every implementation alike
# (`timing`): their kernels take tens of microseconds, so eagerly the host's launches would be timed instead. A
# replay's backward is its forward+backward minus its forward, derived rather than sampled, so it decides no
# verdict. `kernel` and `bwd_kernel` say which of our kernels ran the forward and the backward. Skipped,
# unsupported and out-of-memory configurations are rows that say why. The same table holds the fp32 sweep
# further down.

# %%
bench = book.table("flash_benchmark", lambda: fl.run_flash_benchmark(
    cfg.sweeps, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, cpu_steps=cfg.cpu_steps, device=dev))
on_cpu = present.interpreted(bench)
if on_cpu:
    report.warn(present.INTERPRETED)
report.show_table(grid.latency_table(bench, "lm"))
report.show_table(report.shown(bench[bench["status"] != "ok"][["sweep", "impl", "dtype", "seq_len", "d", "status",
                                                              "note"]]))
book.state(*grid.status_findings(bench))
book.ledger(ledger.attention_entries(bench), table="flash_benchmark")

# %% [markdown]
# Forward and backward timed apart should add up to forward + backward timed as one call; where they do not, the
# backward timed alone is not the backward a training step runs. Each row's two medians are summed (their spreads
# added in quadrature) and set against the one call under the rule.

# %%
parts = grid.parts_against_whole(bench)
report.show_table(grid.comparison_table(parts))
book.state(grid.parts_claim(parts))

# %% [markdown]
# The shapes replayed from CUDA graphs, called eagerly beside their replays: how much of a short sequence's time
# is the host's.

# %%
host = grid.host_table(bench)
if len(host):
    report.show_table(host)
    book.state(grid.host_claim(bench))

# %% [markdown]
# ## Speedups and TFLOP/s
#
# Triton against each backend, configuration by configuration: the ratio is Triton's time over the reference's
# (below 1 Triton is faster), with its 95% interval and the rule's verdict. The heatmap shows the speed the
# other way round (reference time / Triton time), `≈` where within noise. Then each implementation's end-to-end
# TFLOP/s.

# %%
speed = grid.versus(bench)
report.show_table(grid.comparison_table(speed, "e2e"))
grid.plot_speedup_heatmap(speed)
plt.show()
book.answer(grid.speed_claim(speed, present.INTERPRETED if on_cpu else ""), section="Speedups and TFLOP/s")
report.show_table(grid.tflops_table(bench, "lm"))
book.state(grid.tflops_claim(bench, present.INTERPRETED if on_cpu else ""))

# %% [markdown]
# ## The performance goals
#
# On the LM-like shapes in the dtypes measured, against SDPA's default backend (cuDNN on Hopper), the goals of
# FlashAttention-3's schedule: our forward at least 1.05× SDPA's speed (its time at most 0.952× SDPA's), the
# backward and end to end at least as fast (time at most 1×); the 2.7B model's shape, whose kernels are short, is
# asked forward + backward only, at most SDPA's time. Against FlexAttention (compiled `flex_attention` with a causal
# block mask, a peer rather than the stock default) Triton should be faster on every shape, forward and backward.
# A goal is met only when the whole 95% interval of the time ratio clears it, missed when the whole interval
# falls short and the gap exceeds both spreads, and undecided otherwise.

# %%
goal_sdpa = goals.goal_comparisons(bench)
goal_flex = goals.goal_comparisons(bench, "flex", goals.FLEX_GOAL_SPEED, shape_speeds={})
report.show_table(grid.comparison_table(goal_sdpa + goal_flex))
book.answer(goals.goals_claim(("the default SDPA backend", goal_sdpa), ("FlexAttention", goal_flex)),
            section="The performance goals")

# %% [markdown]
# ### Why the goals are missed
#
# The same time ratios by head dimension and pass. Two causes follow from how the kernels are built. A head
# dimension that is not a power of two (80 for the 2.7B model) runs either in masked power-of-two tiles, so
# part of every tile's matrix work is on zero columns (`useful_columns` below 1), or, where the tile tables
# split it (80 and 96 in 16-bit on a GPU), as two power-of-two column chunks with no masked column
# (`useful_columns` 1). The backward, deterministic without atomics, has each program own the rows it writes:
# the dK/dV programs and the dQ programs both recompute the scores, 7 matrix products per tile pair where a
# kernel that adds dQ from the dK/dV programs (FlashAttention-2 and -3) needs 5. What is left at the powers of
# two, in the forward especially, is scheduling: cuDNN's Hopper kernels overlap one tile's softmax with the next
# tile's matrix products across warp groups and load tiles with TMA; these Triton kernels use Hopper's matrix
# instructions through Triton's software pipelining (the tiles are swept by `python -m lab.bench.flash_sweep sweep`).

# %%
by_d = goals.by_head_dim(goal_sdpa, bench)
report.show_table(by_d)
book.state(goals.why_claim(by_d))

# %% [markdown]
# ### Where the time of the matrix products goes
#
# Each shape's Triton backward: the launch the default tables chose (`fused` or `two_pass`, both 7 matrix
# products per tile pair), its time, the useful rate (FlashAttention-2's 5-product count) and the rate of the
# products it really issues (7/5 of the useful ones, on the columns its tiles compute), against the rate of one
# large `torch.mm` in the same dtype measured here. Then the forward the same way, beside SDPA's default backend
# on the same shapes: both do the same useful work (two products per tile pair), so the share of the ceiling
# each reaches says how much of the gap is the kernel's, not the card's.

# %%
ceilings = book.table("flash_matmul_ceiling", lambda: fl.matmul_ceilings(cfg.dtypes, cfg.ceiling_n, dev))
backward = goals.backward_table(bench, ceilings)
forward = goals.forward_table(bench, ceilings)
report.show_table(backward)
report.show_table(forward)
book.state(goals.ceiling_claim(backward, forward, present.INTERPRETED if on_cpu else ""))

# %% [markdown]
# ### How the compiled kernels wait for their products
#
# A warp group's matrix product on Hopper (`wgmma`) runs asynchronously until the code waits for it. The
# kernels the tile tables launch for a long causal bf16 sequence, compiled for sm_90a (on any machine, GPU or
# not): how many of each kernel's products (its `tl.dot` sites, a loop body counted once) are waited for before
# any other product or exponential is issued. A warp group waiting so computes nothing meanwhile. Two variants
# tried to change this and were removed: a forward that issues the next key tile's scores before this tile's
# softmax compiled to code that still waited for every product at once, and ran slower than the default tiles
# (`results/flash_overlap_sweep`); a dK/dV pass that adds dQ itself (5 products per tile pair instead of 7)
# needed more registers and shared memory and ran slower on most shapes (`results/flash_atomic_check`), and its
# deterministic, ordered form slower still (`results/flash_ordered_check`).

# %%
waits = book.table("flash_product_waits", lambda: fv.product_wait_table())
report.show_table(report.shown(waits))
book.answer(goals.waits_claim(waits), section="How the compiled kernels wait for their products")

# %% [markdown]
# ### Each missed goal against its bound
#
# A goal asks a pass to take at most the reference's time (SDPA's or FlexAttention's, `against`) times the goal.
# At the matrix products the kernel really issues (the forward's two per tile pair, the backward's 7, on the
# columns its tiles compute), that time is a rate: `needs_of_ceiling` is it as a share of the matmul ceiling
# above, beside the share the kernel reaches on the shape (`of_ceiling`) and the most any Triton kernel of the
# pass reaches on a shape of the same head dimension here (`best_of_ceiling`). Needing more than the ceiling
# would mean fewer products; more than any kernel here reaches means the kernels' shared cap (their compiled
# code waits for every product before the softmax, the table above); less means another shape already does it,
# so this shape's tiles are the bound. `needs_with_5` is the backward's need if it issued 5 products per tile
# pair at the same time per product.

# %%
bounds = goals.missed_goal_bounds(bench, goal_sdpa + goal_flex, ceilings, waits)
report.show_table(bounds)
book.answer(goals.bounds_claim(bounds), section="Each missed goal against its bound")

# %% [markdown]
# ## fp32: is Triton ever slower than naive PyTorch or SDPA?
#
# Batch 1, one head, causal, a few lengths and d 64/128 (full profile), in fp32. An fp32 tile holds twice
# the bytes of a bf16 one and fp32 matrix products are slower on every GPU path, so tiles tuned for bf16
# may lose here; the question is whether the kernel ever falls behind the two PyTorch baselines.

# %%
fp32 = grid.versus(bench, sweep="fp32")
report.show_table(grid.latency_table(bench, "fp32"))
report.show_table(grid.comparison_table(fp32))
book.answer(grid.fp32_claim(fp32, present.INTERPRETED if on_cpu else ""),
            section="fp32: is Triton ever slower than naive PyTorch or SDPA?")

# %% [markdown]
# ## The course's timing test
#
# `FlashAttentionTriton.apply` on q, k, v of shape 16 × 16384 × 64 in bf16, causal (full profile; the quick
# profile shrinks it): forward, `o.sum()`, backward, timed as one call with `do_bench`, under `torch.compile`
# and eagerly. The course's goal is 4.6 ms on an H100; on another GPU the comparison is only a pointer. The grid
# timed the same work for SDPA's default backend, which says how fast the goal asks Triton to be against it.

# %%
course = book.table("flash_course_timing", lambda: fv.course_timing_table(
    cfg.course_compile, *cfg.course_shape, device=dev, cpu_steps=cfg.cpu_steps))
report.show_table(report.shown(course))
book.answer(present.course_claim(course, bench, cfg.course_goal_ms), section="The course's timing test")

# %% [markdown]
# ## The 2.7B model with FlashAttention
#
# The same Transformer with its attention swapped (`attention="flash_triton"` against `"sdpa"`), eagerly and
# under `torch.compile(model)`: a full AdamW train step, batch 4, context 512, bf16 autocast (full profile;
# the quick profile runs the tiny model eagerly), the variants measured one after the other in this process.
# The rows join `lm_step.csv` with this notebook as their source, and the ledger checks them against the other
# reports that measure the same step.

# %%
lm = book.table("lm_step", lambda: compare_variants(
    cfg.lm_size, cfg.lm_variants, context=cfg.lm_context, batch=cfg.lm_batch, dtype=cfg.lm_dtype,
    modes=("train_step",), warmup=cfg.lm_warmup, steps=cfg.lm_steps, device=dev, log=book.rows("lm_step")))
report.show_table(report.shown(lm[["attention", "compile", "step_ms", "step_spread_ms", "step_n", "step_peak_gib",
                                   "status"]]))
book.ledger(ledger.lm_step_entries(lm), table="lm_step")
book.answer(present.lm_claim(lm), section="The 2.7B model with FlashAttention")
