"""GPU check of the fused LM head + cross-entropy: correctness at real sizes, torch.compile, speed and memory.

Run from the repository root on a machine with one CUDA GPU (about 4 minutes on an H100)::

    OUT=/some/dir python tools/fused_loss_gpu_check.py [--budget-s 230] [--skip-candidates]

Parts, in this order (each in try/except; a part whose estimated duration would end after the time
budget is skipped and the log says so; the candidates stop at the budget):

1. ``correctness``: fused loss and gradients (recompute mode, gradients-in-forward mode, the skip threshold)
   against the materialized loss in fp32 without TF32, next to the materialized bf16 loss's own error, at
   (N, D, V) = (2048, 4096, 151936) with flat (std 1) and peaked (std 8) logits, (1999, 8192, 32003) and
   (4096, 768, 10000);
2. ``benchmark goal`` and ``benchmark small``: :func:`lab.bench.fused_loss.benchmark_loss` for fused,
   fused_grad_in_forward, torch, torch_compiled and torch_chunked at (V, D, N) = (151936, 4096, 32768),
   then (10000, {768, 2560}, 16384), bf16: fwd and fwd+bwd median ms, peak extra GiB (and the closed-form
   prediction), TFLOP/s (6 N D V), ratios to torch_compiled and to torch;
3. ``compile``: ``torch.compile(fullgraph=True)`` (Inductor) of the loss and of a small TransformerLM with
   ``fused_loss=True`` under bf16 autocast, against eager;
4. ``candidates``: each kernel alone at the goal shape for every config in
   ``fused_cross_entropy_kernels.CANDIDATES`` (and cuBLAS on the same GEMMs); then the fused loss again at
   the goal shape with the fastest configs (row "fused (fastest candidates)").

Writes log.txt, correctness.csv, compile.csv, benchmark.csv, candidates.csv, summary.md under $OUT
(default ./out) and prints the summary. ``--compile-only`` needs no GPU: it compiles every kernel variant
for sm_90a with Triton's bundled ptxas (arguments specialised as the JIT would at the goal shape) and
reports registers, spills and shared memory.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
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
_LOG: list[str] = []


def log(*parts) -> None:
    line = f"[{time.time() - START:6.1f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    _LOG.append(line)


# ------------------------------------------------------------------------------------ compile only (CPU)
def compile_only(which: str = "default", arch: int = 90) -> list[dict]:
    """Compile every kernel variant for ``sm_<arch>a`` without a GPU, with the default configs of bf16 and
    fp32 (``which="default"``) or every bf16 candidate (``"candidates"``); returns one row per compile with
    registers, spill bytes, shared memory (from ``ptxas -v``) and whether wgmma is used."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lab.kernels import fused_cross_entropy_kernels as K

    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    target = GPUTarget("cuda", arch, 32)
    # arguments the JIT does not mark divisible by 16: floats, flag strides, do_not_specialize sizes
    no_hint = {"threshold", "stride_fm", "stride_fk", "stride_f"}

    def build(fn, types: dict, consts: dict, cfg: dict, ones=()):
        meta = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
        consts = {**consts, **meta, **{o: 1 for o in ones}}  # the JIT turns int arguments equal to 1 into constants
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        # the JIT marks 16-byte aligned pointers and ints divisible by 16 (all of them at the goal shape)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n] != "constexpr" and n not in no_hint and n not in fn.do_not_specialize}
        compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=target,
                                  options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        ptx = Path(os.environ.get("TMPDIR", "/tmp")) / f"fused_loss_{os.getpid()}.ptx"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(ptx), "-o", os.devnull],
                              capture_output=True, text=True).stderr
        ptx.unlink()
        regs = re.search(r"Used (\d+) registers", info)
        spills = re.search(r"(\d+) bytes spill stores", info)
        return dict(registers=int(regs.group(1)) if regs else -1, spill_bytes=int(spills.group(1)) if spills else -1,
                    shared_kib=compiled.metadata.shared / 1024, wgmma="wgmma" in compiled.asm["ptx"])

    variants = []
    for dtype in ("bf16", "fp32") if which == "default" else ("bf16",):
        p = "*" + dtype
        lse_t = {"H": p, "W": p, "T": "*i64", "P": "*fp32", "TGT": "*fp32", "L": p}
        dl_t = {"H": p, "W": p, "T": "*i64", "LSE": "*fp32", "GL": "*fp32", "GT": "*fp32", "S": p,
                "FLAGS": "*i32", "threshold": "fp32"}
        mm_out = {"A": p, "B": p, "C_IN": "*fp32", "C": p, "FLAGS": "*i32"}
        mm_acc = {**mm_out, "C": "*fp32"}
        common = {"EVEN_K": True, "PRECISION": "tf32"}
        cls = "fp32" if dtype == "fp32" else "16bit"
        tiles = K.CANDIDATES["lse"] if which == "candidates" else [K.CONFIGS[("lse", cls)]]
        for cfg in tiles:
            variants += [(f"lse {dtype}", K._lse_kernel, lse_t, {**common, "STORE_LOGITS": False}, cfg, ()),
                         (f"lse+store {dtype}", K._lse_kernel, lse_t, {**common, "STORE_LOGITS": True}, cfg, ())]
        for cfg in K.CANDIDATES["lse"] if which == "candidates" else [K.CONFIGS[("dlogits", cls)]]:
            variants += [(f"dlogits {dtype}", K._dlogits_kernel, dl_t, {**common, "USE_FLAGS": False}, cfg, ()),
                         (f"dlogits+flags {dtype}", K._dlogits_kernel, dl_t, {**common, "USE_FLAGS": True}, cfg, ())]
        dl_cfg = K.CONFIGS[("dlogits", cls)]
        flags_on = {**common, "USE_FLAGS": True, "FLAG_M": dl_cfg["BLOCK_M"], "FLAG_K": dl_cfg["BLOCK_N"]}
        flags_off = {**common, "USE_FLAGS": False, "FLAG_M": 1, "FLAG_K": 1}
        for cfg in K.CANDIDATES["matmul"] if which == "candidates" else [K.CONFIGS[("matmul", cls)]]:
            variants += [(f"matmul dW {dtype}", K._matmul_kernel, mm_out, {**flags_off, "HAS_C_IN": False}, cfg,
                          ("stride_am", "stride_bn")),
                         (f"matmul dH+= {dtype}", K._matmul_kernel, mm_acc, {**flags_off, "HAS_C_IN": True}, cfg,
                          ("stride_ak", "stride_bn")),
                         (f"matmul dH+= flags {dtype}", K._matmul_kernel, mm_acc, {**flags_on, "HAS_C_IN": True}, cfg,
                          ("stride_ak", "stride_bn", "stride_fk"))]
        variants.append((f"softmax_grad {dtype}", K._softmax_grad_kernel, {"L": p, "LSE": "*fp32", "T": "*i64",
                         "GL": "*fp32", "GT": "*fp32"}, {}, dict(BLOCK=1024, num_warps=4, num_stages=1), ()))
    rows = []
    for name, fn, types, consts, cfg, ones in variants:
        row = dict(kernel=name, config=_cfg_str(cfg) if "BLOCK_M" in cfg else str(cfg))
        try:
            row.update(build(fn, types, consts, cfg, ones))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
            row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        rows.append(row)
        log(f"{name:>18} {row['config']}: "
            + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("kernel", "config")))
    return rows


def _cfg_str(cfg: dict) -> str:
    return "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} g{GROUP_M} w{num_warps} s{num_stages}".format(**cfg)


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
            row = dict(kernel=name, config=_cfg_str(cfg))
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
    """Put the fastest candidates into ``CONFIGS`` (the matmul: the faster on the sum of both GEMMs is not
    tracked separately; dW and dH+= usually agree, dH+= wins ties)."""
    from lab.kernels import fused_cross_entropy_kernels as K

    for kernel, key in (("lse", "lse"), ("dlogits", "dlogits"), ("matmul dH+=", "matmul")):
        if kernel in chosen:
            K.CONFIGS[(key, "16bit")] = dict(chosen[kernel])


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
        table = pd.DataFrame(cands).to_markdown(index=False, floatfmt=".3g")
        out += ["## Kernel candidates at the goal shape", "", table, "",
                f"fastest: { {k: _cfg_str(v) for k, v in chosen.items()} }", ""]
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
    import pandas as pd

    if args.compile_only:
        rows = compile_only(args.compile_only)
        pd.DataFrame(rows).to_csv(out / "compile_only.csv", index=False)
        (out / "log.txt").write_text("\n".join(_LOG) + "\n")
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

    correct = run("correctness", part_correctness) or []
    pd.DataFrame(correct).to_csv(out / "correctness.csv", index=False)
    frames = [run("benchmark goal", lambda: part_benchmark([GOAL]))]
    frames.append(run("benchmark small", lambda: part_benchmark(SMALL)))
    compiled = run("compile", part_compile) or []
    pd.DataFrame(compiled).to_csv(out / "compile.csv", index=False)
    if not args.skip_candidates:
        res = run("candidates", lambda: part_candidates(deadline))
        if res:
            cands, chosen = res
            pd.DataFrame(cands).to_csv(out / "candidates.csv", index=False)
            apply_best(chosen)
            tuned = run("benchmark goal tuned", lambda: part_benchmark([GOAL], ("fused",)))
            if tuned is not None:
                frames.append(tuned.assign(impl="fused (fastest candidates)"))
    frames = [f for f in frames if f is not None]
    bench = pd.concat(frames, ignore_index=True) if frames else None
    if bench is not None:
        from lab.bench.fused_loss import add_ratios

        bench = add_ratios(add_ratios(bench, "torch_compiled"), "torch")
        bench.to_csv(out / "benchmark.csv", index=False)
    text = summary_md(correct, compiled, bench, cands, chosen)
    (out / "summary.md").write_text(text)
    log(f"done in {time.time() - START:.0f} s; files in {out}")
    (out / "log.txt").write_text("\n".join(_LOG) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
