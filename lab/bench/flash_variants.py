"""The Triton FlashAttention kernels' launch variants, measured: how the tile tables of
:mod:`lab.kernels.flash_config` are chosen, and where a short sequence's time goes on the host
(``python -m lab.bench.flash_sweep`` runs them on a GPU machine).

* :func:`sweep_shape`: every FlashConfig variant of :func:`sweep_configs` (forward tiles and pipeline depths,
  backward launch modes on several tiles) next to peer implementations, in one process; each checked against
  fp32 SDPA before it is timed; short sequences also replayed from CUDA graphs (the device's time);
* :func:`backward_breakdown`: where a backward's time goes: matrix products per tile pair and the rate they
  ran at against a measured matmul ceiling;
* :func:`best_variants`: the fastest correct variant per shape, next to the default and the peers;
* :func:`host_costs`: a short sequence's forward + backward in the model's layout, eager against CUDA-graph
  replay and ``torch.compile``, the inlined kernels against the opaque op, with the profiler's table;
* :func:`product_wait_table`: how the compiled kernels wait for their matrix products (sm_90a, any machine);
* :func:`course_timing_table`: the course's timing test of ``FlashAttentionTriton``;
* :func:`warm_variants`: compile the variants in worker processes first, so the timing process has the GPU
  to itself (Triton's and Inductor's on-disk caches then serve it).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from lab.accounting.attention import DTYPES, PASSES, attention_flops
from lab.bench.attention import attention_impl, attention_inputs
from lab.bench.attention_grid import Shape, summarized, time_passes
from lab.kernels.flash_config import LAUNCHED_PASSES, FlashConfig, backward_plan, block_d, forward_tiles, head_chunks
from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device
from lab.measure.results import gpu_label
from lab.measure.timing import graph_replay, time_kernel
from lab.model.attention import AttentionFn, get_attention

#: Forward tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` a sweep tries besides the table's.
SWEEP_FWD_TILES = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 2))
#: Forward variants that change more than the tiles: name -> (tiles, extra FlashConfig fields): a deeper or
#: shallower pipeline.
SWEEP_FWD = {
    "fwd 128x128 w8 s4": ((128, 128, 8, 4), {}),
    "fwd 128x128 w8 s2": ((128, 128, 8, 2), {}),
}
#: Backward variants: name -> (launch mode, tiles ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps,
#: num_stages)``, extra FlashConfig fields); ``M1 x N1`` are the (query, key) tiles of the dK/dV programs,
#: ``M2 x N2`` those of the dQ programs.
SWEEP_BWD = {
    "fused 32x64 w8 s2": ("fused", (32, 64, 64, 32, 8, 2), {}),
    "fused 32x64 w4 s2": ("fused", (32, 64, 64, 32, 4, 2), {}),
    "fused 64x64 w4 s3": ("fused", (64, 64, 64, 64, 4, 3), {}),
    "two_pass 64x128 w8 s3": ("two_pass", (64, 128, 128, 64, 8, 3), {}),
    "two_pass 64x64 w4 s3": ("two_pass", (64, 64, 64, 64, 4, 3), {}),
    "two_pass 128x128 w8 s2": ("two_pass", (128, 128, 128, 128, 8, 2), {}),
}
#: Matrix products per (query tile, key tile) pair of each backward launch: the dK/dV programs compute S, dV,
#: dP and dK, the separate dQ programs recompute S and dP before dQ (7; a kernel that adds dQ from the dK/dV
#: programs, FlashAttention-2's count, needs 5).
PRODUCTS = {"fused": 7, "two_pass": 7}
#: FlashAttention-2's products per tile pair in the backward, the count :func:`attention_flops` credits.
USEFUL_PRODUCTS = 5
#: Products per tile pair of every backward a row can name in ``bwd_mode``: the portable launches and the Gluon
#: kernel, which adds dQ across key tiles and so computes FlashAttention-2's five.
BACKWARD_PRODUCTS = {**PRODUCTS, "gluon": USEFUL_PRODUCTS}
#: Shapes up to this many tokens are also replayed from CUDA graphs (``<pass>_graph_ms``).
GRAPH_MAX_SEQ = 2048
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3, "fp32": 1e-4}


def sweep_configs(fwd_tiles: Sequence[tuple] = SWEEP_FWD_TILES, fwd: dict | None = None,
                  bwd: dict | None = None) -> dict:
    """The variants of a sweep: ``{name: (config, passes)}``, ``passes`` those the variant changes ("default"
    runs all three, a forward variant "fwd", a backward one "bwd"). ``fwd_tiles``: forward variants that only
    fix tiles; ``fwd`` (default :data:`SWEEP_FWD`) and ``bwd`` (:data:`SWEEP_BWD`): named variants."""
    fwd, bwd = SWEEP_FWD if fwd is None else fwd, SWEEP_BWD if bwd is None else bwd
    out = {"default": (FlashConfig(), PASSES)}
    out.update({"fwd {}x{} w{} s{}".format(*t): (FlashConfig(fwd_tiles=tuple(t)), ("fwd",)) for t in fwd_tiles})
    out.update({name: (FlashConfig(fwd_tiles=tuple(tiles), **extra), ("fwd",)) for name, (tiles, extra) in fwd.items()})
    out.update({name: (FlashConfig(backward_launch=mode, bwd_tiles=tuple(tiles), **extra), ("bwd",))
                for name, (mode, tiles, extra) in bwd.items()})
    return out


def select_variants(variants: dict, names: Sequence[str] | None) -> dict:
    """The variants named in ``names`` (all for none given), in the sweep's order; an unknown name is a
    ValueError that lists the sweep's."""
    if not names:
        return variants
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; the sweep has: {', '.join(variants)}")
    return {n: v for n, v in variants.items() if n in names}


def relative_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """Largest ``max |got - ref| / max |ref|`` over the pairs (output and gradients), in float64."""
    return max(((g.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item()
               for g, r in zip(got, ref))


def _outputs(fn: AttentionFn, q, k, v, dout, causal, heads: int):
    """Output and (dQ, dK, dV) of the first ``heads`` rows of the batch, for a correctness check."""
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*xs, causal)
    return [t[:heads].detach() for t in (out, *torch.autograd.grad(out, xs, dout))]


def executed_flops(shape: Shape, pass_: str, mode: str = "two_pass", columns: int | None = None) -> float:
    """FLOPs the Triton kernels issue for ``pass_`` (``"fwd"`` or ``"bwd"``): the useful FLOPs of
    :func:`attention_flops` on tiles ``columns`` wide in the head dimension (default one padded ``BLOCK_D``
    tile), the backward's at ``mode``'s products per tile pair (:data:`BACKWARD_PRODUCTS`) over the
    :data:`USEFUL_PRODUCTS` counted; masked diagonal tiles not counted."""
    useful = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, pass_, heads=shape.heads)
    products = BACKWARD_PRODUCTS[mode] / USEFUL_PRODUCTS if pass_ == "bwd" else 1
    return useful * products * (columns or block_d(shape.d)) / shape.d


def backward_breakdown(shape: Shape, ms: float, mode: str, ceiling_tflops: float, columns: int | None = None) -> dict:
    """Where a backward's time goes: ``products`` per tile pair, ``useful_tflops`` (the FLOPs of
    :func:`attention_flops` per second), ``executed_tflops`` (the products issued, :func:`executed_flops`, per
    second) and ``of_ceiling``, executed against ``ceiling_tflops`` (a measured large matmul of the same dtype)."""
    useful = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, "bwd", heads=shape.heads)
    rate = executed_flops(shape, "bwd", mode, columns) / (ms * 1e-3) / 1e12
    return dict(products=BACKWARD_PRODUCTS[mode], useful_tflops=useful / (ms * 1e-3) / 1e12, executed_tflops=rate,
                of_ceiling=rate / ceiling_tflops if ceiling_tflops else math.nan)


def resolved_plan(shape: Shape, dtype: str, config: FlashConfig, device: torch.device) -> dict:
    """The tiles and backward launch the kernels use for ``shape`` under ``config``, as text for a table."""
    bh, dt = shape.batch * shape.heads, DTYPES[dtype]
    f = forward_tiles(bh, shape.seq, shape.seq, shape.d, dt, device, config, shape.causal)
    mode, plan = backward_plan(bh, shape.seq, shape.seq, shape.d, dt, device, config)
    return dict(fwd_tiles="{BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**f), bwd_mode=mode,
                bwd_tiles=" / ".join("{BLOCK_M1}x{BLOCK_N1},{BLOCK_M2}x{BLOCK_N2} w{num_warps} s{num_stages}".format(
                    **plan[p]) for p in LAUNCHED_PASSES[mode]))


def kernels_run(q, k, v, causal: bool, config: FlashConfig) -> dict:
    """Which kernels ``FlashAttentionTriton`` runs on these inputs under ``config``: ``kernel`` (the forward's) and
    ``bwd_kernel``, ``"gluon"`` or ``"triton"`` (:func:`lab.kernels.flash_dispatch.which_forward`,
    ``which_backward``); where the Gluon backward runs, ``bwd_mode`` says so instead of the portable launch."""
    from lab.kernels.flash_dispatch import which_backward, which_forward  # optional dependency (Triton)

    out = dict(kernel=which_forward(q, k, v, causal, config), bwd_kernel=which_backward(q, k, v, causal, config))
    return {**out, "bwd_mode": "gluon"} if out["bwd_kernel"] == "gluon" else out


def variant_fn(config: FlashConfig) -> AttentionFn:
    """``FlashAttentionTriton`` under ``config``, as ``fn(q, k, v, causal)``."""
    from lab.kernels.flash_triton import FlashAttentionTriton  # optional dependency (Triton)

    return lambda q, k, v, causal: FlashAttentionTriton.apply(q, k, v, causal, config)


def sweep_shape(shape: Shape, dtype: str = "bf16", variants: dict | None = None,
                peers: Sequence[str] = ("sdpa", "flex"), device: torch.device | str = "auto",
                warmup_ms: float = 10, rep_ms: float = 50, check_heads: int = 2,
                ceiling_tflops: float = math.nan, sink: Callable[[dict], None] | None = None) -> pd.DataFrame:
    """Every variant of :func:`sweep_configs` and every peer on one shape, in one process: a correctness check
    of each against fp32 SDPA on the first ``check_heads`` heads (``rel_err``, the largest error over output and
    gradients relative to the reference's largest value; ``ok`` within :data:`TOLERANCE`), then the passes the
    variant changes (:func:`lab.bench.attention_grid.time_passes`: ``<pass>_ms`` medians with spread and count,
    ``<pass>_tflops``; up to :data:`GRAPH_MAX_SEQ` tokens also ``<pass>_graph_*`` replays). Variant rows say which
    kernels ran (:func:`kernels_run`); backward rows of the portable backward carry :func:`backward_breakdown`
    (of the replay where there is one). ``sink(row)`` sees each row as it is made; a
    variant that fails is a row with ``status="error"`` and the reason in ``note``."""
    device = resolve_device(device) if isinstance(device, str) else device
    variants = sweep_configs() if variants is None else variants
    q, k, v, dout = attention_inputs(shape.batch * shape.heads, shape.seq, shape.d, DTYPES[dtype], device)
    ref = _outputs(lambda a, b, c, causal: torch.nn.functional.scaled_dot_product_attention(
        a.float().unsqueeze(0), b.float().unsqueeze(0), c.float().unsqueeze(0), is_causal=causal)[0],
        q[:check_heads], k[:check_heads], v[:check_heads], dout[:check_heads].float(), shape.causal, check_heads)
    fns = {name: (variant_fn(cfg), passes, cfg) for name, (cfg, passes) in variants.items()}
    fns.update({name: (attention_impl(name, device), PASSES, None) for name in peers})
    timer = dict(warmup_ms=warmup_ms, rep_ms=rep_ms, min_samples=5)
    rows = []
    for name, (fn, passes, cfg) in fns.items():
        row = dict(shape=shape.label, dtype=dtype, impl="triton" if cfg is not None else name, variant=name,
                   status="ok", note="")
        if cfg is not None:
            row.update(resolved_plan(shape, dtype, cfg, device), **kernels_run(q, k, v, shape.causal, cfg))
        try:
            row["rel_err"] = relative_errors(_outputs(fn, q, k, v, dout, shape.causal, check_heads), ref)
            row["ok"] = row["rel_err"] <= TOLERANCE[dtype]
            graph = device.type == "cuda" and shape.seq <= GRAPH_MAX_SEQ
            row.update(time_passes(fn, q, k, v, dout, shape.causal, device, timer, passes, graph))
            for p in PASSES:
                flops = attention_flops(shape.batch, shape.seq, shape.d, shape.causal, p, heads=shape.heads)
                for kind in ("", "_graph"):
                    if f"{p}{kind}_ms" in row:
                        row[f"{p}{kind}_tflops"] = flops / (row[f"{p}{kind}_ms"] * 1e-3) / 1e12
            if cfg is not None and "bwd" in passes and row["bwd_kernel"] == "triton":  # the products PRODUCTS counts
                row["bwd_columns"] = sum(head_chunks(shape.d, DTYPES[dtype], "bwd", shape.seq, shape.seq, cfg))
                row.update(backward_breakdown(shape, row.get("bwd_graph_ms", row["bwd_ms"]), row["bwd_mode"],
                                              ceiling_tflops, row["bwd_columns"]))
        except Exception as exc:  # noqa: BLE001 - a variant that cannot compile or run is a row, not the end
            if is_oom(exc):
                empty_cache()
            row.update(status="error", note=error_summary(exc))
        rows.append(row)
        if sink:
            sink(row)
    return pd.DataFrame(rows)


def best_variants(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per (shape, dtype): the fastest correct Triton variant of the forward and of the backward, next to the
    default and the peers, in TFLOP/s (columns ``best_<pass>``, ``best_<pass>_tflops``,
    ``<who>_<pass>_tflops``), from the CUDA-graph replays where the shape has them (``timing="graph"``)."""
    ok = sweep[(sweep["status"] == "ok") & (sweep.get("ok", True) != False)]  # noqa: E712 - NaN for peers
    rows = []
    for (shape, dtype), grp in ok.groupby(["shape", "dtype"], sort=False):
        graph = "bwd_graph_tflops" in grp and grp["bwd_graph_tflops"].notna().any()
        suffix = "_graph_tflops" if graph else "_tflops"
        row = dict(shape=shape, dtype=dtype, timing="graph" if graph else "eager")
        tri = grp[grp["impl"] == "triton"]
        for p in ("fwd", "bwd"):
            if f"{p}{suffix}" in tri and tri[f"{p}{suffix}"].notna().any():
                best = tri.loc[tri[f"{p}{suffix}"].idxmax()]
                row.update({f"best_{p}": best["variant"], f"best_{p}_tflops": best[f"{p}{suffix}"]})
        for who in ["default", *grp.loc[grp["impl"] != "triton", "variant"]]:
            sel = grp[grp["variant"] == who]
            row.update({f"{who}_{p}_tflops": sel[f"{p}{suffix}"].iloc[0] for p in PASSES
                        if len(sel) and f"{p}{suffix}" in sel})
        rows.append(row)
    return pd.DataFrame(rows)


def _warm_task(task):
    """A pool worker's job: one forward + backward of a variant or peer, so that the on-disk caches hold its
    kernels. Returns (name, None or the error's first line)."""
    shape, dtype, name, device = task
    try:
        configs = sweep_configs()
        fn = variant_fn(configs[name][0]) if name in configs else attention_impl(name, device)
        q, k, v, dout = attention_inputs(shape.batch * shape.heads, shape.seq, shape.d, DTYPES[dtype],
                                         torch.device(device))
        _outputs(fn, q, k, v, dout, shape.causal, 1)
        return name, None
    except Exception as exc:  # noqa: BLE001 - reported by the parent, which times what compiled
        return name, error_summary(exc)


def warm_variants(jobs: Sequence[tuple[Shape, str]], names: Sequence[str], device: str, workers: int) -> list:
    """Compile every variant or peer in ``names`` for every (shape, dtype) of ``jobs`` in ``workers`` spawned
    processes. Returns the failures as (name, reason)."""
    tasks = [(s, dt, n, device) for s, dt in jobs for n in names]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [r for r in pool.imap_unordered(_warm_task, tasks) if r[1]]


def kernel_columns(row, direction: str) -> int:
    """The head-dimension columns the Triton kernels compute for a grid row's shape in ``direction`` (``"fwd"`` or
    ``"bwd"``): the row's ``<direction>_columns`` where recorded, else the default config's choice for its dtype
    and length on the device that measured it (``gpu == "cpu"``: the interpreter, which never splits); without
    a dtype or length, one masked power-of-two tile."""
    recorded = row.get(f"{direction}_columns")
    if recorded is not None and recorded == recorded:
        return int(recorded)
    d, seq = int(row["d"]), row.get("seq_len")
    if row.get("dtype") in DTYPES and seq is not None and seq == seq:
        return sum(head_chunks(d, DTYPES[row["dtype"]], direction, int(seq), int(seq),
                               interpreted=row.get("gpu") == "cpu"))
    return block_d(d)


def product_wait_table(head_dims=(64, 128), causal: bool = True, n: int = 4096, batch_heads: int = 64) -> pd.DataFrame:
    """The kernels the tile tables launch for a long causal bf16 sequence at each head dimension, compiled for
    Hopper (``sm_90a``) on any machine: one row per kernel with its tiles, ``products`` (the ``tl.dot`` sites of
    the compiled code, each loop body counted once), ``waited_at_once`` (waited for before any other product or
    exponential is issued, read from the PTX), ``in_flight`` (the others), registers and spilled bytes a thread,
    shared memory (KiB). Only a ``note`` where this Triton cannot compile for sm_90a."""
    from lab.kernels.flash_sm90 import compile_in_subprocess  # optional dependency (Triton)

    jobs = [["default", dict(d=d, causal=causal, n=n, batch_heads=batch_heads)] for d in head_dims]
    try:
        df = pd.DataFrame([row for rows in compile_in_subprocess(jobs) for row in rows])
    except (FileNotFoundError, RuntimeError) as exc:
        return pd.DataFrame({"note": [str(exc).splitlines()[-1]]})
    df = df.assign(in_flight=df["products"] - df["waited_at_once"], shared_kib=df["shared"] / 1024)
    return df[["kernel", "d", "tiles", "products", "waited_at_once", "in_flight", "registers", "spill", "shared_kib"]]


def course_timing_test(compile: bool = True, batch: int = 16, seq: int = 16384, d: int = 64,
                       device: torch.device | str = "cuda", rep_ms: float = 200, cpu_steps: int = 5) -> dict:
    """The course's FlashAttention timing: ``FlashAttentionTriton.apply`` (under ``torch.compile`` when
    ``compile``) on q, k, v of shape (batch, seq, d) in bf16, causal; forward, ``o.sum()``, backward, timed as one
    call by do_bench (on the CPU: ``cpu_steps`` calls of the host timer). Returns ``fwdbwd_ms`` (median),
    ``fwdbwd_spread_ms``, ``fwdbwd_n``, ``gpu`` (``"cpu"`` on the CPU) and the shape."""
    from lab.kernels import flash_triton as flash  # optional dependency (Triton)

    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(batch, seq, d, generator=gen).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
    fn = torch.compile(flash.FlashAttentionTriton.apply) if compile else flash.FlashAttentionTriton.apply

    def step():
        fn(q, k, v, True).sum().backward()

    timing = time_kernel(step, device, warmup_ms=25, rep_ms=rep_ms, cpu_steps=cpu_steps, min_samples=5)
    return dict(compiled=compile, batch=batch, seq_len=seq, d=d, dtype="bf16", causal=True,
                **summarized("fwdbwd", timing.samples_ms), gpu=gpu_label() if device.type == "cuda" else "cpu")


def course_timing_table(compiles: Sequence[bool] = (True, False), batch: int = 16, seq: int = 16384, d: int = 64,
                        **kwargs) -> pd.DataFrame:
    """:func:`course_timing_test` once per ``compile`` setting, one row each."""
    return pd.DataFrame([course_timing_test(compile=c, batch=batch, seq=seq, d=d, **kwargs) for c in compiles])


# ----------------------------------------------------------------------------------------------------------
# The host's share of a short sequence


def host_attention(name: str) -> AttentionFn:
    """The registry's attention ``name`` (``fn(q, k, v, causal)`` on (batch, heads, seq, d)), or
    ``"flash_triton_inline"`` / ``"flash_triton_opaque"``: the Triton kernels with ``compile_inline`` on (compiled
    code launches the kernels itself) or off (it calls the opaque op, whose host function runs on every call)."""
    if name in ("flash_triton_inline", "flash_triton_opaque"):
        from lab.kernels.flash_triton import flash_attention_bhsd  # optional dependency (Triton)

        config = FlashConfig(compile_inline=name == "flash_triton_inline")
        return lambda q, k, v, causal: flash_attention_bhsd(q, k, v, causal, config=config)
    return get_attention(name)


def host_costs(shape: Shape, dtype: str = "bf16", impls: Sequence[str] = ("flash_triton", "flash_triton_opaque",
                                                                          "sdpa"),
               device: torch.device | str = "auto", calls: int = 20, rep_ms: float = 50,
               profile: bool = True) -> tuple[pd.DataFrame, str]:
    """Where a short sequence's attention time goes, in the model's layout (q, k, v as ``transpose(1, 2)`` views
    of (batch, seq, heads, d)), forward + backward per implementation (:func:`host_attention`): ``eager_ms``
    (do_bench median), ``host_ms`` (wall time to issue one call, ``calls`` calls without a sync), ``graph_ms``
    (replayed from a CUDA graph: the device's time alone), ``compiled_ms`` (``torch.compile(fullgraph=True)`` of
    the attention and its output transpose). Also returns the torch.profiler table (self CPU time per op) of a
    few eager steps of the first implementation ("" without ``profile``)."""
    device = resolve_device(device) if isinstance(device, str) else device
    gen = torch.Generator(device="cpu").manual_seed(0)
    make = lambda: torch.randn(shape.batch, shape.seq, shape.heads, shape.d, generator=gen).to(device, DTYPES[dtype])
    base = [make().requires_grad_() for _ in range(3)]
    dout = make()
    timer = dict(warmup_ms=10, rep_ms=rep_ms)
    rows, table = [], ""
    for name in impls:
        attn = host_attention(name)

        def step(fn=attn):
            q, k, v = (t.transpose(1, 2) for t in base)
            return torch.autograd.grad(fn(q, k, v, shape.causal), base, dout.transpose(1, 2))

        row = dict(shape=shape.label, dtype=dtype, impl=name, eager_ms=time_kernel(step, device, **timer).median_ms)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                step()
            row["host_ms"] = (time.perf_counter() - start) * 1e3 / calls
            torch.cuda.synchronize(device)
            try:
                row["graph_ms"] = time_kernel(graph_replay(step), device, **timer).median_ms
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured keeps its other columns
                row["note"] = f"graph: {error_summary(exc)}"
        compiled = torch.compile(lambda q, k, v, fn=attn: fn(q, k, v, shape.causal).transpose(1, 2), fullgraph=True)
        row["compiled_ms"] = time_kernel(lambda: torch.autograd.grad(
            compiled(*(t.transpose(1, 2) for t in base)), base, dout), device, **timer).median_ms
        if profile and not table:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(5):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        rows.append(row)
    return pd.DataFrame(rows), table
