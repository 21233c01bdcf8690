"""GPU check of lab's FlashAttention-2 Triton kernels: correctness, then speed against PyTorch SDPA.

Run from the repository root on a CUDA machine::

    python3 tools/flash_gpu_check.py [--budget-s 280] [--out DIR] [--skip-pytest]

1. compiles every autotune config of the goal shapes in parallel processes (Triton's on-disk cache then
   serves the main process, so autotuning costs benchmark time only, not serial compile time);
2. for each goal shape (bf16, causal, batch 1): compares the Triton output and gradients with fp32 SDPA
   (and reports SDPA-bf16's own error next to it), then times forward, backward and forward+backward of
   Triton, SDPA (default backend) and SDPA's FlashAttention-2 backend with ``triton.testing.do_bench``
   (median ms), and the backward with each launch mode forced (fused, two-pass);
3. measures host time per call (Triton vs SDPA) and profiles the Triton host path;
4. runs the GPU tests (``pytest tests/test_flash_triton.py tests/test_flash_pytorch.py``) with what is left
   of the time budget.

Writes flash_gpu_check.csv (every row), flash_gpu_check.md (the summary table), autotune.json (timings of
every config) and pytest.log under --out (default: $OUT, else artifacts/flash_gpu_check).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (batch, heads, seq, d): the performance goals of the lab book (bf16, causal)
GOAL_SHAPES = [(1, 1, 8192, 64), (1, 1, 8192, 128), (1, 1, 16384, 64), (1, 1, 16384, 128),
               (1, 16, 16384, 64), (1, 16, 16384, 128)]
START = time.time()


def log(*parts):
    print(f"[{time.time() - START:6.1f}s]", *parts, flush=True)


# ------------------------------------------------------------------------------------ parallel compile
def _compile_task(task):
    """Compile one (kernel, d, pass, config) into Triton's cache. Runs in a worker process."""
    import torch

    import lab.kernels.flash_triton as ft
    import lab.kernels.flash_triton_backward as ftb

    kind, d, pass_, index = task
    n = 8192  # any length divisible by 16 gives the same specialisation as the goal shapes
    t0 = time.time()
    q, k, v, out, do, dq, dk, dv = (torch.empty(1, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(8))
    lse = torch.empty(1, n, device="cuda")
    delta = torch.empty(1, n, device="cuda")
    try:
        if kind == "fwd":
            config = ft._flash_fwd_tuned.configs[index]
            args, meta = ft.forward_launch_args(q, k, v, out, lse, True)
            ft._flash_fwd_kernel.warmup(*args, grid=(1, 1), **meta, **config.all_kwargs())
        else:
            config = ftb._flash_bwd_tuned.configs[index]
            args, meta = ftb.backward_launch_args(q, k, v, do, lse, delta, dq, dk, dv, True)
            ftb._flash_bwd_kernel.warmup(*args, grid=(1, 1), **meta, PASS=pass_, **config.all_kwargs())
        return f"{kind} d={d} pass={pass_} {config}: {time.time() - t0:.1f}s"
    except Exception as exc:  # out of shared memory and the like: the autotuner will skip it too
        return f"{kind} d={d} pass={pass_} config {index}: FAILED {type(exc).__name__}: {str(exc)[:200]}"


def precompile(workers: int):
    import lab.kernels.flash_triton as ft
    import lab.kernels.flash_triton_backward as ftb

    tasks = []
    for d in sorted({s[3] for s in GOAL_SHAPES}):
        tasks += [("fwd", d, None, i) for i in range(len(ft._flash_fwd_tuned.configs))]
        bwd = ftb._prune_bwd_configs(ftb._flash_bwd_tuned.configs, {}, HEAD_DIM=d)
        indices = [ftb._flash_bwd_tuned.configs.index(c) for c in bwd]
        tasks += [("bwd", d, p, i) for p in (0, 1, 2) for i in indices]
    # biggest (backward) compiles first
    tasks.sort(key=lambda t: t[0] != "bwd")
    log(f"precompiling {len(tasks)} kernel variants in {workers} processes")
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(_compile_task, tasks):
            log("  ", line)


# -------------------------------------------------------------------------------------------- benchmark
def attention_flops(batch_heads, n, d, causal, mode):
    fwd = 4 * batch_heads * n * n * d * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "e2e": 3.5 * fwd}[mode]


def bench_shape(b, h, n, d, rows, autotune_log):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench, do_bench_cudagraph

    import lab.kernels.flash_triton as ft
    import lab.kernels.flash_triton_backward as ftb

    gen = torch.Generator(device="cuda").manual_seed(0)
    q32, k32, v32, g32 = (torch.randn(b * h, n, d, device="cuda", generator=gen) for _ in range(4))
    q, k, v, g = (t.to(torch.bfloat16) for t in (q32, k32, v32, g32))

    def bhsd(t):
        return t.view(b, h, n, d)

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(bhsd(q_), bhsd(k_), bhsd(v_), is_causal=True).view(b * h, n, d)

    def sdpa_flash(q_, k_, v_):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q_, k_, v_)

    def triton_fused(q_, k_, v_):
        return ft.FlashAttentionTriton.apply(q_, k_, v_, True)

    # ---- correctness against fp32 SDPA
    ref_in = [t.clone().requires_grad_() for t in (q32, k32, v32)]
    ref = sdpa(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, g32)
    errors = {}
    for name, fn in (("triton", triton_fused), ("sdpa", sdpa)):
        inp = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*inp)
        grads = torch.autograd.grad(out, inp, g)
        errs = [(out.float() - ref).abs().max().item() / ref.abs().max().item()]
        errs += [(a.float() - r).abs().max().item() / r.abs().max().item() for a, r in zip(grads, ref_grads)]
        errors[name] = errs
        log(f"  rel. max error vs fp32 SDPA [o, dq, dk, dv] {name}: " + ", ".join(f"{e:.2e}" for e in errs))
        if name == "triton":
            # The kernels have no atomics, so later calls must reproduce the first bit for bit. The first
            # call tunes, the second keeps the compiled kernels, the third uses the fast launch path.
            for _ in range(2):
                out2 = fn(*inp)
                grads2 = torch.autograd.grad(out2, inp, g)
            same = torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
            errors["repeat_identical"] = same
            log(f"  third call bitwise identical to the first (fast launch path): {same}")
            if not same:
                raise AssertionError("Triton results changed between two identical calls")
    del ref_in, ref, ref_grads

    impls = [("triton", triton_fused), ("sdpa", sdpa), ("sdpa_flash2", sdpa_flash)]
    for impl, fn in impls:
        try:
            inp = [t.clone().requires_grad_() for t in (q, k, v)]
            fwd_ms = do_bench(lambda: fn(q, k, v), return_mode="median")
            out = fn(*inp)
            bwd_ms = do_bench(lambda: torch.autograd.grad(out, inp, g, retain_graph=True), return_mode="median")
            e2e_ms = do_bench(lambda: torch.autograd.grad(fn(*inp), inp, g), return_mode="median")
            status = "ok"
        except Exception as exc:
            log(f"  {impl} failed: {type(exc).__name__}: {exc}")
            fwd_ms = bwd_ms = e2e_ms = float("nan")
            status = "error"
        row = dict(impl=impl, batch=b, heads=h, seq_len=n, d=d, dtype="bf16", causal=True, status=status,
                   fwd_ms=fwd_ms, bwd_ms=bwd_ms, e2e_ms=e2e_ms,
                   fwd_tflops=attention_flops(b * h, n, d, True, "fwd") / fwd_ms / 1e9,
                   bwd_tflops=attention_flops(b * h, n, d, True, "bwd") / bwd_ms / 1e9,
                   rel_err=max(errors.get(impl, [float("nan")])))
        rows.append(row)
        log(f"  {impl:12s} fwd {fwd_ms:7.3f} ms  bwd {bwd_ms:7.3f} ms  e2e {e2e_ms:7.3f} ms")
    for key, config in ft.TUNED_CONFIGS.items():
        if key[1] == n and key[3] == ft.tune_batch(b * h) and key[4] == d and str(key) not in autotune_log:
            autotune_log[str(key)] = {"best": config, "timings_ms": ft.TUNING_TIMINGS.get(key, {})}
            log(f"    tuned {key[0]} pass={key[-1] if key[0] == 'bwd' else '-'}: {config}")

    # GPU time alone (no host overhead, warm L2): the same calls replayed from a CUDA graph
    for impl, fn in impls[:2]:
        try:
            inp = [t.clone().requires_grad_() for t in (q, k, v)]
            graph_fwd = do_bench_cudagraph(lambda: fn(q, k, v), return_mode="median")
            graph_e2e = do_bench_cudagraph(lambda: torch.autograd.grad(fn(*inp), inp, g), return_mode="median")
        except Exception as exc:
            log(f"  cuda-graph timing of {impl} failed: {type(exc).__name__}: {str(exc)[:200]}")
            graph_fwd = graph_e2e = float("nan")
        row = next(r for r in rows if r["impl"] == impl and (r["heads"], r["seq_len"], r["d"]) == (h, n, d))
        row["graph_fwd_ms"], row["graph_e2e_ms"] = graph_fwd, graph_e2e
        log(f"  {impl:12s} CUDA graph: fwd {graph_fwd:7.3f} ms  e2e {graph_e2e:7.3f} ms")

    for mode in ("fused", "two_pass"):
        ftb.BACKWARD_LAUNCH = mode
        try:
            inp = [t.clone().requires_grad_() for t in (q, k, v)]
            out = triton_fused(*inp)
            bwd_ms = do_bench(lambda: torch.autograd.grad(out, inp, g, retain_graph=True), return_mode="median")
            rows.append({"impl": f"triton_{mode}", "batch": b, "heads": h, "seq_len": n, "d": d, "dtype": "bf16",
                         "causal": True, "status": "ok", "fwd_ms": float("nan"), "bwd_ms": bwd_ms,
                         "e2e_ms": float("nan"), "fwd_tflops": float("nan"),
                         "bwd_tflops": attention_flops(b * h, n, d, True, "bwd") / bwd_ms / 1e9,
                         "rel_err": float("nan")})
            log(f"  triton backward forced {mode}: {bwd_ms:7.3f} ms")
        finally:
            ftb.BACKWARD_LAUNCH = "auto"
    choice = ft.TUNED_CONFIGS.get(("bwd-launch", n, n, ft.tune_batch(b * h), d, True, "tf32", torch.bfloat16))
    log(f"  auto launch choice: {choice} {ft.TUNING_TIMINGS.get(('bwd-launch', n, n, ft.tune_batch(b * h), d, True, 'tf32', torch.bfloat16))}")


def profile_e2e(n=2048, d=64, iters=200):
    """cProfile of Triton forward+backward calls with the backward on the calling thread: where the host
    time goes. Returns the top of the profile as text."""
    import cProfile
    import io
    import pstats

    import torch

    import lab.kernels.flash_triton as ft

    gen = torch.Generator(device="cuda").manual_seed(0)
    inp = [torch.randn(1, n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
           for _ in range(3)]
    g = torch.randn(1, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)

    def e2e():
        torch.autograd.grad(ft.FlashAttentionTriton.apply(*inp, True), inp, g)

    result = {}
    for threaded in (True, False):
        torch.autograd.set_multithreading_enabled(threaded)
        e2e()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            e2e()
        result[f"host_us_multithreading_{threaded}"] = (time.perf_counter() - t0) / iters * 1e6
        torch.cuda.synchronize()
        log(f"  triton e2e host time, autograd multithreading={threaded}: "
            f"{result[f'host_us_multithreading_{threaded}']:.1f} us/call")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        e2e()
    profiler.disable()
    torch.cuda.synchronize()
    torch.autograd.set_multithreading_enabled(True)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    result["profile"] = text.getvalue()
    return result


def host_overhead(n=2048, d=64, iters=300):
    """Host time per call (us) of Triton vs SDPA at a shape whose GPU time is small: the rate at which
    the CPU can enqueue forward, backward and forward+backward calls."""
    import torch
    import torch.nn.functional as F

    import lab.kernels.flash_triton as ft

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(1, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    inp = [t.clone().requires_grad_() for t in (q, k, v)]

    def tri(q_, k_, v_):
        return ft.FlashAttentionTriton.apply(q_, k_, v_, True)

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(q_[None], k_[None], v_[None], is_causal=True)[0]

    result = {}
    for impl, fn in (("triton", tri), ("sdpa", sdpa)):
        out = fn(*inp)
        calls = {"fwd": lambda: fn(q, k, v),
                 "bwd": lambda: torch.autograd.grad(out, inp, g, retain_graph=True),
                 "e2e": lambda: torch.autograd.grad(fn(*inp), inp, g)}
        for mode, call in calls.items():
            call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            result[f"{impl}_{mode}"] = {"host_us": (t1 - t0) / iters * 1e6, "wall_us": (t2 - t0) / iters * 1e6}
            log(f"  host {impl:6s} {mode}: {result[f'{impl}_{mode}']['host_us']:6.1f} us/call enqueued, "
                f"{result[f'{impl}_{mode}']['wall_us']:6.1f} us/call until done")
    return result


def summary_table(rows):
    import pandas as pd

    df = pd.DataFrame(rows)
    out = []
    for (b, h, n, d), grp in df.groupby(["batch", "heads", "seq_len", "d"], sort=False):
        t = grp.set_index("impl")
        if "triton" not in t.index or "sdpa" not in t.index:
            continue
        tr, sd = t.loc["triton"], t.loc["sdpa"]
        line = dict(shape=f"b{b} h{h} n{n} d{d}", tri_fwd=tr.fwd_ms, sdpa_fwd=sd.fwd_ms,
                    fwd_speed=sd.fwd_ms / tr.fwd_ms, tri_bwd=tr.bwd_ms, sdpa_bwd=sd.bwd_ms,
                    bwd_speed=sd.bwd_ms / tr.bwd_ms, tri_e2e=tr.e2e_ms, sdpa_e2e=sd.e2e_ms,
                    e2e_speed=sd.e2e_ms / tr.e2e_ms, tri_fwd_tflops=tr.fwd_tflops,
                    tri_bwd_tflops=tr.bwd_tflops, err=tr.rel_err)
        line["tri_graph_e2e"] = tr.get("graph_e2e_ms", float("nan"))
        line["sdpa_graph_e2e"] = sd.get("graph_e2e_ms", float("nan"))
        for mode in ("fused", "two_pass"):
            if f"triton_{mode}" in t.index:
                line[f"{mode}_bwd"] = t.loc[f"triton_{mode}"].bwd_ms
        out.append(line)
    return pd.DataFrame(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=280.0, help="stop starting new work after this")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "artifacts" / "flash_gpu_check"))
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    parser.add_argument("--skip-pytest", action="store_true")
    parser.add_argument("--pytest-args", default="", help="selection passed to pytest, e.g. '-m gpu'")
    parser.add_argument("--shapes", default="", help="comma-separated indices into GOAL_SHAPES (default all)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("flash_gpu_check needs a CUDA GPU")
    log(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"CUDA {torch.version.cuda}")

    try:
        precompile(args.workers)
    except Exception as exc:
        log(f"parallel precompile failed ({type(exc).__name__}: {exc}); autotuning will compile serially")

    shapes = GOAL_SHAPES if not args.shapes else [GOAL_SHAPES[int(i)] for i in args.shapes.split(",")]
    rows, autotune_log = [], {}
    for shape in shapes:
        if time.time() - START > args.budget_s * 0.7:
            log(f"skipping {shape}: time budget")
            continue
        log(f"shape (batch, heads, seq, d) = {shape}")
        try:
            bench_shape(*shape, rows, autotune_log)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            log(f"  shape {shape} FAILED: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()

    overhead = {}
    try:
        log("host overhead at b1 h1 n2048 d64 (bf16, causal)")
        overhead = host_overhead()
    except Exception as exc:
        log(f"host overhead measurement failed: {type(exc).__name__}: {exc}")

    profile = {}
    try:
        log("host-time profile of Triton e2e at b1 h1 n2048 d64")
        profile = profile_e2e()
        print("\n".join(profile["profile"].splitlines()[:45]))
    except Exception as exc:
        log(f"profile failed: {type(exc).__name__}: {exc}")
    overhead["profile"] = profile

    import pandas as pd

    pd.DataFrame(rows).to_csv(out_dir / "flash_gpu_check.csv", index=False)
    (out_dir / "autotune.json").write_text(json.dumps({"tuned": autotune_log, "host_overhead": overhead},
                                                      indent=1, default=str))
    table = summary_table(rows)
    text = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
            "bf16, causal; times in ms (do_bench median); speed = SDPA time / Triton time\n\n")
    text += table.to_markdown(index=False, floatfmt=".3f") if len(table) else "(no rows)"
    (out_dir / "flash_gpu_check.md").write_text(text)

    if not args.skip_pytest:
        left = args.budget_s - (time.time() - START)
        if left > 30:
            log(f"running the GPU tests ({left:.0f}s left)")
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(args.pytest_args),
                   "tests/test_flash_triton.py", "tests/test_flash_pytorch.py"]
            try:
                res = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=left - 5)
                output = res.stdout + res.stderr
            except subprocess.TimeoutExpired as exc:
                output = f"TIMEOUT after {left - 5:.0f}s\n" + (exc.stdout or b"").decode(errors="replace")
            (out_dir / "pytest.log").write_text(output)
            print("\n".join(output.strip().splitlines()[-25:]))
        else:
            log("no time left for the GPU tests")

    print()
    print(text)
    log("done")


if __name__ == "__main__":
    main()
