# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Mixed precision: what changes when the math runs in 16 bits
#
# Four steps: why *accumulating* in low precision loses information; what autocast actually does to each tensor
# of a small model (observed with hooks, not assumed); why normalisation statistics are kept in fp32; and how much
# bf16 autocast speeds up every model size.
#
# **How to read the numbers.** Every answer is stated from this render's tables (or, with `replay=True`, from
# the tables saved in `results/`, which say which machine measured them). The first three sections are
# arithmetic and hold on any machine. The timings of the last one depend on the machine: each time is the median
# of its timed steps, and bf16 is called faster or slower than fp32 only under the rule stated at the top.

# %% tags=["parameters"]
quick = True                      # toy sizes on the CPU; the full render (GPU) sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: read the tables back from results_dir instead of measuring
sizes = None                      # None: every spec size (full) or tiny and mini (quick)
context = None                    # None: 512 (full) or 64 (quick)
batch = 4
warmup = None                     # untimed rounds before the timed ones: 2 (full and quick)
steps = None                      # timed steps per mode: 5 (full), 7 (quick)
accumulation_value = 0.01
accumulation_count = 1000
norm_width = 1024                 # width of the synthetic activations in the norm demo

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
import matplotlib.pyplot as plt

from lab.bench import lm as bench
from lab.book import ledger, plots, report
from lab.book.precision import present as precision
from lab.measure import numerics
from lab.measure.results import measured_on

s = precision.PrecisionSettings(quick, device, sizes=sizes, context=context, batch=batch, warmup=warmup,
                                steps=steps, accumulation_value=accumulation_value,
                                accumulation_count=accumulation_count, norm_width=norm_width)
plots.set_style()
book = report.Chapter("02_mixed_precision", s.params(), results_dir, replay=replay)
book.show_machine()
book.show_answers()

# %% [markdown]
# ## 1. Accumulation: summing 0.01 a thousand times
#
# The exact answer is 10. Each variant keeps a running sum (the *accumulator*) in one dtype and adds an *addend*
# stored in another; "upcast" converts the addend to the accumulator's dtype explicitly before adding (otherwise
# PyTorch's in-place `+=` promotes it implicitly). `representation_error` is the part of the error that comes
# only from storing 0.01 in the addend's dtype (count × (stored value − 0.01)); whatever is left is rounding of the
# partial sums, which grows as the sum grows and its unit in the last place with it.

# %%
acc = book.table("mixed_precision_accumulation",
                 lambda: numerics.accumulation_experiment(s.accumulation_value, s.accumulation_count))
report.show_table(acc.drop(columns=["exact"]), floatfmt=".6g")
book.answer(precision.accumulation_claim(acc), section="1. Accumulation: summing 0.01 a thousand times")

# %% [markdown]
# ## 2. What autocast does to each tensor
#
# The toy model is `Linear → ReLU → LayerNorm → Linear`. Forward hooks record the dtype of each module's output,
# a tensor hook records the dtype of the gradient arriving at the logits, and after the backward the parameters'
# `.grad` dtypes are read. Nothing is asserted: this is what the device's autocast does. Autocast keeps a list of
# ops per device that it runs in the low dtype and a list it runs in fp32, and the lists differ between CPU and
# CUDA; on a GPU the probe therefore runs on the CPU as well, to show the difference.

# %%
probe = book.table("mixed_precision_autocast_dtypes",
                   lambda: numerics.autocast_dtype_tables(precision.ToyModel, s.device))
precision.show_autocast_tables(probe)
book.answer(precision.autocast_claim(probe), section="2. What autocast does to each tensor")

# %% [markdown]
# ## 3. Why normalisation statistics stay in fp32
#
# LayerNorm needs the mean and the variance of each row, RMSNorm the mean of squares. Below they are computed
# *naively* in each dtype (every elementwise result rounded to that dtype) for three kinds of activation and
# compared with fp64: ordinary N(0, 1) values; large N(0, 300²) values, as the residual streams of deep models
# reach; and N(100, 1) values, whose large mean LayerNorm must subtract. The table shows relative errors.

# %%
norm = book.table("mixed_precision_norm_statistics", lambda: numerics.norm_statistics_demo(d_model=s.norm_width))
report.show_table(precision.norm_error_table(norm), floatfmt=".3g")
book.answer(precision.norm_claim(norm), section="3. Why normalisation statistics stay in fp32")

# %% [markdown]
# ## 4. fp32 against bf16 autocast, for every size
#
# `lab.bench.lm.sweep_lm` times the forward and forward+backward of every size in fp32 and under bf16 autocast
# (fp32 master weights, matmuls in bf16), taking turns round by round after untimed warm-up rounds with the
# full train step, as notebook 01 times them; a size whose backward does not fit still reports its forward.
# These rows are this notebook's own measurements in the headline table `lm_step.csv`, each mode with its GPU
# time (a kernels-only profile of one more run). A row whose GPU was busy for less than 80% of its wall time is
# *host-bound*: how fast the host launches kernels sets its time, which moves from run to run, so bf16 against
# fp32 there gives no verdict unless the ratio lies beyond 2x either way, and the GPU times say what bf16
# changed on the GPU. The rows enter the book's
# ledger: where notebook 01 (or another report) measured the same configuration on the same GPU model, the GPU
# times must agree, and the wall times within the GPU's idle time, or the render stops and names both rows.

# %%
lm = book.table("lm_step", lambda: bench.sweep_lm(s.sizes, [s.context], ["fp32", "bf16"], precision.TIMED_MODES,
                                                  batch=s.batch, warmup=s.warmup, steps=s.steps, device=s.device,
                                                  log=book.rows("lm_step")),
                save=bench.lm_step_table)
lm = bench.with_samples(lm, book.table("02_lm_samples", lambda: bench.samples_long(lm)))
book.ledger(ledger.lm_step_entries(lm), table="lm_step")
precision.show_device_caveat(measured_on(lm))
report.show_table(precision.timing_table(lm), floatfmt=".4g")

# %%
pairs = precision.dtype_comparisons(lm)
fig = precision.plot_speedup(pairs, lm, title=f"bf16 autocast speedup over fp32, context {s.context}")
plots.save_figure(fig, "02_bf16_speedup", results_dir)
plt.show()
report.show_table(precision.speedup_table(pairs))
book.answer(precision.speedup_claim(pairs, lm), section="4. fp32 against bf16 autocast, for every size")
