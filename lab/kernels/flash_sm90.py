"""The FlashAttention kernels compiled for Hopper (``sm_90a``) on any machine: what Triton's compiler made of
them (registers, spills, shared memory, and how the code waits for its matrix products), from
:func:`lab.kernels.sm90_compile.compile_sm90`.

The compiles run in a child process without ``TRITON_INTERPRET`` (:func:`compile_in_subprocess`, through
:func:`lab.kernels.sm90_compile.call_without_interpreter`): under it ``@triton.jit`` makes interpreted
functions, which do not compile. The tile choices are the tables' (:func:`default_plan`) as they are on a
GPU with a given number of SMs, so a CPU-only machine reports the kernels a GPU would launch.
"""

from __future__ import annotations

import torch

from lab.kernels import flash_config as fc
from lab.kernels.flash_triton_backward import BACKWARD_KERNEL
from lab.kernels.flash_triton_forward import FORWARD_KERNEL
from lab.kernels.sm90_compile import call_without_interpreter, compile_sm90

#: SMs of an H100 SXM (and an H200): the GPU the tile tables are written for.
HOPPER_SMS = 132


def _report(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """Compile ``kernel``; ``types``: the non-constexpr arguments that are not i32 (pointers, floats,
    descriptors); pointers and strides are taken 16-aligned, as for contiguous tensors."""
    signature, divisible = {}, []
    for i, name in enumerate(kernel.arg_names):
        signature[name] = "constexpr" if name in constexprs else types.get(name, "i32")
        if signature[name].startswith("*") or (signature[name] == "i32" and name != "tune_batch"):
            divisible.append(i)
    out = compile_sm90(kernel, signature, constexprs, divisible, num_warps, num_stages)
    return {"shared": out["shared_bytes"], "registers": out["registers"], "spill": out["spill_bytes"],
            "products": out["products"], "waited_at_once": out["waited_at_once"]}


def forward_report(d, causal, tiles, dtype="bf16", scale="fp32", split=False) -> dict:
    """The forward kernel at head dimension ``d`` on ``tiles`` ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``;
    ``split``: two column chunks (``flash_config.split_widths``); ``scale``: the scale's type (Inductor
    passes fp64)."""
    m, n, warps, stages = tiles
    bd, bd1 = fc.split_widths(d) if split else (fc.block_d(d), 0)
    types = {name: f"*{dtype}" for name in ("Q", "K", "V", "O")} | {"L": "*fp32", "qk_scale": scale}
    precision = "tf32x3" if dtype == "fp32" else "tf32"
    constexprs = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_D1=bd1, IS_CAUSAL=causal, PRECISION=precision, BLOCK_M=m, BLOCK_N=n)
    return _report(FORWARD_KERNEL, types, constexprs, warps, stages)


def backward_report(d, causal, tiles, pass_, scale="fp32", split=False) -> dict:
    """One pass of the backward kernel (0 fused, 1 dK/dV, 2 dQ) on ``tiles`` ``(BLOCK_M1, BLOCK_N1, BLOCK_M2,
    BLOCK_N2, num_warps, num_stages)``, bf16."""
    m1, n1, m2, n2, warps, stages = tiles
    bd, bd1 = fc.split_widths(d) if split else (fc.block_d(d), 0)
    types = {name: "*bf16" for name in ("Q", "K", "V", "DO", "DQ", "DK", "DV")}
    types |= {"L": "*fp32", "Delta": "*fp32", "qk_scale": scale, "sm_scale": scale}
    constexprs = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_D1=bd1, IS_CAUSAL=causal, PRECISION="tf32", PASS=pass_,
                      BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2)
    return _report(BACKWARD_KERNEL, types, constexprs, warps, stages)


def default_plan(d: int, dtype: torch.dtype = torch.bfloat16, batch_heads: int = 64, n: int = 4096,
                 causal: bool = True, sms: int = HOPPER_SMS) -> tuple[tuple, str, dict]:
    """The tables' launch of a (``batch_heads``, ``n``, ``n``, ``d``) attention on a GPU of ``sms`` SMs:
    (forward tiles, backward mode, {pass: backward tiles}). ``flash_config.multiprocessor_count`` answers
    ``sms`` meanwhile (the tables ask whether a grid fills the GPU). Compiled launches: a process under the
    interpreter gets the interpreter's tiles."""
    counted = fc.multiprocessor_count
    fc.multiprocessor_count = lambda index: sms
    try:
        cuda = torch.device("cuda", 0)
        t = fc.forward_tiles(batch_heads, n, n, d, dtype, cuda, causal=causal)
        mode, plan = fc.backward_plan(batch_heads, n, n, d, dtype, cuda)
    finally:
        fc.multiprocessor_count = counted
    keys = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_warps", "num_stages")
    return ((t["BLOCK_M"], t["BLOCK_N"], t["num_warps"], t["num_stages"]), mode,
            {p: tuple(plan[p][k] for k in keys) for p in plan})


def default_kernels(d: int, causal: bool = True, n: int = 4096, batch_heads: int = 64,
                    sms: int = HOPPER_SMS) -> list[dict]:
    """One row per kernel the tables launch for a long bf16 attention at head dimension ``d`` (unsplit): the
    forward and each backward pass, their tiles and :func:`forward_report` / :func:`backward_report`."""
    fwd_tiles, mode, bwd_tiles = default_plan(d, torch.bfloat16, batch_heads, n, causal, sms)
    names = {0: "backward (fused)", 1: "backward dK/dV", 2: "backward dQ"}
    rows = [dict(kernel="forward", d=d, tiles="x".join(map(str, fwd_tiles)),
                 **forward_report(d, causal, fwd_tiles))]
    for p in fc.LAUNCHED_PASSES[mode]:  # the plan lists every pass
        rows.append(dict(kernel=names[p], d=d, tiles="x".join(map(str, bwd_tiles[p])),
                         **backward_report(d, causal, bwd_tiles[p], p)))
    return rows


KINDS = {"fwd": forward_report, "bwd": backward_report, "default": default_kernels}


def run_jobs(jobs: list) -> list:
    """Each ``[kind, kwargs]`` of ``jobs`` (kind a key of :data:`KINDS`; lists in kwargs become tuples, as JSON
    carries them), in this process."""
    return [KINDS[kind](**{k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()})
            for kind, kwargs in jobs]


def compile_in_subprocess(jobs: list, timeout_s: float = 600) -> list:
    """:func:`run_jobs` in a fresh interpreter without TRITON_INTERPRET; returns their results in order.
    Raises FileNotFoundError where Triton ships no ptxas."""
    return call_without_interpreter("lab.kernels.flash_sm90:run_jobs", [jobs], timeout_s)
