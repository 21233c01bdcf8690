"""GPU check of the fused LM head + cross-entropy: correctness at real sizes, speed, memory, torch.compile.

Run from the repository root on one CUDA GPU (about 4 minutes on an H100); files go to $OUT (default ./out)::

    OUT=/some/dir python tools/fused_loss_gpu_check.py [--budget-s 210] [--skip-candidates]

Parts, in order; each in try/except; a part starts only if its estimated end is within the budget:

1. correctness: the fused loss and gradients (recompute, gradients-in-forward, skip threshold 2^-12) and
   the materialized bf16 loss against the materialized loss in fp32 (no TF32), (N, D, V) = (2048, 4096,
   151936) with flat (std 1) and peaked (std 8) logits, (1999, 8192, 32003), (4096, 768, 10000);
2. benchmark: :func:`lab.bench.fused_loss.benchmark_loss` of fused, fused_grad_in_forward, torch,
   torch_compiled, torch_chunked at (V, D, N) = (151936, 4096, 32768), then (10000, {768, 2560}, 16384),
   bf16: median ms, peak extra GiB (and the closed-form prediction), TFLOP/s (6 N D V), ratios;
3. compile: ``torch.compile(fullgraph=True)`` of the loss and of a TransformerLM with ``fused_loss=True``
   under bf16 autocast, against eager;
4. candidates: each kernel alone at the goal shape for every config of ``CANDIDATES`` (and cuBLAS on the
   same GEMMs), then the fused loss again with the fastest ones ("fused (fastest candidates)").

Files: log.txt (line by line), correctness.csv, benchmark.csv, compile.csv, candidates.csv, summary.md
(also printed). ``--compile-only`` needs no GPU: every kernel variant compiled for sm_90a by Triton's
bundled ptxas, arguments specialised as the JIT would at the goal shape: registers, spills, shared memory.
``--smoke`` runs every part on the CPU (interpreted Triton, tiny shapes): a check of the script only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL = (151936, 4096, 32768)  # (V, D, N)
SMALL = [(10000, 768, 16384), (10000, 2560, 16384)]
DEVICE = "cuda"
# ((N, D, V), logit scale) of the correctness part; (V, D, N) of the compile part's loss; its model's size
CORRECTNESS_CASES = [((2048, 4096, 151936), 1.0), ((2048, 4096, 151936), 8.0), ((1999, 8192, 32003), 1.0),
                     ((4096, 768, 10000), 4.0)]
COMPILE_SHAPE = (32000, 2048, 4096)
MODEL = dict(d_model=512, d_ff=1536, num_layers=2, num_heads=8, context_length=256, vocab_size=32003)
CANDIDATE_LSE_TOKENS, CANDIDATE_WIDTH = 8192, 4096  # tokens of the lse timing, vocabulary chunk of the others


def use_smoke_setup() -> None:
    """``--smoke``: every part on the CPU with interpreted Triton and tiny shapes (checks the script, not
    the kernels' speed). Must run before anything imports Triton."""
    global GOAL, SMALL, DEVICE, CORRECTNESS_CASES, COMPILE_SHAPE, MODEL, CANDIDATE_LSE_TOKENS, CANDIDATE_WIDTH
    os.environ["TRITON_INTERPRET"] = "1"
    GOAL, SMALL, DEVICE = (300, 64, 40), [(100, 32, 24)], "cpu"
    CORRECTNESS_CASES = [((40, 64, 300), 1.0), ((40, 64, 300), 8.0)]
    COMPILE_SHAPE = (100, 32, 24)
    MODEL = dict(d_model=32, d_ff=64, num_layers=1, num_heads=4, context_length=16, vocab_size=72)
    CANDIDATE_LSE_TOKENS, CANDIDATE_WIDTH = 40, 256


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
IMPLS = ("fused", "fused_grad_in_forward", "torch", "torch_compiled", "torch_chunked")
START = time.time()
LOG_PATH: Path | None = None  # log.txt under --out, appended line by line (survives a killed run)


def log(*parts) -> None:
    line = f"[{time.time() - START:6.1f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG_PATH is not None:
        with open(LOG_PATH, "a") as f:
            f.write(line + "\n")


# ------------------------------------------------------------------------------------ compile only (CPU)
def compile_only(which: str = "default") -> list[dict]:
    """:func:`lab.kernels.fused_cross_entropy_kernels.compile_report` for sm_90a, logged row by row."""
    from lab.kernels import fused_cross_entropy_kernels as K

    rows = K.compile_report(which, arch=90)
    for row in rows:
        log(f"{row['kernel']:>22} {row['config']}: "
            + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("kernel", "config")))
    return rows


# ------------------------------------------------------------------------------------------- GPU parts
def _rel(got, ref) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _fp32_reference(hidden, weight, targets):
    import torch
    import torch.nn.functional as F

    h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    loss = F.cross_entropy(h @ w.T, targets)
    return loss.detach(), torch.autograd.grad(loss, (h, w))


def part_correctness() -> list[dict]:
    import torch

    from lab.bench.fused_loss import make_inputs, materialized_loss
    from lab.kernels.fused_cross_entropy import fused_linear_cross_entropy

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for (n, d, v), scale in CORRECTNESS_CASES:
        hidden, weight, targets = make_inputs(v, d, n, "bf16", DEVICE, seed=n)
        with torch.no_grad():
            weight.mul_(scale)  # logits of std ~scale: 1 is flat, 8 is peaked like a trained model's
        targets[::11] = -100
        ref_loss, ref_grads = _fp32_reference(hidden, weight, targets)
        variants = {"recompute": {}, "grad_in_forward": {"grad_in_forward": True},
                    "skip 2^-12": {"softmax_skip_threshold": 2**-12}}
        fns = {k: (lambda h, w, t, kw=kw: fused_linear_cross_entropy(h, w, t, **kw)) for k, kw in variants.items()}
        fns["torch bf16"] = materialized_loss
        for name, fn in fns.items():
            row = dict(n=n, d=d, v=v, logit_scale=scale, variant=name)
            try:
                loss = fn(hidden, weight, targets)
                dh, dw = torch.autograd.grad(loss, (hidden, weight))
                row.update(loss=loss.item(), loss_abs_err=abs(loss.item() - ref_loss.item()),
                           d_hidden_rel_err=_rel(dh, ref_grads[0]), d_weight_rel_err=_rel(dw, ref_grads[1]),
                           finite=bool(torch.isfinite(dh).all() and torch.isfinite(dw).all()))
            except Exception as exc:  # noqa: BLE001
                row.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
            log("correctness", {k: (f"{x:.3g}" if isinstance(x, float) else x) for k, x in row.items()})
        del hidden, weight, ref_grads
        _empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = True
    return rows


def part_compile() -> list[dict]:
    import torch

    from lab.bench.fused_loss import make_inputs
    from lab.kernels.fused_cross_entropy import fused_linear_cross_entropy
    from lab.model.transformer import ModelConfig, TransformerLM

    rows = []
    hidden, weight, targets = make_inputs(*COMPILE_SHAPE, "bf16", DEVICE)
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    for gif in (False, True):
        fn = lambda h, w, t, gif=gif: fused_linear_cross_entropy(h, w, t, grad_in_forward=gif)  # noqa: E731
        eager = [fn(hidden, weight, targets)]
        eager += torch.autograd.grad(eager[0], (hidden, weight))
        compiled_fn = torch.compile(fn, fullgraph=True, backend=backend)
        got = [compiled_fn(hidden, weight, targets)]
        got += torch.autograd.grad(got[0], (hidden, weight))
        rows.append(dict(case=f"loss grad_in_forward={gif}", max_rel_diff=max(_rel(a, b) for a, b in zip(got, eager))))
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL, fused_loss=True)
    model = TransformerLM(cfg).to(DEVICE)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.context_length + 1), device=DEVICE)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        eager_loss = model(x, y)
        eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        loss = compiled(x, y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    rows.append(dict(case="TransformerLM fused_loss bf16 autocast", loss=loss.item(), eager_loss=eager_loss.item(),
                     max_rel_diff=max(_rel(a, b) for a, b in zip(grads, eager_grads))))
    for r in rows:
        log("compile", r)
    return rows


def part_benchmark(shapes, impls=IMPLS):
    import pandas as pd

    from lab.bench.fused_loss import benchmark_loss, fused_memory_model, materialized_memory_model

    rows = []
    for vocab, d_model, tokens in shapes:
        big = vocab * tokens > 1e9
        for impl in impls:
            row = benchmark_loss(impl, vocab, d_model, tokens, "bf16", DEVICE, rep_ms=1000 if big else 300,
                                 cpu_steps=1, record_errors=True)
            if impl.startswith("fused"):
                model = fused_memory_model(tokens, d_model, vocab, "bf16", grad_in_forward=impl != "fused")
                row["predicted_extra_gib"] = model["peak"] / 2**30
            elif impl == "torch":
                row["predicted_extra_gib"] = materialized_memory_model(tokens, vocab, "bf16")["peak"] / 2**30
            rows.append(row)
            log(f"benchmark {impl:>22} V={vocab} D={d_model} N={tokens}: fwd {row['fwd_ms']:.2f} ms, "
                f"fwd+bwd {row['fwdbwd_ms']:.2f} ms, {row['tflops']:.0f} TFLOP/s, "
                f"extra {row['peak_extra_gib']:.3f} GiB, {row['status']} {row['error']}")
    return pd.DataFrame(rows)


def _bench_ms(fn, rep_ms: float = 200) -> float:
    """Median ms of ``fn`` (do_bench on CUDA, one host-timed call on the CPU)."""
    import torch

    from lab.bench.fused_loss import time_ms

    return time_ms(fn, torch.device(DEVICE), warmup_ms=25, rep_ms=rep_ms, cpu_steps=1)


def part_candidates(deadline: float) -> tuple[list[dict], dict]:
    """Each kernel alone at the goal shape, every candidate config; returns (rows, best config per kernel)."""
    import torch

    from lab.kernels import fused_cross_entropy_kernels as K

    vocab, d, n = GOAL
    dev = DEVICE
    h = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(vocab, d, device=dev, dtype=torch.bfloat16) / d**0.5
    t = torch.randint(0, vocab, (n,), device=dev)
    n_lse = CANDIDATE_LSE_TOKENS  # a quarter of the tokens: 10 TFLOP per call, ~17 ms at 600 TFLOP/s
    lse, g = torch.zeros(n, device=dev), torch.full((n,), 1.0 / n, device=dev)
    width = CANDIDATE_WIDTH
    scratch = torch.randn(n, width, device=dev, dtype=torch.bfloat16) * 1e-3
    acc = torch.zeros(n, d, device=dev)
    dw = torch.empty(width, d, device=dev, dtype=torch.bfloat16)
    rows, best = [], {}
    jobs = [("lse", cfg) for cfg in K.CANDIDATES["lse"]] + [("dlogits", cfg) for cfg in K.CANDIDATES["lse"]]
    jobs += [("matmul", cfg) for cfg in K.CANDIDATES["matmul"]]
    flops = {"lse": 2 * n_lse * d * vocab, "dlogits": 2 * n * d * width, "matmul dW": 2 * width * n * d,
             "matmul dH+=": 2 * n * width * d}
    for kernel, cfg in jobs:
        if time.time() > deadline:
            log("candidates: budget reached")
            break
        if kernel == "lse":
            part = torch.empty(n_lse, -(-vocab // cfg["BLOCK_N"]), device=dev)
            tgt = torch.zeros(n_lse, device=dev)
            calls = {"lse": lambda: K.launch_lse(h[:n_lse], w, t[:n_lse], part, tgt, cfg)}
        elif kernel == "dlogits":
            calls = {"dlogits": lambda: K.launch_dlogits(h, w[:width], t, lse, g, -g, scratch, 0, cfg)}
        else:
            calls = {"matmul dW": lambda: K.launch_matmul(scratch.t(), h, dw, cfg),
                     "matmul dH+=": lambda: K.launch_matmul(scratch, w[:width], acc, cfg, c_in=acc)}
        for name, call in calls.items():
            row = dict(kernel=name, config=K.config_name(cfg))
            try:
                ms = _bench_ms(call)
                row.update(ms=ms, tflops=flops[name] / ms / 1e9)
                if ms < best.get(name, (math.inf, None))[0]:
                    best[name] = (ms, cfg)
            except Exception as exc:  # noqa: BLE001 - out of shared memory and the like
                row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            rows.append(row)
            log("candidate", row)
    for name, call in {"cublas dW": lambda: torch.mm(scratch.t(), h, out=dw),
                       "cublas dH (bf16 out)": lambda: torch.mm(scratch, w[:width])}.items():
        ms = _bench_ms(call)
        rows.append(dict(kernel=name, config="torch.mm", ms=ms, tflops=2 * n * d * width / ms / 1e9))
        log("candidate", rows[-1])
    chosen = {k: v[1] for k, v in best.items()}
    return rows, chosen


def apply_best(chosen: dict) -> None:
    """Put the fastest candidates into ``CONFIGS`` (for the GEMMs: the fastest on dH+=)."""
    from lab.kernels import fused_cross_entropy_kernels as K

    for kernel, key in (("lse", "lse"), ("dlogits", "dlogits"), ("matmul dH+=", "matmul")):
        if kernel in chosen:
            K.CONFIGS[(key, "16bit")] = dict(chosen[kernel])


def goal_lines(bench) -> list[str]:
    """The issue's two goals at the goal shape, for every fused row: (a) peak extra memory <= 5% of the
    materialized loss (eager; compiled shown too), (b) fwd+bwd time <= 1.0x torch_compiled."""
    v, d, n = GOAL
    at = bench[(bench["vocab"] == v) & (bench["d_model"] == d) & (bench["tokens"] == n)]
    ok = at[at["status"] == "ok"].set_index("impl")
    lines = []
    for impl in [i for i in ok.index if str(i).startswith("fused")]:
        row = ok.loc[impl]
        parts = [f"- {impl}: {row['fwdbwd_ms']:.1f} ms, {row['peak_extra_gib']:.3f} GiB extra"]
        for base in ("torch", "torch_compiled"):
            if base in ok.index:
                mem = row["peak_extra_gib"] / ok.loc[base, "peak_extra_gib"]
                parts.append(f"memory {100 * mem:.1f}% of {base}" + (" (goal a: <= 5%)" if base == "torch" else ""))
        if "torch_compiled" in ok.index:
            parts.append(f"time {row['fwdbwd_ms'] / ok.loc['torch_compiled', 'fwdbwd_ms']:.2f}x torch_compiled "
                         "(goal b: <= 1.0x)")
        lines.append(", ".join(parts))
    missing = [i for i in ("torch", "torch_compiled") if i not in ok.index]
    if missing:
        lines.append(f"- no ok row for {missing} at this shape (out of memory or not run): see benchmark.csv")
    return lines


def summary_md(correct, compiled, bench, cands, chosen) -> str:
    import pandas as pd

    out = ["# Fused LM-head loss: GPU check", ""]
    try:
        import torch

        name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run)"
        out += [f"device: {name}, torch {torch.__version__}", ""]
    except Exception:  # noqa: BLE001
        pass
    if bench is not None and len(bench):
        out += ["## Goals at (V, D, N) = " + str(GOAL), ""] + goal_lines(bench) + [""]
        cols = ["impl", "vocab", "d_model", "tokens", "fwd_ms", "fwdbwd_ms", "tflops", "peak_extra_gib",
                "predicted_extra_gib", "time_vs_torch_compiled", "memory_vs_torch_compiled", "memory_vs_torch",
                "status"]
        table = bench[[c for c in cols if c in bench]].to_markdown(index=False, floatfmt=".3g")
        out += ["## Benchmark (bf16)", "", table, ""]
    if correct:
        out += ["## Correctness vs fp32", "", pd.DataFrame(correct).to_markdown(index=False, floatfmt=".3g"), ""]
    if compiled:
        out += ["## torch.compile(fullgraph=True) vs eager", "", pd.DataFrame(compiled).to_markdown(index=False), ""]
    if cands:
        from lab.kernels.fused_cross_entropy_kernels import config_name

        table = pd.DataFrame(cands).to_markdown(index=False, floatfmt=".3g")
        out += ["## Kernel candidates at the goal shape", "", table, "",
                f"fastest: { {k: config_name(v) for k, v in chosen.items()} }", ""]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="a part starts only if its estimate ends within this many seconds")
    parser.add_argument("--skip-candidates", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="all parts on the CPU, interpreted, tiny shapes")
    parser.add_argument("--compile-only", choices=("default", "candidates"), nargs="?", const="default",
                        help="compile for sm_90a with ptxas (no GPU needed): default configs or all candidates")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global LOG_PATH
    LOG_PATH = out / "log.txt"
    LOG_PATH.write_text("")
    import pandas as pd

    if args.compile_only:
        rows = compile_only(args.compile_only)
        pd.DataFrame(rows).to_csv(out / "compile_only.csv", index=False)
        failed = [r for r in rows if "error" in r]
        spilled = [r for r in rows if r.get("spill_bytes", 0) != 0]
        print(f"{len(rows)} kernels compiled for sm_90a: {len(failed)} failed, {len(spilled)} spill registers")
        # the default configs must compile without spills; a spilling candidate is only slower
        return 1 if failed or (spilled and args.compile_only == "default") else 0
    if args.smoke:
        use_smoke_setup()
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA GPU: run with --compile-only (or --smoke) on a machine without one")
        return 2
    log(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU (smoke)'} torch {torch.__version__}")
    deadline = START + args.budget_s
    correct, compiled, bench, cands, chosen = [], [], None, [], {}
    # rough seconds on an H100, Triton JIT and Inductor compilation included; a part starts only if it fits
    estimates = {"correctness": 60, "benchmark goal": 70, "benchmark small": 40, "compile": 40, "candidates": 30,
                 "benchmark goal tuned": 15}

    def run(name, fn):
        if time.time() + estimates.get(name, 10) > deadline:
            log(f"{name}: skipped (time budget)")
            return None
        log(f"--- {name}")
        try:
            return fn()
        except Exception:  # noqa: BLE001 - every part is optional; the log says what failed
            log(f"{name} FAILED:\n{traceback.format_exc()}")
            return None
        finally:
            _empty_cache()

    frames = []

    def save_benchmark(frame):
        """Append a part's rows and rewrite benchmark.csv with the ratios (every part's results survive)."""
        nonlocal bench
        if frame is not None:
            from lab.bench.fused_loss import add_ratios

            frames.append(frame)
            bench = add_ratios(add_ratios(pd.concat(frames, ignore_index=True), "torch_compiled"), "torch")
            bench.to_csv(out / "benchmark.csv", index=False)

    correct = run("correctness", part_correctness) or []
    pd.DataFrame(correct).to_csv(out / "correctness.csv", index=False)
    save_benchmark(run("benchmark goal", lambda: part_benchmark([GOAL])))
    save_benchmark(run("benchmark small", lambda: part_benchmark(SMALL)))
    compiled = run("compile", part_compile) or []
    pd.DataFrame(compiled).to_csv(out / "compile.csv", index=False)
    if not args.skip_candidates and (res := run("candidates", lambda: part_candidates(deadline))):
        cands, chosen = res
        pd.DataFrame(cands).to_csv(out / "candidates.csv", index=False)
        apply_best(chosen)
        tuned = run("benchmark goal tuned", lambda: part_benchmark([GOAL], ("fused",)))
        save_benchmark(None if tuned is None else tuned.assign(impl="fused (fastest candidates)"))
    text = summary_md(correct, compiled, bench, cands, chosen)
    (out / "summary.md").write_text(text)
    log(f"done in {time.time() - START:.0f} s; files in {out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
