"""The language-model benchmark: forward, forward+backward and AdamW train-step time and peak memory of a
:class:`~lab.model.TransformerLM`, one row per configuration.

``python -m lab.bench`` runs it from the command line. The modes are measured interleaved, by one timer (each
mode's time and its peak memory come from the same runs), and out-of-memory is a result (``status="oom"``,
the modes that fit keep their numbers), never a crash of a sweep.
"""

from __future__ import annotations

import functools
import gc
import json
import math
from collections.abc import Callable, Iterable, Sequence

import pandas as pd
import torch

from lab.accounting import BENCH_DTYPE_TO_POLICY, training_memory
from lab.bench.memory_estimate import cpu_peak_bytes
from lab.bench.progress import progress_bar
from lab.dtypes import autocast_dtype
from lab.measure.device import available_memory_bytes, empty_cache, error_summary, is_oom, resolve_device
from lab.measure.process import run_python_module
from lab.measure.profiling import gpu_kernel_ms, profile_step
from lab.measure.results import RowLog
from lab.measure.step import MODES, TrainStep, make_optimizer, measure_modes, mode_columns, random_batch
from lab.measure.verdicts import HOST_BOUND_BELOW, summarize
from lab.model import ModelConfig, TransformerLM, config_for
from lab.parallel.launcher import launch

#: The columns of ``results/lm_step.csv`` (before the provenance columns the results store adds).
LM_STEP_COLUMNS = ["size", "context", "batch", "dtype", "attention", "compile", "fused_loss", "world_size",
                   "fwd_ms", "fwdbwd_ms", "step_ms", "fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib", "status"]


def lm_config(size: str | ModelConfig, context: int, attention: str = "sdpa",
              fused_loss: bool = False) -> tuple[str, ModelConfig]:
    """``(name, config)`` of a size name or an explicit :class:`ModelConfig`, at ``context`` tokens."""
    if isinstance(size, ModelConfig):
        fields = {**size.__dict__, "context_length": max(size.context_length, context), "attention": attention,
                  "fused_loss": fused_loss}
        return f"d{size.d_model}_L{size.num_layers}", ModelConfig(**fields)
    return size, config_for(size, context_length=context, attention=attention, fused_loss=fused_loss)


#: A mode predicted to need more than this times the device's memory is not attempted (the 10B train step on a
#: 141 GiB GPU: 1.4x); nearer the limit it is tried, and out-of-memory, if it comes, is its row.
SURE_OOM = 1.1


def predicted_peak_bytes(cfg: ModelConfig, batch: int, context: int, dtype: str, modes: Sequence[str],
                         device: torch.device) -> tuple[int, int]:
    """``(predicted peak bytes of the largest mode, bytes available on device)``: on the CPU
    :func:`lab.bench.memory_estimate.cpu_peak_bytes` (kept state plus the temporaries, such as the logits,
    that the CPU's allocator cannot reuse), elsewhere the step's peak of :func:`lab.accounting.training_memory`
    (each step drops its gradients before the forward, so they and the saved activations do not coexist)."""
    if device.type == "cpu":
        need = max(cpu_peak_bytes(cfg, batch, context, dtype, m) for m in modes)
    else:
        precision = BENCH_DTYPE_TO_POLICY[dtype]
        need = max(training_memory(cfg, batch, context, precision, m, device_type=device.type)["peak"]
                   for m in modes)
    return need, available_memory_bytes(device)


def benchmark_lm(size: str | ModelConfig, context: int = 512, batch: int = 4,
                 modes: str | Sequence[str] = MODES, dtype: str = "fp32", compile: bool = False,
                 attention: str = "sdpa", fused_loss: bool = False, warmup: int = 2, steps: int = 5,
                 device: torch.device | str = "auto", seed: int = 0) -> dict:
    """Time forward, forward+backward and/or a full AdamW train step of a :class:`TransformerLM`.

    ``size`` is a name from ``MODEL_SIZES`` (or ``tiny``/``mini``) or a :class:`ModelConfig`. The modes are
    measured together, ``warmup`` untimed then ``steps`` timed rounds of one run of each, interleaved and
    timed by the same clock (:func:`lab.measure.step.measure_modes`), so a train step and its own
    forward+backward see the same machine. Returns one row (a dict), the measurement record: per mode
    ``<m>_ms`` (the median), ``<m>_spread_ms`` (its robust spread, :func:`lab.measure.verdicts.summarize`),
    ``<m>_n`` (samples), ``<m>_samples_ms`` (every sample) and ``<m>_peak_gib`` (peak allocated GPU memory
    during that mode's steps; NaN on the CPU), with ``m`` in ``fwd``, ``fwdbwd``, ``step`` (and ``bwd_*``: the
    backward alone, timed inside the forward+backward steps); ``timer`` and ``warmup``; ``gpu_busy``, the
    lowest share of a mode's median during which the GPU ran kernels (in one more run, profiled for kernels
    alone; NaN on the CPU)
    and ``host_bound`` (busy below :data:`HOST_BOUND_BELOW`: the GPU waited for the host's launches, so the
    time depends on the host's CPU as much as on the GPU), with ``<m>_gpu_ms``, each mode's GPU time
    (:func:`gpu_times`); ``params``; ``status`` (``ok``, or ``oom`` if any
    mode ran out of memory: the modes that fit keep their numbers, ``error`` says which failed and
    ``limit_gib`` how much memory the device had).
    """
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    autocast_dtype(dtype)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    device = resolve_device(device) if isinstance(device, str) else device
    name, cfg = lm_config(size, context, attention, fused_loss)
    row = dict(size=name, context=context, batch=batch, dtype=dtype, attention=attention, compile=bool(compile),
               fused_loss=bool(fused_loss), world_size=1, d_model=cfg.d_model, d_ff=cfg.d_ff,
               num_layers=cfg.num_layers, num_heads=cfg.num_heads, device=str(device), warmup=warmup, steps=steps,
               params=math.nan, status="ok", error="", gpu_busy=math.nan, host_bound=False,
               limit_gib=available_memory_bytes(device) / 2**30)
    for col in [*mode_columns(MODES), "bwd"]:
        row.update({f"{col}_ms": math.nan, f"{col}_spread_ms": math.nan, f"{col}_n": 0, f"{col}_gpu_ms": math.nan})
        if col != "bwd":
            row[f"{col}_peak_gib"] = math.nan
    empty_cache()
    failures = []
    model = step = None
    need, available = predicted_peak_bytes(cfg, batch, context, dtype, modes, device)
    if device.type == "cpu" and need > 0.9 * available:
        # on the CPU the kernel's OOM killer ends the process instead of raising: do not start
        row.update(status="oom", error=f"not attempted: needs about {need / 2**30:.1f} GiB, this CPU has "
                                       f"{available / 2**30:.1f} GiB available")
        return row
    try:
        torch.manual_seed(seed)
        with torch.device(device):  # initialise on the device: a 10B model would take minutes on the CPU
            model = TransformerLM(cfg)
        row["params"] = model.num_parameters()
        runnable = torch.compile(model) if compile else model
        step = TrainStep(runnable, None, *random_batch(cfg, batch, device, context, seed), dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is turned into a row
        if not is_oom(exc):
            raise
        failures.append(f"build: {error_summary(exc)}")
    # a mode whose predicted peak exceeds the device's memory by a margin the model's error cannot bridge is
    # not attempted, so the others are not run twice (together, then each alone after its OOM)
    fits = list(modes)
    if step is not None:
        for m in modes:
            need_m = predicted_peak_bytes(cfg, batch, context, dtype, [m], device)[0]
            if need_m > SURE_OOM * available:
                fits.remove(m)
                failures.append(f"{m}: not attempted: needs about {need_m / 2**30:.0f} GiB, the {device.type} has "
                                f"{available / 2**30:.0f} GiB")
    # every mode interleaved and timed alike (lab.measure.step.measure_modes); if one runs out of memory,
    # each mode again on its own, so that a forward that fits is reported even when the train step does not
    groups = [fits] if fits and step is not None else []
    while groups:
        group = groups.pop(0)
        failed = False
        try:
            if "train_step" in group and step.optimizer is None:
                step.optimizer = make_optimizer(model, device)
            timings, peaks = measure_modes(step, group, warmup, steps)
            for key, timing in timings.items():
                s = summarize(timing.samples_ms)
                row.update({f"{key}_ms": s.median, f"{key}_spread_ms": s.spread, f"{key}_n": s.n,
                            f"{key}_samples_ms": timing.samples_ms})
            row.update({f"{col}_peak_gib": peaks[m] for m, col in zip(group, mode_columns(group))})
            # which way the times were taken: rows timed another way are not compared with these (consistency)
            row["timer"] = "interleaved" if len(group) > 1 else "alone"
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            if len(group) > 1:
                groups = [[m] for m in group]
            else:
                failures.append(f"{group[0]}: {error_summary(exc)}")
            failed = True
        if failed:  # outside the except block, so the traceback's frames (and their tensors) are gone
            model.zero_grad(set_to_none=True)
            step.optimizer = None
            gc.collect()
            empty_cache()
    if device.type == "cuda" and step is not None:  # the modes that ran (an OOM row keeps those that fit)
        row.update(gpu_times(step, modes, row))
    if failures:
        row.update(status="oom", error="; ".join(failures))
    # drop every reference to the model before the next configuration is built
    model = step = runnable = None  # noqa: F841
    gc.collect()
    empty_cache()
    return row


def gpu_times(step: TrainStep, modes: Sequence[str], row: dict) -> dict:
    """Each timed mode's GPU time, ``<m>_gpu_ms``: how long the GPU ran kernels in one more run of it, profiled
    for kernels alone (``bwd_gpu_ms`` is forward+backward's less the forward's); ``gpu_busy``, the lowest share
    of a mode's median wall time (timed without a profiler) that its GPU time fills, and ``host_bound``, that
    share below :data:`HOST_BOUND_BELOW`.

    The GPU time is the part of a step that another host does not change: where the GPU waited for the host's
    launches, the wall time moves with the host's pace and load from one run to the next, its GPU time does not
    (the ledger compares it)."""
    out, shares = {}, []
    for m, col in zip(modes, mode_columns(modes)):
        wall = row.get(f"{col}_ms", math.nan)
        if not wall > 0:
            continue
        # the last timed run's gradients are dropped first: a forward profiled beside them would hold the
        # parameters, gradients and activations at once, past the device's limit for the largest models (its
        # kernels are the same either way)
        step.model.zero_grad(set_to_none=True)
        try:
            gpu = gpu_kernel_ms(lambda m=m: step.run(m), step.device)
        except Exception as exc:  # noqa: BLE001 - a profile that runs out of memory leaves the mode without it
            if not is_oom(exc):
                raise
            gpu = math.nan
        if math.isnan(gpu):  # outside the except block, so the traceback's frames (and their tensors) are gone
            gc.collect()
            empty_cache()
        out[f"{col}_gpu_ms"] = gpu
        if math.isfinite(gpu):
            shares.append(min(gpu / wall, 1.0))
    if "fwd_gpu_ms" in out and "fwdbwd_gpu_ms" in out:
        out["bwd_gpu_ms"] = max(out["fwdbwd_gpu_ms"] - out["fwd_gpu_ms"], 0.0)
    busy = min(shares) if shares else math.nan
    return {**out, "gpu_busy": busy, "host_bound": bool(busy < HOST_BOUND_BELOW)}


def sweep_lm(sizes: Iterable[str | ModelConfig], contexts: Iterable[int] = (512,), dtypes: Iterable[str] = ("fp32",),
             modes: Sequence[str] | Callable[[str, int], Sequence[str]] = ("forward", "forward_backward"),
             progress: bool = True, log: RowLog | None = None, **kwargs) -> pd.DataFrame:
    """:func:`benchmark_lm` over every size x context x dtype, one row each, with a tqdm progress bar.

    ``modes`` may be a function of (size, context), e.g. to add the train step at one context only. ``log``
    (:class:`lab.measure.results.RowLog`): each row is logged as it is measured, and a row the log already holds
    (a resumed render's earlier call, same commit and machine kind) is taken from it, not measured again.
    """
    grid = [(s, c, d) for s in sizes for c in contexts for d in dtypes]
    rows = []
    bar = progress_bar(grid, "lm sweep", progress)
    for s, c, d in bar:
        bar.set_postfix_str(f"{s} ctx={c} {d}")
        m = modes(s, c) if callable(modes) else modes
        key = dict(size=str(s), context=c, dtype=d, modes=list(m), **{k: str(v) for k, v in kwargs.items()})
        rows.append(_logged(log, key, lambda: benchmark_lm(s, context=c, dtype=d, modes=m, **kwargs)))
    return pd.DataFrame(rows)


def _logged(log: RowLog | None, key: dict, measure: Callable[[], dict]) -> dict:
    """The row ``log`` holds for ``key`` (a resumed render's earlier call), else ``measure()``'s, logged."""
    row = log.get(key) if log is not None else None
    if row is None:
        row = measure()
        if log is not None:
            log.put(key, row)
    return row


def compare_variants(size: str | ModelConfig, variants: Iterable[dict], context: int = 512, batch: int = 4,
                     dtype: str = "fp32", modes: Sequence[str] = MODES, warmup: int = 2, steps: int = 5,
                     device: torch.device | str = "auto", progress: bool = True,
                     log: RowLog | None = None) -> pd.DataFrame:
    """:func:`benchmark_lm` of one configuration once per variant, e.g. ``[dict(attention="sdpa"),
    dict(attention="flash_triton", compile=True), dict(fused_loss=True)]`` (keywords of benchmark_lm), in
    this order in one process. Returns :func:`lm_step_table` rows (the spec's ``lm_step`` columns first).
    ``log``: as :func:`sweep_lm`'s, a variant's row logged by a resumed render's earlier call is taken back."""
    device = resolve_device(device) if isinstance(device, str) else device
    variants = [dict(v) for v in variants]
    rows = []
    bar = progress_bar(variants, "lm variants", progress)
    for variant in bar:
        bar.set_postfix_str(f"{size} " + " ".join(f"{k}={v}" for k, v in variant.items()))
        key = dict(size=str(size), context=context, batch=batch, dtype=dtype, modes=list(modes), warmup=warmup,
                   steps=steps, **{k: str(v) for k, v in variant.items()})
        rows.append(_logged(log, key, lambda: benchmark_lm(size, context=context, batch=batch, dtype=dtype,
                                                           modes=modes, warmup=warmup, steps=steps, device=device,
                                                           **variant)))
    return lm_step_table(pd.DataFrame(rows))


SAMPLE_KEYS = ("size", "context", "dtype", "attention", "compile")
SAMPLE_COLUMNS = ("fwd", "bwd", "fwdbwd", "step")


def samples_long(df: pd.DataFrame, keys: Sequence[str] = SAMPLE_KEYS) -> pd.DataFrame:
    """Every timed sample of a benchmark table in long form: one row per (config, mode, step index)."""
    rows = []
    for _, r in df.iterrows():
        for col in SAMPLE_COLUMNS:
            samples = r.get(f"{col}_samples_ms")
            if not isinstance(samples, list):
                continue
            for i, ms in enumerate(samples):
                rows.append({**{k: r[k] for k in keys if k in r}, "phase": col, "step": i, "ms": ms})
    return pd.DataFrame(rows)


def with_samples(df: pd.DataFrame, long: pd.DataFrame, keys: Sequence[str] = SAMPLE_KEYS) -> pd.DataFrame:
    """``df`` with each row's ``<m>_samples_ms`` lists rebuilt from its :func:`samples_long` table (the
    inverse of it), so a table read back from CSV, which keeps only medians, is compared from its samples
    just as the table that was measured; a mode without samples gets an empty list."""
    keys = [k for k in keys if k in df.columns and k in long.columns]
    lists = long.sort_values("step").groupby([*keys, "phase"], sort=False)["ms"].agg(list).to_dict()
    out = df.copy()
    for col in SAMPLE_COLUMNS:
        out[f"{col}_samples_ms"] = [lists.get((*(r[k] for k in keys), col), []) for _, r in df.iterrows()]
    return out


def lm_step_table(df: pd.DataFrame) -> pd.DataFrame:
    """The benchmark rows without the per-sample lists (what goes into ``results/lm_step.csv``), the spec's
    columns first."""
    df = df.drop(columns=[c for c in df.columns if c.endswith("_samples_ms")])
    return df[[c for c in LM_STEP_COLUMNS if c in df] + [c for c in df.columns if c not in LM_STEP_COLUMNS]]


def rows_shown(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """LM rows as a report's table shows them: ``columns`` where present (medians with their spread and count,
    peaks, GPU times and busy share), parameters in millions (``params_M``), columns nobody measured left out."""
    out = df[[c for c in columns if c in df.columns]].copy()
    return out.assign(params=out["params"] / 1e6).rename(columns={"params": "params_M"}).dropna(axis=1, how="all")


def warmup_study(size: str | ModelConfig, warmups: Sequence[int] = (0, 1, 2, 5), steps: int = 10,
                 context: int = 512, batch: int = 4, dtype: str = "fp32", attention: str = "sdpa",
                 device: str = "auto", progress: bool = True, fork: bool | None = None) -> pd.DataFrame:
    """Per-step forward+backward times for each warm-up count, each in a fresh process.

    A fresh process is the honest setting: CUDA context creation, cuBLAS handle and heuristics, allocator
    growth and kernel loading all land on the first steps of a cold process, which is what warm-up hides. On a
    GPU each run is a new interpreter (``python -m lab.bench``); on the CPU, which has no context to create, a
    rank of :func:`lab.parallel.launcher.launch`: a fork of a server that has imported torch and run nothing,
    so its first step is as cold and it starts in a fraction of a second rather than in the seconds torch's
    import takes (``fork``: None chooses so; False starts interpreters on the CPU too). Returns one row per
    (warmup, step index) with ``fwdbwd_ms``.
    """
    on_cpu = resolve_device(device).type == "cpu"
    if fork and not on_cpu:
        raise ValueError("fork=True is for the CPU: a process must not fork once CUDA has started")
    fork = on_cpu if fork is None else fork
    if isinstance(size, ModelConfig):
        arch = ["--d-model", str(size.d_model), "--d-ff", str(size.d_ff), "--num-layers", str(size.num_layers),
                "--num-heads", str(size.num_heads), "--vocab-size", str(size.vocab_size)]
    else:
        arch = ["--size", size]
    rows = []
    for w in progress_bar(warmups, "warm-up study", progress):
        if fork:
            # launch() takes `device` for itself: the benchmark's own goes in the partial
            (row,) = launch(functools.partial(benchmark_lm, device="cpu"), 1, size, context=context, batch=batch,
                            modes="forward_backward", dtype=dtype, attention=attention, warmup=w, steps=steps,
                            device="cpu")
        else:
            out = run_python_module("lab.bench", [*arch, "--context", str(context), "--batch", str(batch), "--mode",
                                                  "forward_backward", "--dtype", dtype, "--attention", attention,
                                                  "--warmup", str(w), "--steps", str(steps), "--device", device,
                                                  "--json"], what=f"warm-up run with warmup={w}")
            row = json.loads(out.strip().splitlines()[-1])
        if row["status"] != "ok":
            rows.append(dict(warmup=w, step=0, status=row["status"], device=row["device"]))
            continue
        for i, ms in enumerate(row["fwdbwd_samples_ms"]):
            rows.append(dict(warmup=w, step=i, fwdbwd_ms=ms, status="ok", device=row["device"]))
    return pd.DataFrame(rows)


def profile_lm(size: str | ModelConfig, mode: str = "forward", context: int = 512, batch: int = 4,
               dtype: str = "fp32", attention: str = "naive", warmup: int = 3, steps: int = 3,
               device: str | torch.device = "auto", trace_path=None):
    """:func:`lab.measure.profiling.profile_step` of a freshly built :class:`TransformerLM` (with AdamW for
    ``train_step``); returns the profiler. Naive attention by default: its ranges split scores, softmax and
    the final matmul."""

    device = resolve_device(device) if isinstance(device, str) else device
    _, cfg = lm_config(size, context, attention)
    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLM(cfg)
    optimizer = make_optimizer(model, device) if mode == "train_step" else None
    step = TrainStep(model, optimizer, *random_batch(cfg, batch, device, context), dtype=dtype)
    return profile_step(step, mode, warmup, steps, trace_path)
