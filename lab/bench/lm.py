"""The one timing harness: warm-up, synchronize after every step, keep every sample.

``python -m lab.bench.lm --help`` runs it from the command line. Out-of-memory is a result (a row with
``status="oom"``), never a crash of a sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from lab.measure.device import empty_cache, error_summary, is_oom, resolve_device, synchronize
from lab.model.transformer import ModelConfig, TransformerLM, config_for

MODES = ("forward", "forward_backward", "train_step")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Timing:
    """Every timed sample in milliseconds, with summary statistics."""

    samples_ms: list[float] = field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms) if self.samples_ms else math.nan

    @property
    def std_ms(self) -> float:
        return statistics.stdev(self.samples_ms) if len(self.samples_ms) > 1 else 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else math.nan

    @property
    def cv(self) -> float:
        """Coefficient of variation (std / mean): above ~0.05 the mean alone is misleading."""
        return self.std_ms / self.mean_ms if self.samples_ms else math.nan


def time_callable(fn: Callable[[], object], warmup: int = 2, steps: int = 5,
                  device: torch.device | str = "auto") -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then ``steps`` times timed with a host clock.

    The device is synchronized before and after every timed call, so each sample is the wall time of one
    complete step (kernel launch overhead included), in milliseconds.
    """
    device = resolve_device(device) if isinstance(device, str) else device
    for _ in range(warmup):
        fn()
    synchronize(device)
    timing = Timing()
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        timing.samples_ms.append((time.perf_counter() - start) * 1e3)
    return timing


def random_batch(cfg: ModelConfig, batch: int, device: torch.device | str, context: int | None = None,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch, context)."""
    gen = torch.Generator().manual_seed(seed)
    context = context or cfg.context_length
    tokens = torch.randint(0, cfg.vocab_size, (batch, context + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def autocast(device: torch.device, dtype: str):
    """bf16/fp16 autocast on ``device``; a no-op context for fp32."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if DTYPES[dtype] is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions (logits ``(..., vocab)`` computed in fp32, integer targets)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``tokens``."""
    return next_token_loss(model(tokens), targets)


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel for all parameters)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")


def _measure_lm(model, optimizer, tokens, targets, device, dtype, modes, warmup, steps,
                forward_timed_alone: bool = False) -> dict:
    out: dict = {}

    def forward():
        with autocast(device, dtype):
            return lm_loss(model, tokens, targets)

    if "forward" in modes:
        t = time_callable(forward, warmup, steps, device)
        out.update(fwd_ms=t.mean_ms, fwd_std_ms=t.std_ms, fwd_samples_ms=t.samples_ms)

    if "forward_backward" in modes:
        # forward and backward timed separately within each step, synchronizing in between
        fwd, bwd, both = Timing(), Timing(), Timing()
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            synchronize(device)
            t0 = time.perf_counter()
            loss = forward()
            synchronize(device)
            t1 = time.perf_counter()
            loss.backward()
            synchronize(device)
            t2 = time.perf_counter()
            if i >= warmup:
                fwd.samples_ms.append((t1 - t0) * 1e3)
                bwd.samples_ms.append((t2 - t1) * 1e3)
                both.samples_ms.append((t2 - t0) * 1e3)
        del loss
        out.update(fwdbwd_ms=both.mean_ms, fwdbwd_std_ms=both.std_ms, fwdbwd_samples_ms=both.samples_ms,
                   bwd_ms=bwd.mean_ms, bwd_std_ms=bwd.std_ms, bwd_samples_ms=bwd.samples_ms)
        if "forward" not in modes and not forward_timed_alone:
            out.update(fwd_ms=fwd.mean_ms, fwd_std_ms=fwd.std_ms, fwd_samples_ms=fwd.samples_ms)

    if "train_step" in modes:
        def step():
            optimizer.zero_grad(set_to_none=True)
            forward().backward()
            optimizer.step()

        t = time_callable(step, warmup, steps, device)
        out.update(step_ms=t.mean_ms, step_std_ms=t.std_ms, step_samples_ms=t.samples_ms)
    return out


def benchmark_lm(size: str | ModelConfig, context: int = 512, batch: int = 4,
                 modes: str | Sequence[str] = MODES, dtype: str = "fp32", compile: bool = False,
                 attention: str = "sdpa", warmup: int = 2, steps: int = 5,
                 device: torch.device | str = "auto", seed: int = 0) -> dict:
    """Time forward, forward+backward and/or a full AdamW train step of a :class:`TransformerLM`.

    ``size`` is a name from ``MODEL_SIZES`` or a :class:`ModelConfig`. Returns one row (a dict) with the
    spec's ``lm_step`` columns: ``fwd_ms``, ``bwd_ms``, ``fwdbwd_ms``, ``step_ms`` (means in ms, with
    ``*_std_ms`` and every sample in ``*_samples_ms``), ``peak_gib`` (peak allocated GPU memory over the
    whole measurement, GiB; NaN on the CPU), ``params`` and ``status`` (``ok``, or ``oom`` if any mode ran
    out of memory: the modes that fit keep their numbers and ``error`` says which failed).
    """
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    device = resolve_device(device) if isinstance(device, str) else device
    if isinstance(size, ModelConfig):
        cfg = ModelConfig(**{**size.__dict__, "context_length": max(size.context_length, context),
                             "attention": attention})
        name = "custom"
    else:
        cfg = config_for(size, context_length=context, attention=attention)
        name = size
    row = dict(size=name, context=context, batch=batch, dtype=dtype, attention=attention, compile=bool(compile),
               world_size=1, d_model=cfg.d_model, d_ff=cfg.d_ff, num_layers=cfg.num_layers,
               num_heads=cfg.num_heads, device=str(device), warmup=warmup, steps=steps,
               fwd_ms=math.nan, bwd_ms=math.nan, fwdbwd_ms=math.nan, step_ms=math.nan, peak_gib=math.nan,
               params=math.nan, status="ok", error="")
    empty_cache()
    failures = []
    model = runnable = optimizer = tokens = targets = None
    try:
        torch.manual_seed(seed)
        with torch.device(device):  # initialise on the device: a 10B model would take minutes on the CPU
            model = TransformerLM(cfg)
        row["params"] = model.num_parameters()
        runnable = torch.compile(model) if compile else model
        tokens, targets = random_batch(cfg, batch, device, context, seed)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is turned into a row
        if not is_oom(exc):
            raise
        failures.append(f"build: {error_summary(exc)}")
    # each mode on its own, so that a forward that fits is reported even when the train step does not
    for mode in modes if not failures else ():
        failed = False
        try:
            if mode == "train_step" and optimizer is None:
                optimizer = make_optimizer(model, device)
            row.update(_measure_lm(runnable, optimizer, tokens, targets, device, dtype, (mode,), warmup, steps,
                                   forward_timed_alone="forward" in modes))
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            failures.append(f"{mode}: {error_summary(exc)}")
            failed = True
        if failed:  # outside the except block, so the traceback's frames (and their tensors) are gone
            model.zero_grad(set_to_none=True)
            optimizer = None
            gc.collect()
            empty_cache()
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if failures:
        row.update(status="oom", error="; ".join(failures))
    # drop every reference to the model before the next configuration is built
    model = runnable = optimizer = tokens = targets = None  # noqa: F841
    gc.collect()
    empty_cache()
    return row


def warmup_study(size: str | ModelConfig, warmups: Sequence[int] = (0, 1, 2, 5), steps: int = 10,
                 context: int = 512, batch: int = 4, dtype: str = "fp32", attention: str = "sdpa",
                 device: str = "auto", progress: bool = True) -> pd.DataFrame:
    """Per-step forward/backward times for each warm-up count, each in a fresh Python process.

    A fresh process is the honest setting: CUDA context creation, cuBLAS handle and heuristics, allocator
    growth and kernel loading all land on the first steps of a cold process, which is what warm-up hides.
    Returns one row per (warmup, step index) with ``fwd_ms``, ``bwd_ms`` and ``fwdbwd_ms``.
    """
    import json
    import subprocess

    from tqdm import tqdm

    from lab.paths import REPO_ROOT

    if isinstance(size, ModelConfig):
        arch = ["--d-model", str(size.d_model), "--d-ff", str(size.d_ff), "--num-layers", str(size.num_layers),
                "--num-heads", str(size.num_heads), "--vocab-size", str(size.vocab_size)]
    else:
        arch = ["--size", size]
    rows = []
    for w in tqdm(warmups, desc="warm-up study", disable=not progress):
        cmd = [sys.executable, "-m", "lab.bench", *arch, "--context", str(context), "--batch", str(batch),
               "--mode", "forward_backward", "--dtype", dtype, "--attention", attention, "--warmup", str(w),
               "--steps", str(steps), "--device", device, "--json"]
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"warm-up run with warmup={w} failed:\n{out.stderr[-2000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        if row["status"] != "ok":
            rows.append(dict(warmup=w, step=0, status=row["status"]))
            continue
        for i, (f, b, fb) in enumerate(zip(row["fwd_samples_ms"], row["bwd_samples_ms"], row["fwdbwd_samples_ms"])):
            rows.append(dict(warmup=w, step=i, fwd_ms=f, bwd_ms=b, fwdbwd_ms=fb, status="ok"))
    return pd.DataFrame(rows)


def samples_long(df: pd.DataFrame, keys: Sequence[str] = ("size", "context", "dtype", "attention", "compile"),
                 ) -> pd.DataFrame:
    """Every timed sample of a benchmark table in long form: one row per (config, phase, step index)."""
    rows = []
    for _, r in df.iterrows():
        for phase in ("fwd", "bwd", "fwdbwd", "step"):
            samples = r.get(f"{phase}_samples_ms")
            if not isinstance(samples, list):
                continue
            for i, ms in enumerate(samples):
                rows.append({**{k: r[k] for k in keys if k in r}, "phase": phase, "step": i, "ms": ms})
    return pd.DataFrame(rows)


def lm_step_table(df: pd.DataFrame) -> pd.DataFrame:
    """The benchmark rows without the per-sample lists (what goes into ``results/lm_step.csv``)."""
    return df.drop(columns=[c for c in df.columns if c.endswith("_samples_ms")])


def sweep_lm(sizes: Iterable[str | ModelConfig], contexts: Iterable[int] = (512,), dtypes: Iterable[str] = ("fp32",),
             modes: Sequence[str] | Callable[[str, int], Sequence[str]] = ("forward", "forward_backward"),
             progress: bool = True, **kwargs) -> pd.DataFrame:
    """:func:`benchmark_lm` over every size x context x dtype, one row each, with a tqdm progress bar.

    ``modes`` may be a function of (size, context), e.g. to add the train step at one context only.
    """
    from tqdm import tqdm

    grid = [(s, c, d) for s in sizes for c in contexts for d in dtypes]
    rows = []
    bar = tqdm(grid, desc="lm sweep", disable=not progress)
    for s, c, d in bar:
        bar.set_postfix_str(f"{s} ctx={c} {d}")
        m = modes(s, c) if callable(modes) else modes
        rows.append(benchmark_lm(s, context=c, dtype=d, modes=m, **kwargs))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------------------
# CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.bench.lm",
                                description="Time a Transformer LM: forward, forward+backward or AdamW train step.")
    p.add_argument("--size", default="small", help="model size name (small, medium, large, xl, 2.7B, 10B), "
                   "ignored when --d-model etc. are given")
    p.add_argument("--d-model", type=int)
    p.add_argument("--d-ff", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--vocab-size", type=int, default=10_000)
    p.add_argument("--context", type=int, nargs="+", default=[512], help="one or more context lengths")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--mode", nargs="+", choices=MODES, default=["forward", "forward_backward"])
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="fp32, or autocast to bf16/fp16")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attention", default="sdpa", help="naive, sdpa, flash_triton, flash_pytorch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--results-dir", default=None, help="also append the rows to <dir>/lm_step.csv")
    p.add_argument("--json", action="store_true", help="print the rows (every sample included) as JSON lines")
    return p


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    args = _parser().parse_args(argv)
    explicit = [args.d_model, args.d_ff, args.num_layers, args.num_heads]
    if any(v is not None for v in explicit):
        if not all(v is not None for v in explicit):
            _parser().error("--d-model, --d-ff, --num-layers and --num-heads go together")
        size = ModelConfig(d_model=args.d_model, d_ff=args.d_ff, num_layers=args.num_layers,
                           num_heads=args.num_heads, vocab_size=args.vocab_size,
                           context_length=max(args.context))
    else:
        size = args.size
        try:
            config_for(size)
        except ValueError as exc:
            _parser().error(str(exc))
    rows = [benchmark_lm(size, context=c, batch=args.batch, modes=args.mode, dtype=args.dtype,
                         compile=args.compile, attention=args.attention, warmup=args.warmup,
                         steps=args.steps, device=args.device) for c in args.context]
    df = pd.DataFrame(rows)
    if args.json:
        import json

        for row in rows:
            print(json.dumps(row))
        return df
    cols = ["size", "context", "batch", "dtype", "attention", "compile", "status", "fwd_ms", "fwd_std_ms",
            "bwd_ms", "bwd_std_ms", "fwdbwd_ms", "step_ms", "step_std_ms", "peak_gib"]
    print(df[[c for c in cols if c in df.columns]].to_markdown(index=False, floatfmt=".2f"))
    if args.results_dir:
        from lab.measure.results import save_results

        path = save_results(df, "lm_step", args.results_dir, params=vars(args))
        print(f"rows written to {path}", file=sys.stderr)
    return df


if __name__ == "__main__":
    main()
