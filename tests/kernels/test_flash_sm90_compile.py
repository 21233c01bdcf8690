"""The Triton FlashAttention kernels compiled for Hopper (sm_90a) on a machine without a GPU.

The interpreter checks what the kernels compute but not whether Triton's GPU compiler accepts them: a
kernel can be right under TRITON_INTERPRET=1 and still fail to compile, or need more shared memory than
an SM has, or spill registers. Triton compiles for any target without a device (``triton.compile`` with
a ``GPUTarget``), and its wheel ships ``ptxas``, whose ``-v`` report gives registers and spills. The
compiles run in a subprocess without TRITON_INTERPRET (under it, ``@triton.jit`` makes interpreted
functions, which do not compile); shapes stay few, each compile takes a few seconds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
fc = pytest.importorskip("lab.kernels.flash_config")
fwd = pytest.importorskip("lab.kernels.flash_triton_forward")
bwd = pytest.importorskip("lab.kernels.flash_triton_backward")
from lab.kernels.sm90_compile import compile_sm90 as compile_for_hopper  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    CUDABackend(GPUTarget("cuda", 90, 32))
except Exception as exc:  # a Triton without the NVIDIA backend
    pytest.skip(f"no Triton CUDA backend here ({exc})", allow_module_level=True)

MAX_SHARED = 232448  # bytes of shared memory a block may use on an H100/H200 (227 KB)


def compile_sm90(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile ``kernel`` for sm_90a: ``types`` gives the non-constexpr arguments that are not i32 (pointers,
    floats, descriptors). Returns shared memory bytes, registers and spill bytes a thread."""
    signature, divisible = {}, []
    for i, name in enumerate(kernel.arg_names):
        signature[name] = "constexpr" if name in constexprs else types.get(name, "i32")
        if signature[name].startswith("*") or (signature[name] == "i32" and name != "tune_batch"):
            divisible.append(i)  # pointers and strides 16-aligned, as for contiguous tensors
    try:
        out = compile_for_hopper(kernel, signature, constexprs, divisible, num_warps, num_stages)
    except FileNotFoundError:
        pytest.skip("Triton's bundled ptxas is missing")
    return {"shared": out["shared_bytes"], "registers": out["registers"], "spill": out["spill_bytes"]}


def forward(d, causal, tiles, tma=False, dtype="bf16", scale="fp32", split=False, overlap=False):
    m, n, warps, stages = tiles
    bd, bd1 = fc.split_widths(d) if split else (fc.block_d(d), 0)
    types = {name: f"*{dtype}" for name in ("Q", "K", "V", "O")} | {"L": "*fp32", "qk_scale": scale}
    if tma:
        types["K"] = types["V"] = f"tensordesc<{dtype}[{n},{bd}]>"
    precision = "tf32x3" if dtype == "fp32" else "tf32"
    constexprs = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_D1=bd1, IS_CAUSAL=causal, PRECISION=precision,
                      WARP_SPECIALIZE=False, OVERLAP=overlap, BLOCK_M=m, BLOCK_N=n)
    return compile_sm90(fwd._flash_fwd_kernel, types, constexprs, warps, stages)


def backward(d, causal, tiles, pass_, atomic=False, delta_from_o=False, store_delta=False, tma=False,
             atomic_tma=False, scale="fp32", split=False):
    m1, n1, m2, n2, warps, stages = tiles
    bd, bd1 = fc.split_widths(d) if split else (fc.block_d(d), 0)
    types = {name: "*bf16" for name in ("Q", "K", "V", "O", "DO", "DK", "DV", "Q_S", "DO_S", "K_S", "V_S")}
    types |= {"L": "*fp32", "Delta": "*fp32", "DQ": "*fp32" if atomic else "*bf16", "qk_scale": scale,
              "sm_scale": scale}
    types["DQ_ACC"] = f"tensordesc<fp32[1,{m1},{bd}]>" if atomic_tma else types["DQ"]
    if tma:
        types["Q_S"] = types["DO_S"] = f"tensordesc<bf16[{m1},{bd}]>"
        types["K_S"] = types["V_S"] = f"tensordesc<bf16[{n2},{bd}]>"
    constexprs = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_D1=bd1, IS_CAUSAL=causal, PRECISION="tf32", PASS=pass_,
                      ATOMIC_DQ=atomic, DELTA_FROM_O=delta_from_o, STORE_DELTA=store_delta,
                      BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2)
    return compile_sm90(bwd._flash_bwd_kernel, types, constexprs, warps, stages)


def table(monkeypatch, d, dtype, batch_heads=64, n=4096):
    """The tile tables as they are on an H100 (132 SMs), for a long sequence whose heads fill the GPU."""
    monkeypatch.setattr(fc, "INTERPRET", False)
    monkeypatch.setattr(fc, "multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    t = fc.forward_tiles(batch_heads, n, n, d, dtype, cuda)
    mode, plan = fc.backward_plan(batch_heads, n, n, d, dtype, cuda)
    tiles = {p: tuple(plan[p][k] for k in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages"))
             for p in plan}
    return (t["BLOCK_M"], t["BLOCK_N"], t["num_warps"], t["num_stages"]), mode, tiles


def compile_in_subprocess(jobs: list) -> list:
    """Run ``jobs`` ([kind, kwargs] for :func:`forward` / :func:`backward`) in a fresh interpreter without
    TRITON_INTERPRET; returns their reports in order."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled, not interpreted (import lab would set 1)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "tests.kernels.test_flash_sm90_compile", json.dumps(jobs)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 80])
def test_default_bf16_kernels_compile_for_hopper(monkeypatch, d):
    """The defaults for long bf16 sequences (at d = 80 the split head dimension, 64 + 16 columns) fit in
    shared memory and spill nothing. (At d = 128 the dK/dV kernel on 64 x 128 tiles, 8 warps, spills a few
    bytes a thread, as the padded d = 80 kernel did; the sweep measured it fastest anyway.)"""
    fwd_tiles, mode, bwd_tiles = table(monkeypatch, d, torch.bfloat16)
    split = fc.head_chunks(d, torch.bfloat16, "bwd", 4096, 4096)[1] > 0
    assert mode == "two_pass" and split == (d == 80)
    reports = compile_in_subprocess([["fwd", dict(d=d, causal=True, tiles=fwd_tiles, split=split)]] +
                                    [["bwd", dict(d=d, causal=True, tiles=bwd_tiles[p], pass_=p, split=split)]
                                     for p in (1, 2)])
    assert all(r["shared"] <= MAX_SHARED and r["spill"] == 0 for r in reports), reports


@pytest.mark.slow
def test_variants_and_fp32_compile_for_hopper(monkeypatch):
    """Atomic dQ with D computed in the kernel, atomic dQ as TMA bulk reductions, and TMA descriptors in both
    directions compile for sm_90a without spills at d = 64 (the interpreter cannot tell: it emulates
    descriptors and atomics, and has no bulk reduction at all); the fp32
    forward table at d = 128, sized for 3xTF32 (each operand split in two TF32 halves), does not spill
    either (larger tiles spill hundreds of bytes)."""
    fp32_tiles, _, _ = table(monkeypatch, 128, torch.float32)
    reports = compile_in_subprocess([
        ["fwd", dict(d=64, causal=True, tiles=(128, 64, 8, 3), tma=True)],
        ["bwd", dict(d=64, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=1, atomic=True, delta_from_o=True)],
        ["bwd", dict(d=64, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=1, atomic=True, atomic_tma=True)],
        ["bwd", dict(d=64, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=2, delta_from_o=True, store_delta=True,
                     tma=True)],
        ["fwd", dict(d=128, causal=True, tiles=fp32_tiles, dtype="fp32")]])
    assert all(r["shared"] <= MAX_SHARED and r["spill"] == 0 for r in reports), reports


@pytest.mark.slow
def test_kernels_compile_with_fp64_scales_as_inductor_passes_them():
    """Inductor types a Python float argument of a kernel it launches as fp64 (``FlashConfig.compile_inline``
    hands it these kernels); the kernels turn their scales into fp32 first, so an fp64 scale neither turns
    the softmax into fp64 (which ``tl.dot``'s fp32 accumulator refuses) nor costs fp64 arithmetic: the
    forward and every backward pass compile for sm_90a with the same shared memory as with fp32 scales."""
    jobs = [["fwd", dict(d=80, causal=True, tiles=(64, 64, 4, 3))],
            ["bwd", dict(d=80, causal=True, tiles=(32, 64, 64, 32, 4, 2), pass_=0)],
            ["bwd", dict(d=80, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=1)],
            ["bwd", dict(d=80, causal=True, tiles=(64, 128, 128, 64, 8, 3), pass_=2)]]
    fp32 = compile_in_subprocess(jobs)
    fp64 = compile_in_subprocess([[kind, {**kwargs, "scale": "fp64"}] for kind, kwargs in jobs])
    assert [r["shared"] for r in fp64] == [r["shared"] for r in fp32], (fp64, fp32)


if __name__ == "__main__":  # the subprocess of compile_in_subprocess
    kinds = {"fwd": forward, "bwd": backward}
    print(json.dumps([kinds[kind](**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})
                      for kind, kwargs in json.loads(sys.argv[1])]))
