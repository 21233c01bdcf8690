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
# those formulas with sympy (`lab.accounting`), checks the collective ones step by step with a small ring
# simulator (`lab.accounting.ring_sim`), applies them to a 330-billion-parameter FFN-only model on TPU v5p, and
# finally compares predicted memory with what the GPU notebooks measured.
#
# Nothing here needs a GPU. Every number in the prose is computed from the tables.

# %% tags=["parameters"]
quick = True                      # only shrinks the simulator's arrays; all formulas are cheap
device = "auto"                   # unused: this notebook computes, it does not measure
results_dir = "results/quick"     # the full render passes "results"
artifacts_dir = "artifacts/quick"
measured_results_dir = "results"  # where the GPU renders saved lm_step.csv and sharding_benchmark.csv
sizes = None                      # model sizes for the memory table (None: every size in the spec)
batch = 4                         # sequences per step for the memory and FLOP tables
context = 512
collective_size_bytes = 1e9       # S for the collective table and plot
ring_bandwidth = 450e9            # W, bytes/s each device sends (H100 NVLink 4: 450 GB/s per direction)
ring_devices = None               # N for the plot (None: 2 ... 64)
sim_devices = [2, 3, 4, 8]        # N checked by the simulator
sim_sizes_bytes = None            # S checked by the simulator (None: depends on quick)
xxl_activation_tokens = 2048      # tokens whose activations one device holds (one 2048-token sequence)
xxl_token_counts = [0, 1, 512, 2048, 8192]
gpu_flops = 989e12                # C of an H100 SXM, dense bf16 FLOP/s, for the GPU FFN example
ffn_tokens = 65536                # B for the GPU FFN example (tokens per step)
check_model = {"d_model": 128, "d_ff": 352, "num_layers": 2, "num_heads": 4}  # model whose saved tensors are counted
check_batch, check_context = 2, 64

# %%
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import sympy as sp
from IPython.display import Math, display

from lab import accounting as acc
from lab.bench import accounting as bench_accounting
from lab.book import plots, report
from lab.measure import results
from lab.model.transformer import MODEL_SIZES, ModelConfig
from lab.accounting.ring_sim import check_closed_forms

sizes = sizes or list(MODEL_SIZES)
ring_devices = ring_devices or list(range(2, 65))
sim_sizes_bytes = sim_sizes_bytes or ([8 * 240, 8 * 2400] if quick else [8 * 240, 8 * 24000, 8 * 2400000])
params = dict(quick=quick, device=device, results_dir=results_dir, artifacts_dir=artifacts_dir,
              measured_results_dir=measured_results_dir, sizes=sizes, batch=batch, context=context,
              collective_size_bytes=collective_size_bytes, ring_bandwidth=ring_bandwidth,
              sim_devices=sim_devices, sim_sizes_bytes=sim_sizes_bytes,
              xxl_activation_tokens=xxl_activation_tokens, xxl_token_counts=xxl_token_counts, gpu_flops=gpu_flops,
              ffn_tokens=ffn_tokens, check_model=check_model, check_batch=check_batch, check_context=check_context)
plots.set_style()
report.show_machine(params)


def show_eq(lhs, rhs):
    """Display ``lhs = rhs`` with rhs a sympy expression."""
    display(Math(f"{lhs} = {sp.latex(rhs)}"))

# %% [markdown]
# ## 1 · Memory and FLOPs of the language model
#
# `TransformerLM` has an untied embedding and LM head, and per block the q/k/v/o projections, SwiGLU's
# three matrices and two RMSNorm weights (no biases):

# %%
show_eq(r"P", sp.expand(acc.parameter_count_expr()))

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
# Saved activations are counted tensor by tensor from what `lab.model.transformer` does (the tests check the count
# against `torch.autograd.graph.saved_tensors_hooks` byte for byte). Per token and block with SDPA in fp32
# that is $11D + 4F + H + 2$ elements: each RMSNorm saves its input, the normalised input, the
# reciprocal RMS and its output; attention q, k, v, its output and the log-sum-exp; the o_proj input; and
# SwiGLU four $F$-wide tensors. Autocast saves most of them in bf16 but keeps the norms in fp32, and every
# Linear saves its own bf16 cast of its input.

# %%
memory = acc.memory_table(sizes, batch, context)
report.show_table(memory, floatfmt=".2f")

# %%
parts = ["params_gib", "grads_gib", "optimizer_gib", "weight_copies_gib", "activations_gib"]
fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
for ax, prec in zip(axes, ["fp32", "bf16_autocast", "bf16"]):
    sub = memory[memory.precision == prec].set_index("size")[parts]
    sub.columns = [c.replace("_gib", "") for c in sub.columns]
    sub.plot.bar(stacked=True, ax=ax, legend=ax is axes[-1], logy=False)
    ax.set_title(prec)
    ax.set_ylabel("GiB (predicted)")
axes[-1].legend(bbox_to_anchor=(1.02, 1), loc="upper left")
fig.suptitle(f"Training memory by kind, batch {batch} x context {context}")
plt.show()

# %%
big = memory[(memory["size"] == sizes[-1])].set_index("precision")
act_share = big.loc["fp32", "activations_gib"] / big.loc["fp32", "total_gib"]
report.say(f"For the {sizes[-1]} model at batch {batch} and context {context}, a fp32 AdamW step needs "
           f"**{big.loc['fp32', 'total_gib']:.1f} GiB**, of which {act_share:.0%} are saved activations. "
           f"Autocast changes the total to {big.loc['bf16_autocast', 'total_gib']:.1f} GiB: it saves "
           f"{big.loc['fp32', 'activations_gib'] - big.loc['bf16_autocast', 'activations_gib']:.1f} GiB of "
           f"activations but adds {big.loc['bf16_autocast', 'weight_copies_gib']:.1f} GiB of bf16 weight copies "
           f"and keeps the fp32 state; only pure bf16 halves the state "
           f"({big.loc['bf16', 'total_gib']:.1f} GiB in total).")

# %% [markdown]
# FLOPs count matrix multiplications only, $2mnk$ each. Per token and block the forward does
# $2\cdot 4D^2$ (projections) $+\,2\cdot 3DF$ (SwiGLU) $+\,2\cdot 2TD$ (the two $T\times T$ score matmuls,
# the full square), and the LM head $2DV$; backward is twice the forward (one product for the input
# gradient, one for the weight gradient). The tests match this count with `torch.utils.flop_counter`.

# %%
show_eq(r"\mathrm{FLOPs}_{\mathrm{fwd}}", acc.forward_flops_expr())
flops = acc.flops_table(sizes, batch, context)
report.show_table(flops, floatfmt=".3g")
report.say(f"At context {context}, attention's score matmuls are {flops.attention_share.max():.1%} of the "
           f"forward FLOPs for the {flops.loc[flops.attention_share.idxmax(), 'size']} model and "
           f"{flops.attention_share.min():.1%} for the {flops.loc[flops.attention_share.idxmin(), 'size']} "
           "model: the matrices grow with $D^2$, the scores only with $D$.")

# %% [markdown]
# ## 2 · The XXL FFN-only model
#
# $D = 16384$, $F = 53248$, 126 blocks of SwiGLU only (three $D \times F$ matrices each). Assumptions:
# fp32 master weights, gradients and AdamW m and v (16 bytes per parameter); saved activations in bf16,
# per token and block $D + 4F$ elements (the FFN input shared by $W_1$ and $W_3$, $W_1$'s output for SiLU's
# backward, SiLU of it and $W_3$'s output for the product, and the product as $W_2$'s input); memory in
# decimal GB as devices are sold (H100: 80 GB, TPU v5p: 95 GB).

# %%
xxl = acc.xxl_memory(xxl_activation_tokens)
show_eq(r"P_{XXL} = 3 D F L", sp.Integer(xxl["params"]))
xxl_table = pd.DataFrame([
    dict(quantity="parameters", value=xxl["params"], unit="count"),
    dict(quantity="fp32 state (weights + grads + AdamW m, v)", value=xxl["state_bytes"] / acc.GB, unit="GB"),
    dict(quantity="bf16 saved activations per token", value=xxl["activation_bytes_per_token"] / 1e6, unit="MB"),
    dict(quantity=f"bf16 saved activations, {xxl_activation_tokens} tokens", value=xxl["activation_bytes"] / acc.GB,
         unit="GB"),
    dict(quantity="H100s (80 GB) to hold the state", value=xxl["devices_to_hold_state"], unit="GPUs"),
    dict(quantity=f"H100s (80 GB) to hold state + activations of {xxl_activation_tokens} tokens",
         value=xxl["devices_to_hold"], unit="GPUs"),
])
report.show_table(xxl_table, floatfmt=",.4g")
report.say(f"The XXL model has {xxl['params'] / 1e9:.1f} B parameters. Its fp32 training state takes "
           f"**{xxl['state_bytes'] / 1e12:.2f} TB**, the memory of **{xxl['devices_to_hold_state']} H100s** "
           f"before a single activation is stored. Each token adds "
           f"{xxl['activation_bytes_per_token'] / 1e6:.1f} MB of bf16 activations, so one sequence of "
           f"{xxl_activation_tokens} tokens adds {xxl['activation_bytes'] / acc.GB:.0f} GB "
           f"({xxl['devices_to_hold']} H100s in all).")

# %% [markdown]
# **FSDP.** Shard the weights, gradients and optimizer state, and half of the activations (in practice
# every other layer's), over $N$ devices:

# %%
state_s, act_s, n_s = sp.symbols("M_{state} M_{act} N", positive=True)
show_eq(r"M_{\mathrm{device}}(N)", acc.fsdp_memory_per_device(state_s, act_s, n_s))
fsdp = acc.fsdp_table(xxl_token_counts)
shown = fsdp.assign(tokens=fsdp.tokens.map("{:,}".format),
                    devices_needed=fsdp.devices_needed.map(lambda n: "none fits" if pd.isna(n) else f"{int(n):,}"))
report.show_table(shown, floatfmt=",.1f")
row = fsdp.set_index("tokens")
state_only = acc.devices_needed(xxl["state_bytes"], 0, acc.TPU_V5P["memory_bytes"])
report.say(f"With the state alone, **N = {state_only}** devices bring it under 95 GB per device "
           f"({xxl['state_bytes'] / acc.GB / state_only:.1f} GB each). " + " ".join(
               f"With the activations of {t:,} token{'s' * (t != 1)}, N = {int(r.devices_needed)}."
               if pd.notna(r.devices_needed)
               else f"With the activations of {t:,} tokens no N suffices: the unsharded half alone is "
                    f"{r.activations_gb / 2:.0f} GB."
               for t, r in row[row.index > 0].iterrows()))

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
for name, fn in [("all-gather", acc.ring_all_gather_time), ("reduce-scatter", acc.ring_reduce_scatter_time),
                 ("all-reduce", acc.ring_all_reduce_time), ("alternate all-reduce", acc.alternate_ring_all_reduce_time)]:
    show_eq(rf"T_{{\text{{{name}}}}}", fn(alpha=acc.alpha))
ratio = sp.simplify(acc.alternate_ring_all_reduce_time() / acc.ring_all_reduce_time())
show_eq(r"\frac{T_{\text{alternate}}}{T_{\text{all-reduce}}}\Big|_{\alpha=0}", ratio)

# %%
coll = acc.collective_table(collective_size_bytes, ring_devices, ring_bandwidth)
coll["time_ms"] = coll.time_s * 1e3
shown = coll[coll.devices.isin([2, 4, 8, 16, 64])].pivot(index="devices", columns="collective", values="time_ms")
report.show_table(shown.reset_index().astype({"devices": str}), floatfmt=".3f")
fig, ax = plt.subplots()
# all-gather and reduce-scatter cost the same: dashes keep both visible
sns.lineplot(data=coll, x="devices", y="time_ms", hue="collective", style="collective", ax=ax)
ax.set_yscale("log")
ax.set_xlabel("devices N")
ax.set_ylabel("time (ms)")
ax.set_title(f"Ring collectives, S = {collective_size_bytes / 1e9:g} GB, W = {ring_bandwidth / 1e9:g} GB/s")
plt.show()
t = coll.set_index(["collective", "devices"]).time_ms
n_last = max(ring_devices)
report.say(f"For S = {collective_size_bytes / 1e9:g} GB and W = {ring_bandwidth / 1e9:g} GB/s, the ring "
           f"all-reduce takes {t['all_reduce', 2]:.2f} ms on 2 devices and {t['all_reduce', n_last]:.2f} ms on "
           f"{n_last}: it saturates at $2S/W$ = {2 * collective_size_bytes / ring_bandwidth * 1e3:.2f} ms. The "
           f"alternate one grows linearly, to {t['alternate_all_reduce', n_last]:.1f} ms "
           f"({t['alternate_all_reduce', n_last] / t['all_reduce', n_last]:.0f}x) at N = {n_last}.")

# %% [markdown]
# **The simulator** (`lab.accounting.ring_sim`) moves real numpy arrays chunk by chunk around the ring, checks every
# device's result against a direct sum or concatenation, counts bytes sent, and adds up the step times
# (a per-step latency of 1 µs included, to check the $\alpha$ terms too).

# %%
sim = check_closed_forms(sim_sizes_bytes, sim_devices, ring_bandwidth, latency=1e-6)
report.show_table(sim.astype({"devices": str, "size_bytes": str, "steps": str}), floatfmt=".6g")
report.say(f"The simulator agrees with the closed forms in **{int(sim.match.sum())} of {len(sim)}** cases "
           f"(bytes exactly, time to 1e-12), for N in {sorted(set(sim.devices))} and S in "
           f"{sorted(set(sim.size_bytes))} bytes; every device ended with the right values.")

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
rows = []
for strategy in acc.STRATEGIES:
    for phase in acc.PHASES:
        c = acc.ffn_costs(strategy, phase)
        comm = " + ".join(sp.latex(sp.factor(v)) for v in c["comm_time"].values())
        rows.append(dict(strategy=strategy, phase=phase, flops_per_device=f"${sp.latex(c['flops'])}$",
                         comm_time=f"${comm}$"))
report.show_table(pd.DataFrame(rows))

# %% [markdown]
# Setting $T_{\mathrm{compute}} = T_{\mathrm{comm}}$ and solving for the device count gives the largest $N$
# before communication dominates (training, forward + backward):

# %%
for strategy in ("dp", "fsdp", "tp"):
    show_eq(rf"N_{{\max}}^{{\mathrm{{{strategy.upper()}}}}}", acc.max_devices(strategy, "train"))
over = acc.max_devices("fsdp_tp", "train", "overlapped")
show_eq(r"X_{\max},\ Y_{\max}\ \text{(overlapped)}", sp.Tuple(over["X"], over["Y"]))
shared = acc.max_devices("fsdp_tp", "train", "shared")
show_eq(r"(X, Y)^{*}\ \text{(shared link)}", sp.Tuple(shared["X"], shared["Y"]))
show_eq(r"N_{\max}^{\mathrm{2D,\,shared}}", sp.factor(shared["N"]))

# %% [markdown]
# DP and FSDP stop scaling when the tokens per device fall below about $pC/(3W)$ and $pC/(2W)$: their
# traffic is a fixed amount of weights while the compute per device shrinks. TP's limit does not depend on
# the batch at all, only on $F$: its traffic and its compute both scale with the tokens. That is why 2-D
# parallelism multiplies the two limits.
#
# Numbers for the XXL FFN on H100s connected by NVLink (bf16 communication, $p = 2$):

# %%
gpu = dict(B=ffn_tokens, D=acc.XXL["d_model"], F=acc.XXL["d_ff"], C=gpu_flops, W=ring_bandwidth,
           W_X=ring_bandwidth, W_Y=ring_bandwidth, p=2)
limits = []
for strategy in ("dp", "fsdp", "tp"):
    for phase in acc.PHASES:
        limits.append(dict(strategy=strategy, phase=phase, network="either",
                           max_devices=float(acc.max_devices(strategy, phase, **gpu))))
for network in ("overlapped", "shared"):
    for phase in acc.PHASES:
        m = acc.max_devices("fsdp_tp", phase, network, **gpu)
        limits.append(dict(strategy="fsdp_tp", phase=phase, network=network, max_devices=float(m["N"]),
                           X=float(m["X"]), Y=float(m["Y"])))
limits = pd.DataFrame(limits)
report.show_table(limits, floatfmt=",.1f")
lim = limits.set_index(["strategy", "phase", "network"]).max_devices
report.say(f"With B = {ffn_tokens:,} tokens, C = {gpu_flops / 1e12:.0f} TFLOP/s and W = {ring_bandwidth / 1e9:.0f} GB/s, "
           f"training stays compute bound up to {lim['dp', 'train', 'either']:.0f} devices with DP, "
           f"{lim['fsdp', 'train', 'either']:.0f} with FSDP, {lim['tp', 'train', 'either']:.0f} with TP, and "
           f"{lim['fsdp_tp', 'train', 'overlapped']:,.0f} with FSDP x TP on separate links "
           f"({lim['fsdp_tp', 'train', 'shared']:,.0f} if both share one link).")

# %%
sweep = acc.ffn_strategy_table([2**k for k in range(1, 11)], "train", **gpu)
long = sweep.melt(id_vars=["strategy", "devices"], value_vars=["compute_s", "comm_s"], var_name="time",
                  value_name="seconds")
g = sns.relplot(data=long, x="devices", y="seconds", hue="time", col="strategy", kind="line", marker="o",
                height=3.5, aspect=1.1)
g.set(xscale="log", yscale="log")
g.figure.suptitle(f"One XXL FFN training step on H100s, B = {ffn_tokens:,} tokens", y=1.04)
plt.show()
at = sweep.set_index(["strategy", "devices"])
n_show = 64 if 64 in set(sweep.devices) else int(sweep.devices.max())
report.say(f"Where communication cannot overlap compute its time adds to every step, not only beyond the "
           f"crossover: at {n_show} devices FSDP runs at "
           f"{at.loc[('fsdp', n_show), 'efficiency_overlapped']:.0%} of peak with the gathers overlapped and "
           f"{at.loc[('fsdp', n_show), 'efficiency_serial']:.0%} without; TP at "
           f"{at.loc[('tp', n_show), 'efficiency_overlapped']:.0%} and {at.loc[('tp', n_show), 'efficiency_serial']:.0%}.")

# %% [markdown]
# ## 5 · When is the XXL forward compute bound on TPU v5p?
#
# The scaling book's mesh notation: $W_{\mathrm{ici}} = 2\cdot 9\cdot 10^{10}$ B/s (both directions of a
# link), $C = 4.6\cdot 10^{14}$ FLOP/s, FSDP over $X = 16$ chips spanning $M_X = 2$ mesh axes (bandwidth
# $M_X W_{\mathrm{ici}}$), TP over $Y = 4$ chips on $M_Y = 1$ axis; bf16 weights and activations ($p = 2$);
# $(n-1)/n \approx 1$. The input is sharded $B$ over $X$ and $D$ over $Y$, so each chip works on $B/X$ tokens
# and $F/Y$ columns. Per chip, for one FFN forward:

# %%
t = acc.fsdp_tp_forward_times(exact=False)
show_eq(r"T_{\mathrm{math}}", t["compute"])
show_eq(r"T_{\mathrm{FSDP}}\ (\text{all-gather } 3DF/Y \text{ weights over } X)", t["fsdp"])
show_eq(r"T_{\mathrm{TP}}\ (\text{all-gather} + \text{reduce-scatter of } (B/X) \times D \text{ over } Y)", t["tp"])

# %% [markdown]
# Compute bound means both communications hide behind the math:
# $T_{\mathrm{math}} \ge T_{\mathrm{FSDP}} \iff \frac{B}{X} \ge \frac{C}{W_{\mathrm{ici}} M_X}$, and
# $T_{\mathrm{math}} \ge T_{\mathrm{TP}} \iff Y \le \frac{3 F M_Y W_{\mathrm{ici}}}{2C}$ (no $B$ in it).
# (With three matrices per FFN the TP bound is 3/2 of the book's two-matrix $F M_Y W_{\mathrm{ici}}/C$.)

# %%
tpu = {acc.X: 16, acc.Y: 4, acc.M_X: 2, acc.M_Y: 1, acc.C: acc.TPU_V5P["C"], acc.W_ici: acc.TPU_V5P["W_ici"],
       acc.F: acc.XXL["d_ff"], acc.D: acc.XXL["d_model"]}
bound = acc.fsdp_tp_compute_bound_batch("overlapped")
exact = acc.fsdp_tp_compute_bound_batch("overlapped", exact=True)
added = acc.fsdp_tp_compute_bound_batch("shared")
show_eq(r"B_{\min}", bound["B"])
show_eq(r"\frac{B_{\min}}{X}", bound["per_fsdp_shard"])
tp_ratio = float((t["compute"] / t["tp"]).subs(tpu))
tpu_rows = pd.DataFrame([
    dict(case="scaling book (n-1)/n = 1", per_fsdp_shard=float(bound["per_fsdp_shard"].subs(tpu)),
         per_chip=float(bound["per_chip"].subs(tpu)), total=float(bound["B"].subs(tpu))),
    dict(case="exact ring factor (X-1)/X", per_fsdp_shard=float(exact["per_fsdp_shard"].subs(tpu)),
         per_chip=float(exact["per_chip"].subs(tpu)), total=float(exact["B"].subs(tpu))),
    dict(case="FSDP and TP times added", per_fsdp_shard=float(added["per_fsdp_shard"].subs(tpu)),
         per_chip=float(added["per_chip"].subs(tpu)), total=float(added["B"].subs(tpu))),
])
report.show_table(tpu_rows, floatfmt=",.0f")
b = tpu_rows.iloc[0]
report.say(f"Each chip must see **B/X ≥ {b.per_fsdp_shard:,.0f} tokens** (the four TP chips of a group share "
           f"them, so that is {b.per_chip:,.0f} tokens per chip if counted over all X·Y = 64 chips), an overall "
           f"batch of **B ≥ {b.total:,.0f} tokens** — about {b.total / 2048:.0f} sequences of 2048. TP over Y = 4 "
           f"is comfortably compute bound: its math takes {tp_ratio:.1f}x its communication. If the FSDP and "
           f"TP transfers could not run at the same time, the bound would rise to "
           f"{tpu_rows.iloc[2].total:,.0f} tokens.")

# %% [markdown]
# **Keeping throughput at a smaller batch.** The binding constraint is the FSDP one,
# $B \ge X\,\frac{C}{W_{\mathrm{ici}} M_X}$: weights must arrive as fast as the math consumes them. Each
# trick attacks one factor of it:

# %%
tricks = acc.tpu_batch_tricks()
show = tricks.copy()
show["condition"] = "$" + show.condition + "$"
report.show_table(show, floatfmt=",.0f")
tr = tricks.set_index("trick").batch_tokens
report.say(f"Shifting chips from FSDP to TP lowers the compute-bound batch from {tr.iloc[0]:,.0f} to "
           f"{tr.iloc[1]:,.0f} tokens on the same 64 chips; spreading FSDP over all three ICI axes gives "
           f"{tr.iloc[2]:,.0f}, and gathering fp8 weights {tr.iloc[3]:,.0f}. Gradient accumulation leaves the "
           "bound where it is: each microbatch all-gathers the weights again. Pipeline stages remove the "
           "weight traffic altogether, at the price of a pipeline bubble that itself needs several "
           "microbatches to hide. Overlapping the all-gather of layer $i+1$ with the math of layer $i$ "
           "(prefetch) is what makes the 'hide behind compute' conditions above the right ones at all.")

# %% [markdown]
# ## 6 · Predicted vs measured memory
#
# **Saved activations, exactly.** First the part of the prediction that can be checked to the byte on any
# machine: run a forward + loss on the CPU under `lab.measure.saved_tensors.saved_tensor_report` (which sees every
# tensor autograd saves) and compare with the formula, for both attention implementations and all three
# precision policies. (The CPU's autocast keeps softmax in bf16; on CUDA it runs in fp32, which the formula
# knows through `device_type`.)

# %%
saved_check = bench_accounting.saved_activations_check({"check": ModelConfig(**check_model)}, check_batch, check_context)
report.show_table(saved_check.astype({"batch": str, "context": str}), floatfmt=",.0f")
report.say(f"The formula predicts the saved bytes exactly in **{int(saved_check.match.sum())} of "
           f"{len(saved_check)}** cases (d_model {check_model['d_model']}, d_ff {check_model['d_ff']}, "
           f"{check_model['num_layers']} blocks, batch {check_batch} x context {check_context}).")

# %% [markdown]
# **Peak memory on the GPU.** The profiling/memory notebooks store `peak_gib` (peak allocated memory over the measurement) in
# `lm_step.csv`, the sharding notebook `peak_*_gib` per rank in `sharding_benchmark.csv`. We predict
# params + grads + AdamW + weight copies + saved activations for each measured row (the forward-only rows
# without grads and AdamW) and look at the ratio. The prediction leaves out transients (logits and their
# gradient, AdamW scratch, allocator rounding) and assumes every activation and every gradient is alive
# at once, so neither exact agreement nor a fixed ratio is expected; the ratio shows which effect wins.
# Compiled rows save fewer activations than eager (fusion), which the eager count does not know.

# %%
def load_measured(name):
    try:
        df = results.load_results(name, measured_results_dir)
    except FileNotFoundError:
        return None
    return df


lm_step = load_measured("lm_step")
sharding = load_measured("sharding_benchmark")
found = [n for n, d in [("lm_step", lm_step), ("sharding_benchmark", sharding)] if d is not None]
missing = [n for n, d in [("lm_step", lm_step), ("sharding_benchmark", sharding)] if d is None]
check = bench_accounting.predicted_vs_measured(lm_step, sharding)
if missing:
    report.say(f"No {' or '.join(m + '.csv' for m in missing)} in `{measured_results_dir}/` yet: run the GPU "
               "notebooks that measure them, then re-render this one.")
if check.empty and found:
    report.say(f"{' and '.join(n + '.csv' for n in found)} in `{measured_results_dir}/` hold no successful rows "
               "with a measured peak memory (the CPU cannot measure one), so there is nothing to compare yet.")
if not check.empty:
    cols = ["source", "impl", "size", "context", "batch", "dtype", "attention", "compile", "world_size",
            "predicted_gib", "measured_gib",
            "ratio", "params_gib", "grads_gib", "optimizer_gib", "weight_copies_gib", "activations_gib"]
    report.show_table(check[cols].sort_values(["source", "size", "context"]), floatfmt=".3g")
    fig, ax = plt.subplots(figsize=(6, 6))
    sns.scatterplot(data=check, x="predicted_gib", y="measured_gib", hue="dtype", style="source", ax=ax)
    hi = float(max(check.predicted_gib.max(), check.measured_gib.max())) * 1.1
    ax.plot([0, hi], [0, hi], color="gray", lw=1, ls="--", label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted peak (GiB)")
    ax.set_ylabel("measured peak (GiB)")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    plt.show()
    by = check.groupby("source").ratio.agg(["median", "min", "max", "count"])
    report.say("Measured / predicted peak memory: " + "; ".join(
        f"{src}: median {r['median']:.2f} (range {r['min']:.2f}–{r['max']:.2f}, {int(r['count'])} rows)"
        for src, r in by.iterrows()) + ". A ratio above 1 means transients the formula leaves out; below 1, "
           "that backward freed activations before the gradients were all allocated.")

# %% [markdown]
# ## Saved results

# %%
for name, df in [("accounting_memory", memory), ("accounting_flops", flops), ("accounting_collectives", coll),
                 ("accounting_saved_activations_check", saved_check),
                 ("accounting_ring_sim_check", sim), ("accounting_ffn_limits", limits),
                 ("accounting_xxl_fsdp", fsdp), ("accounting_tpu_batch", tpu_rows),
                 ("accounting_tpu_tricks", tricks)] + ([("accounting_memory_check", check)] if not check.empty else []):
    results.save_results(df, name, results_dir, params)
report.say(f"Tables saved under `{results_dir}/` (accounting_*.csv with provenance sidecars).")
