"""``python -m lab.bench``: the language-model benchmark's command line, with one-line errors.

Every bad input is refused before anything runs, in one line that says what was wrong and what is
accepted (``--debug`` shows tracebacks). A configuration that cannot fit in this CPU's memory is refused
with the estimate (on a GPU an out-of-memory is caught and reported as a row instead).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import pandas as pd

from lab import cli
from lab.bench.lm import benchmark_lm, lm_config, lm_step_table
from lab.bench.memory_estimate import fit_advice
from lab.dtypes import TRAINING_DTYPES
from lab.measure.device import available_memory_bytes, resolve_device
from lab.measure.results import save_results
from lab.measure.step import MODES
from lab.model import MODEL_SIZES, QUICK_SIZES, ModelConfig, config_for
from lab.model.attention import attention_names

SIZES_HELP = ", ".join([*QUICK_SIZES, *MODEL_SIZES])


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m lab.bench",
                   description="Time a Transformer LM: forward, forward+backward or AdamW train step, with each "
                               "mode's peak memory. Sizes: " + SIZES_HELP + " (tiny and mini are CPU-sized).")
    p.add_argument("--size", default="small", help=f"model size ({SIZES_HELP}); ignored when --d-model etc. are given")
    p.add_argument("--d-model", type=cli.positive_int)
    p.add_argument("--d-ff", type=cli.positive_int)
    p.add_argument("--num-layers", type=cli.positive_int)
    p.add_argument("--num-heads", type=cli.positive_int)
    p.add_argument("--vocab-size", type=cli.positive_int, default=10_000)
    p.add_argument("--context", type=cli.positive_int, nargs="+", default=[512], help="one or more context lengths")
    p.add_argument("--batch", type=cli.positive_int, default=4)
    p.add_argument("--mode", nargs="+", choices=MODES, default=["forward", "forward_backward"])
    p.add_argument("--dtype", choices=TRAINING_DTYPES, default="fp32", help="fp32, or autocast to bf16/fp16")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attention", default="sdpa", choices=attention_names(), metavar="NAME",
                   help="attention implementation: " + ", ".join(attention_names()))
    p.add_argument("--fused-loss", action="store_true",
                   help="loss through the fused LM-head cross-entropy kernel (no logits in memory)")
    p.add_argument("--warmup", type=cli.non_negative_int, default=5)
    p.add_argument("--steps", type=cli.positive_int, default=10)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:<index>")
    p.add_argument("--results-dir", default=None, help="also save the rows as <dir>/lm_step.csv")
    p.add_argument("--json", action="store_true", help="print the rows (every sample included) as JSON lines")
    return p


def _model(args) -> str | ModelConfig:
    explicit = [args.d_model, args.d_ff, args.num_layers, args.num_heads]
    if any(v is not None for v in explicit):
        if not all(v is not None for v in explicit):
            raise cli.UsageError("--d-model, --d-ff, --num-layers and --num-heads go together")
        try:
            return ModelConfig(d_model=args.d_model, d_ff=args.d_ff, num_layers=args.num_layers,
                               num_heads=args.num_heads, vocab_size=args.vocab_size, context_length=max(args.context))
        except ValueError as exc:
            raise cli.UsageError(str(exc)) from None
    try:
        config_for(args.size)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    return args.size


def refuse_what_cannot_fit(size, contexts, batch, dtype, modes, device, attention: str = "sdpa",
                           fused_loss: bool = False) -> None:
    """On the CPU, refuse a configuration whose estimated peak (:func:`lab.bench.memory_estimate.cpu_peak_bytes`)
    exceeds the available memory, naming the change that would fit: the operating system would kill the process
    instead of raising an error that could become an ``oom`` row."""
    if device.type != "cpu":
        return
    available = available_memory_bytes(device)
    for context in contexts:
        name, cfg = lm_config(size, context, attention=attention, fused_loss=fused_loss)
        advice = fit_advice(size if isinstance(size, str) else None, cfg, batch, context, dtype, modes, available)
        if not advice.fits:
            raise cli.UsageError(f"{name} at context {context}, batch {batch} ({dtype}) needs about "
                                 f"{advice.need / 2**30:.1f} GiB for {'/'.join(modes)}, but this CPU has "
                                 f"{available / 2**30:.1f} GiB available; would fit: {advice.change()}")


def lm_main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    size = _model(args)

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    if args.results_dir:
        cli.writable_dir(args.results_dir)
    refuse_what_cannot_fit(size, args.context, args.batch, args.dtype, args.mode, device, args.attention,
                           args.fused_loss)
    rows = [benchmark_lm(size, context=c, batch=args.batch, modes=args.mode, dtype=args.dtype, compile=args.compile,
                         attention=args.attention, fused_loss=args.fused_loss, warmup=args.warmup, steps=args.steps,
                         device=device) for c in args.context]
    df = pd.DataFrame(rows)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        # medians with their spread (lab.measure.verdicts), and whether the GPU waited for the host
        cols = ["size", "context", "batch", "dtype", "attention", "compile", "status", "fwd_ms", "fwd_spread_ms",
                "bwd_ms", "fwdbwd_ms", "fwdbwd_spread_ms", "step_ms", "step_spread_ms", "fwd_n", "fwdbwd_n", "step_n",
                "fwd_peak_gib", "fwdbwd_peak_gib", "step_peak_gib", "fwd_gpu_ms", "fwdbwd_gpu_ms", "step_gpu_ms",
                "gpu_busy", "host_bound"]
        shown = df[[c for c in cols if c in df.columns]].dropna(axis=1, how="all")
        shown = shown.drop(columns=[c for c in shown if c.endswith("_n") and not shown[c].any()])  # modes not run
        print(shown.to_markdown(index=False, floatfmt=".2f"))
    if args.results_dir:
        path = save_results(lm_step_table(df), "lm_step", args.results_dir, params=vars(args), source="lab.bench")
        print(f"rows written to {path}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(lm_main, argv, prog="python -m lab.bench")
