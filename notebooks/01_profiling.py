# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Profiling: where a Transformer's training time goes
#
# We time the language model end to end (forward, backward, full AdamW step) for every size and context length
# in the spec, in fp32 and under bf16 autocast; study why the first steps of a process are slow; and then look
# inside one step with `torch.profiler`: which kernels run, how much of the time is matrix multiplication, and
# what softmax costs inside attention.
#
# **How to read the numbers.** Every answer is stated from this render's tables (or, with `replay=True`, from
# the tables saved in `results/`, which say which machine measured them). A step time is the median of its
# timed steps, with its spread; a comparison says "faster" or "slower" only under the rule stated at the top,
# "within noise" otherwise. A render on a CPU says which of its findings do not carry over to GPUs.

# %% tags=["parameters"]
quick = True                      # toy sizes on the CPU; the full render (GPU) sets False
device = "auto"
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
replay = False                    # True: read the tables back from results_dir instead of measuring
sizes = None                      # None: every spec size (full) or tiny and mini (quick)
contexts = None                   # None: 128, 256, 512, 1024 (full) or 32, 64 (quick)
default_context = None            # the context at which the train step is also timed: 512 (full), 64 (quick)
dtypes = ("fp32", "bf16")         # training precisions: fp32, and bf16 autocast
batch = 4
warmup = None                     # untimed rounds before the timed ones: 2 (full and quick)
steps = None                      # timed steps per mode: 5 (full), 6 (quick)
warmup_size = None                # model of the warm-up study: large (full), tiny (quick)
warmups = (0, 1, 2, 5)            # warm-up counts of the study, each in a fresh process
cold_runs = None                  # fresh processes without warm-up (samples of the first step): 5
profile_size = None               # model of the kernel profile: 2.7B (full), mini (quick)
profile_context = None            # 512 (full), 64 (quick)
profile_steps = 3                 # profiled steps per mode

# %%
import lab

lab.use_triton_interpreter()  # without a CUDA GPU: Triton kernels run in Triton's interpreter (said once)

# %%
from functools import partial

import matplotlib.pyplot as plt

from lab import paths
from lab.bench import lm as bench
from lab.bench.profiles import KernelProfiles
from lab.book import ledger, plots, report
from lab.book.profiling import kernels as kernel_profiles
from lab.book.profiling import present as profiling
from lab.book.profiling import warmup as warmup_study
from lab.measure.results import measured_on

s = profiling.ProfilingSettings(quick, device, sizes=sizes, contexts=contexts, default_context=default_context,
                                dtypes=dtypes, batch=batch, warmup=warmup, steps=steps, warmup_size=warmup_size,
                                warmups=warmups, cold_runs=cold_runs, profile_size=profile_size,
                                profile_context=profile_context, profile_steps=profile_steps)
plots.set_style()
book = report.Chapter("01_profiling", s.params(), results_dir, replay=replay)
book.show_machine()
book.show_answers()

# %% [markdown]
# ## The models
#
# Vocabulary 10,000, batch 4, pre-norm RMSNorm, RoPE, SwiGLU, causal multi-head attention, untied LM head.
# (Some courses call the 2560-wide model "xl"; here "xl" is the 1600-wide one and that one is "2.7B".) The quick
# profile uses two toy sizes, `tiny` and `mini`, that are not in the spec's table.

# %%
report.show_table(profiling.size_table(s.sizes), floatfmt=".1f")

# %% [markdown]
# ## End-to-end timing
#
# `lab.bench.lm.sweep_lm` builds each model, runs `warmup` untimed steps and then `steps` timed ones of each
# mode, synchronizing the GPU after every step: the forward alone, forward+backward (the backward is timed on its
# own inside each of those steps), and at the default context the full AdamW train step. The modes take turns
# round by round after untimed warm-up rounds, so they see the same machine; out-of-memory is a row
# (`status="oom"`), not a crash. Every size and context is measured in fp32 and under bf16 autocast. The rows go
# into the headline table `lm_step.csv` (tagged with this notebook as their source), every timed sample into
# `01_lm_samples.csv`, and into the book's ledger. Each mode is also run once more under a kernels-only profile:
# its *GPU time* (`fwd_gpu_ms`, ...), how long the GPU ran kernels. A row whose GPU was busy for less than 80%
# of its wall time is *host-bound*: the host's kernel launches set its time, which moves with the host's pace
# and load from one run to the next, on one machine too, so a comparison with it gives no verdict unless its
# ratio lies beyond 2x either way, and states the GPU times. Where notebook 02 (or another report) measured the same configuration on the same GPU
# model, the GPU times must agree, and the wall times within the GPU's idle time, or the render stops and names
# both rows. Each row is logged as it is measured (`book.rows`), so a render that a time limit stops continues
# at the next row when resumed at the same commit on the same kind of machine (`lab.render --resume`).

# %%
lm = book.table("lm_step", lambda: bench.sweep_lm(s.sizes, s.contexts, s.dtypes, modes=s.modes_for, batch=s.batch,
                                                  warmup=s.warmup, steps=s.steps, device=s.device,
                                                  log=book.rows("lm_step")),
                save=bench.lm_step_table)
lm = bench.with_samples(lm, book.table("01_lm_samples", lambda: bench.samples_long(lm)))
book.ledger(ledger.lm_step_entries(lm), table="lm_step")
on = measured_on(lm)
profiling.show_device_caveat(on)
report.show_table(profiling.timing_table(lm), floatfmt=".4g")

# %%
profiling.plot_timings(lm)
plt.show()

# %%
book.state(*profiling.timing_findings(lm, s.default_context))
book.answer(profiling.step_claim(lm, s.default_context), section="End-to-end timing")
book.answer(profiling.backward_claim(lm), section="End-to-end timing")

# %% [markdown]
# ### bf16 autocast at every context
#
# The same sweep under bf16 autocast (fp32 master weights, matmuls in bf16), each configuration against its fp32
# row: the ratio of medians bf16 / fp32 with its 95% interval (below 1: bf16 is faster) and the verdict; notebook
# 02 looks at mixed precision in depth.

# %%
pairs = profiling.dtype_comparisons(lm)
report.show_table(profiling.speedup_table(pairs))
profiling.plot_speedup_by_context(pairs)
plt.show()
book.answer(profiling.dtype_claim(pairs, lm), section="bf16 autocast at every context")

# %% [markdown]
# ## Warm-up: why the first steps are slow
#
# Each warm-up setting runs in a **fresh Python process** (`python -m lab.bench --json`), because what warm-up
# hides is paid once per process; the settings without warm-up run in several processes, so that the first
# step has more than one sample and can be compared with the steady state (every step after the most warm-up)
# beyond the noise. What a cold process pays for depends on the device: on a GPU it is mostly CUDA setup
# (context, kernel loading, cuBLAS handles, allocator growth); on a CPU other one-time costs. The answer says
# which applies to this render, and whether the first step is slow here at all.

# %%
wu = book.table("01_warmup", lambda: bench.warmup_study(s.warmup_size, warmups=s.warmup_runs, steps=s.steps,
                                                        context=s.default_context, batch=s.batch, device=s.device))
warmup_study.plot_warmup(wu, s.warmup_size)
plt.show()
report.show_table(warmup_study.warmup_summary(wu), floatfmt=".3g")
book.answer(warmup_study.cold_start_claim(wu, on), section="Warm-up: why the first steps are slow")

# %% [markdown]
# ## Inside one step: a kernel profile
#
# `lab.bench.lm.profile_lm` runs warm-up steps, then profiles a few steps of each mode with `torch.profiler`
# (CPU and, on a GPU, CUDA activities) using the **naive** attention, whose three phases carry `record_function`
# and NVTX ranges (so the same code can be run under `nsys`). Each profile is exported as a Chrome/Perfetto trace
# into the artifacts folder (git-ignored; this cell regenerates it). On a GPU the tables list kernels by GPU time;
# on a CPU there are no kernels, and they list aten operators by their own CPU time instead.

# %%
trace_dir = paths.artifacts_dir(artifacts_dir) / "traces"
profiles = KernelProfiles(partial(bench.profile_lm, device=s.device, steps=s.profile_steps), s.profile_size,
                          s.profile_context, s.batch, trace_dir)
kernels = book.table("01_kernels", profiles.kernels)
profile_steps_table = book.table("01_profile_steps", profiles.step_times)
kernel_profiles.show_top_kernels(kernels)

# %%
kernel_profiles.plot_class_shares(kernels, s.profile_size)
plt.show()
book.state(*kernel_profiles.profile_findings(profile_steps_table, kernels, lm, trace_dir))
book.answer(kernel_profiles.matmul_claim(kernels), section="Inside one step: a kernel profile")

# %% [markdown]
# ### Softmax against the two matrix products inside attention
#
# The naive attention's three ranges (`attention/scores`, `attention/softmax`, `attention/final_matmul`) summed
# over the forward step. FLOPs: each matmul costs 2·b·h·s²·d, softmax about 5 operations per score (max,
# subtract, exp, sum, divide) and the causal mask one more; so softmax has about 3/(2d) of the matmuls' FLOPs.

# %%
ranges = book.table("01_attention_ranges", profiles.attention_ranges)
report.show_table(kernel_profiles.attention_table(ranges), floatfmt=".3g")
book.answer(kernel_profiles.softmax_claim(ranges, on),
            section="Softmax against the two matrix products inside attention")
