"""FlashAttention on Hopper in Gluon: which inputs the kernels take, what the compiler made of them, and how fast
they run beside cuDNN and the portable Triton kernels.

The kernels themselves: :mod:`lab.kernels.flash_gluon_forward` and :mod:`lab.kernels.flash_gluon_backward`
(FlashAttention-3's schedules). They run
on sm_90 GPUs only; :func:`gluon_supported` says in one line why an input is not theirs, so that a caller falls
back to the portable Triton-language kernels (:mod:`lab.kernels.flash_triton`), which run everywhere.

:func:`forward_compile_report` compiles the forward for ``sm_90a`` on any machine (no GPU needed: ``ptxas``
ships with Triton) and reads its registers, spills, shared memory and warp-group MMAs.

``python -m lab.kernels.flash_gluon`` (on an H100 or H200) checks the kernels on the benchmark shapes against
float64 (the forward on sampled rows, the gradients on one head) and prints, per shape and pass, their time
and TFLOP/s beside SDPA's default backend (cuDNN) and the portable Triton kernels, all timed by
``triton.testing.do_bench`` in the same process.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

from lab.kernels.flash_gluon_backward import BACKWARD_KERNEL, backward_launch, dq_writer_default, gluon_backward
from lab.kernels.flash_gluon_forward import FORWARD_KERNEL, forward_launch, gluon_forward
from lab.kernels.flash_triton_backward import flash_backward
from lab.kernels.flash_triton_forward import flash_forward
from lab.kernels.sm90_compile import call_without_interpreter, disassemble, product_waits, ptxas_path

__all__ = ["SUPPORTED_HEAD_DIMS", "forward_compile_report", "gluon_backward", "gluon_forward", "gluon_supported",
           "input_reason"]

#: Head dimensions the Gluon kernels are built for; others fall back to the portable kernels (d 80 would pay
#: for 48 padded columns of every product here, where the portable kernel splits it into 64 + 16).
SUPPORTED_HEAD_DIMS = (64, 128)
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def input_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """Why the Gluon kernels cannot take these (batch, heads, seq, d) tensors, whatever device they are on;
    None if they can."""
    if any(t.dim() != 4 for t in (q, k, v)):
        return "needs (batch, heads, seq, d) tensors"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return f"needs bf16 or fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS or k.shape[-1] != q.shape[-1] or v.shape != k.shape:
        return f"needs head dimension {' or '.join(map(str, SUPPORTED_HEAD_DIMS))} for q, k and v, got " \
               f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}"
    if q.shape[:2] != k.shape[:2]:
        return f"needs equal batch and heads for q and k/v, got {tuple(q.shape[:2])} and {tuple(k.shape[:2])}"
    if min(q.shape[2], k.shape[2]) < 1:
        return "needs at least one query and one key"
    return None


def gluon_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """None if :func:`gluon_forward` runs on these tensors here; else a one-line reason (the input's, or
    that they are not on an sm_90 GPU)."""
    reason = input_reason(q, k, v, causal)
    if reason is not None:
        return reason
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return f"needs q, k, v on one CUDA device, got {q.device}, {k.device}, {v.device}"
    capability = torch.cuda.get_device_capability(q.device)
    if capability != (9, 0):
        return f"needs an sm_90 GPU (Hopper: wgmma, TMA, setmaxnreg), got sm_{capability[0]}{capability[1]}"
    return None


def _compile_report(kernel, args: tuple, constexprs: dict, num_warps: int, maxnreg: int) -> dict:
    """Compile a Gluon ``kernel`` for ``sm_90a`` with these launch arguments (tensors may live on the CPU: only
    their dtypes, shapes and alignments reach the compiler) and read what ``ptxas -v`` says of it."""
    values = iter(args)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = next(values)
        signature[name] = mangle_type(value)
        if isinstance(value, torch.Tensor):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "maxnreg": maxnreg})
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([str(ptxas_path()), "-v", "-arch=sm_90a", path, "-o", cubin],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas failed on {kernel.__name__}: {(done.stderr or done.stdout).strip()[-500:]}")
        sass = disassemble(cubin)
    text = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(registers[1]) if registers else -1, "spill_bytes": int(spills[1]) if spills else -1,
            "shared_bytes": compiled.metadata.shared, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
            "scalar_conversions": len(re.findall(r"\sF2F\.", sass)),
            **product_waits(ptx)}


def forward_compile_report(d: int = 128, causal: bool = True, dtype: str = "bf16", tiles: dict | None = None) -> dict:
    """Compile the forward for ``sm_90a`` as :func:`gluon_forward` would launch it at head dimension ``d``
    (no GPU needed; run it in a process without ``TRITON_INTERPRET``: :func:`compile_in_subprocess`).
    Returns ``registers`` (the entry cap a thread; partitions then trade registers with ``setmaxnreg``),
    ``spill_bytes``, ``shared_bytes``, ``wgmma`` (warp-group MMA instructions in the PTX), ``setmaxnreg``
    (the register counts the partitions ask for), ``scalar_conversions`` (one-element F2F conversions in the
    SASS, which run on a slow pipe) and :func:`~lab.kernels.sm90_compile.product_waits`'s
    ``products`` and ``waited_at_once``."""
    q = torch.empty(1, 2, 256, d, dtype={name: t for t, name in DTYPES.items()}[dtype])
    _, _, _, args, constexprs, num_warps, maxnreg = forward_launch(q, q, q, causal, tiles)
    return _compile_report(FORWARD_KERNEL, args, constexprs, num_warps, maxnreg)


def backward_compile_report(d: int = 128, causal: bool = True, dtype: str = "bf16") -> dict:
    """:func:`forward_compile_report` for the main backward kernel as :func:`gluon_backward` launches it."""
    q = torch.empty(1, 2, 256, d, dtype={name: t for t, name in DTYPES.items()}[dtype])
    rows, accum = torch.empty(1, 2, 256), torch.empty(1, 2, 256, d)
    _, args, constexprs, num_warps, maxnreg = backward_launch(q, q, q, q, rows, rows, accum, q, q, causal)
    return _compile_report(BACKWARD_KERNEL, args, constexprs, num_warps, maxnreg)


def compile_in_subprocess(kernel: str = "forward", d: int = 128, causal: bool = True, dtype: str = "bf16",
                          timeout_s: float = 300) -> dict:
    """:func:`forward_compile_report` (``kernel="forward"``) or :func:`backward_compile_report` in a fresh
    interpreter without ``TRITON_INTERPRET``."""
    return call_without_interpreter(f"lab.kernels.flash_gluon:{kernel}_compile_report", [d, causal, dtype], timeout_s)


# --- checks and timings on the GPU ---------------------------------------------------------------------------

def reference_rows(q, k, v, causal: bool, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and natural-log logsumexp of query ``rows`` (all batches and heads) in float64:
    (batch, heads, len(rows), d) and (batch, heads, len(rows))."""
    qf, kf, vf = q[:, :, rows].double(), k.double(), v.double()
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        cols = torch.arange(k.shape[2], device=q.device)
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ vf, lse


def forward_errors(q, k, v, causal: bool, out, lse, sample: int = 256) -> dict:
    """Largest absolute errors of ``out`` and ``lse`` against float64 on ``sample`` query rows (the first,
    the last and random ones between), and the output's error relative to the reference's largest value."""
    n_q = q.shape[2]
    generator = torch.Generator(device="cpu").manual_seed(n_q)
    rows = torch.unique(torch.cat([torch.tensor([0, n_q - 1]), torch.randint(0, n_q, (sample,), generator=generator)]))
    rows = rows.to(q.device)
    # at most 8 batch x heads: the reference holds (rows x keys) float64 scores for each
    ref_out, ref_lse = reference_rows(q[:, :8], k[:, :8], v[:, :8], causal, rows)
    got_out, got_lse = out[:, :8, rows].double(), lse[:, :8, rows].double()
    out_err = (got_out - ref_out).abs().max().item()
    return {"out_max_err": out_err, "out_rel_err": out_err / ref_out.abs().max().item(),
            "lse_max_err": (got_lse - ref_lse).abs().max().item()}


def forward_flops(batch: int, heads: int, n: int, d: int, causal: bool) -> float:
    """Matrix-product FLOPs of the forward: ``4 b h n^2 d`` (two products), half of it when causal."""
    return 4 * batch * heads * n * n * d / (2 if causal else 1)


#: The shapes of the comparison: (batch, heads, seq, d, dtype, causal).
BENCH_SHAPES = [
    (1, 32, 32768, 128, torch.bfloat16, True), (1, 16, 16384, 128, torch.bfloat16, True),
    (8, 16, 2048, 128, torch.bfloat16, True), (1, 16, 16384, 64, torch.bfloat16, True),
    (4, 32, 4096, 64, torch.float16, True), (2, 16, 8192, 128, torch.bfloat16, False),
    (2, 32, 4096, 80, torch.bfloat16, True),
]


def reference_head_gradients(q, k, v, grad_out, causal: bool, chunk: int = 2048) -> tuple[torch.Tensor, ...]:
    """float64 (dQ, dK, dV) of batch 0, head 0: (seq, d) each, from the untiled equations (``dS = P (dP -
    D)``) over ``chunk`` query rows at a time, so that long sequences fit in memory."""
    qf, kf, vf, dof = (t[0, 0].double() for t in (q, k, v, grad_out))
    scale = 1 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    keys = torch.arange(kf.shape[0], device=q.device)
    for start in range(0, qf.shape[0], chunk):
        rows = torch.arange(start, min(start + chunk, qf.shape[0]), device=q.device)
        scores = qf[rows] @ kf.T * scale
        if causal:
            scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        dp = dof[rows] @ vf.T
        ds = p * (dp - (dof[rows] * (p @ vf)).sum(-1, keepdim=True))
        dq[rows] = ds @ kf * scale
        dk += ds.T @ qf[rows] * scale
        dv += p.T @ dof[rows]
    return dq, dk, dv


def backward_errors(q, k, v, grad_out, causal: bool, grads) -> dict:
    """Each gradient's largest absolute error on batch 0, head 0 against float64, relative to the reference's
    largest value."""
    references = reference_head_gradients(q, k, v, grad_out, causal)
    return {f"{name}_rel_err": ((got[0, 0].double() - ref).abs().max() / ref.abs().max()).item()
            for name, got, ref in zip(("dq", "dk", "dv"), grads, references)}


def _time(fns: dict, flops: float, rep_ms: int) -> dict:
    row = {}
    for name, fn in fns.items():
        ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / ms / 1e9
    return row


def benchmark_shape(batch, heads, n, d, dtype, causal, rep_ms: int = 200, variants: dict | None = None,
                    backward: bool = True) -> list[dict]:
    """One shape, one row per pass (forward, backward): the Gluon kernels' errors against float64 and the
    median ``do_bench`` time (ms) and TFLOP/s of the Gluon kernels (forward: per variant, name -> tiles
    overrides), of SDPA's default backend and of the portable Triton kernels, timed one after the other on the
    same random inputs. Backward FLOPs are 2.5 times the forward's (five products instead of two)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, generator=generator)
                         for _ in range(4))
    flops = forward_flops(batch, heads, n, d, causal)
    label = {"shape": f"{batch}x{heads}x{n}x{d}", "dtype": DTYPES[dtype], "causal": causal}
    variants = variants or {"gluon": None}
    fwd = {**label, "pass": "fwd"}
    timed = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
             "triton": lambda: flash_forward(q, k, v, causal)}
    reason = gluon_supported(q, k, v, causal)
    if reason is None:
        for name, tiles in variants.items():
            out, lse = gluon_forward(q, k, v, causal, tiles)
            fwd |= {f"{name}_{key}": value for key, value in forward_errors(q, k, v, causal, out, lse).items()}
            timed[name] = lambda tiles=tiles: gluon_forward(q, k, v, causal, tiles)
    else:
        fwd["gluon"] = reason
    rows = [fwd | _time(timed, flops, rep_ms)]
    if backward:
        sdpa_q, sdpa_k, sdpa_v = (t.detach().requires_grad_() for t in (q, k, v))
        sdpa_out = torch.nn.functional.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, is_causal=causal)
        triton_out, triton_lse = flash_forward(q, k, v, causal)
        bwd = {**label, "pass": "bwd"}
        timed = {"sdpa": lambda: torch.autograd.grad(sdpa_out, (sdpa_q, sdpa_k, sdpa_v), grad_out, retain_graph=True),
                 "triton": lambda: flash_backward(q, k, v, triton_out, triton_lse, grad_out, causal)}
        if reason is None:
            out, lse = gluon_forward(q, k, v, causal)
            # with forward variants, the backward's other way of adding dQ too
            options = {"gluon": {}} | ({"other_dq": dict(dq_writer=not dq_writer_default(d))}
                                       if len(variants) > 1 else {})
            for name, option in options.items():
                grads = gluon_backward(q, k, v, out, lse, grad_out, causal, **option)
                bwd |= {f"{name}_{key}": value
                        for key, value in backward_errors(q, k, v, grad_out, causal, grads).items()}
                timed[name] = lambda option=option: gluon_backward(q, k, v, out, lse, grad_out, causal, **option)
        else:
            bwd["gluon"] = reason
        rows.append(bwd | _time(timed, 2.5 * flops, rep_ms))
    for row in rows:
        for name in [*variants, "other_dq"]:
            if f"{name}_ms" in row:
                row[f"{name}_vs_sdpa"] = row["sdpa_ms"] / row[f"{name}_ms"]
    return rows


def compile_shape(batch, heads, n, d, dtype, causal, variants: dict | None = None, backward: bool = True) -> None:
    """Run every kernel :func:`benchmark_shape` times once, untimed, so that their compiles land in Triton's
    cache (one process per shape compiles them side by side)."""
    q, k, v, grad_out = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype) for _ in range(4))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out, lse = flash_forward(q, k, v, causal)
    if backward:
        flash_backward(q, k, v, out, lse, grad_out, causal)
    if gluon_supported(q, k, v, causal) is None:
        for tiles in (variants or {"gluon": None}).values():
            out, lse = gluon_forward(q, k, v, causal, tiles)
        if backward:
            for option in ({}, dict(dq_writer=not dq_writer_default(d))) if variants else ({},):
                gluon_backward(q, k, v, out, lse, grad_out, causal, **option)
    torch.cuda.synchronize()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench's repetition time per kernel (ms)")
    parser.add_argument("--shapes", type=int, nargs="*", help="indices into BENCH_SHAPES (default: all)")
    parser.add_argument("--variants", action="store_true",
                        help="also time the forward without ping-pong and the backward's other way of adding dQ")
    parser.add_argument("--forward-only", action="store_true", help="skip the backward")
    parser.add_argument("--compile-only", action="store_true", help="run each kernel once, untimed, and stop")
    parser.add_argument("--csv", help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    import pandas as pd  # optional dependency: the table

    shapes = [BENCH_SHAPES[i] for i in args.shapes] if args.shapes else BENCH_SHAPES
    variants = {"gluon": None, "no_pingpong": {"PINGPONG": False}} if args.variants else None
    if args.compile_only:
        for shape in shapes:
            compile_shape(*shape, variants=variants, backward=not args.forward_only)
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for shape in shapes:
        for row in benchmark_shape(*shape, rep_ms=args.rep_ms, variants=variants, backward=not args.forward_only):
            rows.append(row)
            print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                           for key, value in row.items()), flush=True)  # kept if a later shape fails
    table = pd.DataFrame(rows)
    if args.csv:
        table.to_csv(args.csv, index=False)
    with pd.option_context("display.width", 250, "display.max_columns", 40, "display.precision", 4):
        print(table.to_string(index=False))


if __name__ == "__main__":
    main()
