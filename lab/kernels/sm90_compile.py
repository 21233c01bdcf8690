"""Compile a Triton kernel for Hopper (``sm_90a``) on any machine, GPU or not, and read what ``ptxas`` says
about it: registers and spilled bytes a thread, shared memory a block, whether it uses wgmma, and how its code
waits for its warp-group matrix products (:func:`product_waits`).

The interpreter checks what the kernels compute, not whether Triton's GPU compiler accepts them or how they
fit an SM. ``triton.compile`` takes a ``GPUTarget`` without a device, and Triton's wheel ships ``ptxas``
(:func:`ptxas_path`: the report's ptxas is the one Triton compiled with).
Run it in a process without ``TRITON_INTERPRET`` (under it, ``@triton.jit`` makes interpreted functions).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path


def ptxas_path() -> Path:
    """The ptxas Triton compiles with, which is the one that can read the PTX it writes: ``$TRITON_PTXAS_PATH``
    where that names one (Inductor points it at torch's own ptxas once it compiles anything; Triton then writes
    PTX of that ptxas's version, which an older ptxas rejects), else the one Triton's wheel ships."""
    import triton
    from triton import knobs

    try:
        return Path(knobs.nvidia.ptxas.path)
    except RuntimeError:  # no ptxas that runs, at either place
        return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def disassemble(cubin: str | Path) -> str:
    """The SASS of a cubin, by the nvdisasm beside :func:`ptxas_path`'s ptxas, else the one Triton's wheel ships
    (``$TRITON_PTXAS_PATH`` may name a ptxas with none beside it, torch's for one). FileNotFoundError where
    there is neither."""
    import triton

    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    nvdisasm = next((p for p in (ptxas_path().with_name("nvdisasm"), shipped) if p.exists()), None)
    if nvdisasm is None:
        raise FileNotFoundError(f"No such file: {shipped} (no nvdisasm to read the SASS with)")
    done = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout


_CHILD = ("import importlib, json, sys; module, name = sys.argv[1].split(':'); "
          "print(json.dumps(getattr(importlib.import_module(module), name)(*json.loads(sys.argv[2]))))")


def call_without_interpreter(target: str, args: list = (), timeout_s: float = 600):
    """``module:function`` called with ``args`` (JSON in, JSON out) in a fresh interpreter without
    ``TRITON_INTERPRET``, where ``@triton.jit`` functions compile (on a machine without a GPU the caller's
    entry point has usually turned the interpreter on, :func:`lab.use_triton_interpreter`). Raises
    FileNotFoundError where Triton ships no ptxas, RuntimeError with the child's error otherwise."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _CHILD, target, json.dumps(list(args))], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        if "ships no ptxas" in done.stderr:
            raise FileNotFoundError(done.stderr.strip().splitlines()[-1])
        raise RuntimeError(f"{target} failed without the interpreter: {done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_sm90(kernel, signature: dict, constexprs: dict, divisible: Iterable[int], num_warps: int,
                 num_stages: int, arch: int = 90) -> dict:
    """Compile ``kernel`` (a ``@triton.jit`` function) for ``sm_<arch>a``. ``signature``: argument -> Triton
    type (``"*bf16"``, ``"i32"``, ``"constexpr"``, ...); ``constexprs``: their values; ``divisible``: indices
    of the arguments the JIT would mark 16-byte aligned / divisible by 16. Returns ``registers``,
    ``spill_bytes`` (-1 where ptxas does not say), ``shared_bytes``, ``wgmma`` and :func:`product_waits`'
    ``products`` and ``waited_at_once``. Raises FileNotFoundError when this Triton build ships no ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = ptxas_path()
    if not ptxas.exists():
        raise FileNotFoundError(f"No such file: {ptxas} (this Triton build ships no ptxas)")
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        Path(path).write_text(compiled.asm["ptx"])
        report = subprocess.run([str(ptxas), "-v", f"-arch=sm_{arch}a", path, "-o", os.devnull],
                                capture_output=True, text=True)
    if report.returncode != 0:
        said = (report.stderr or report.stdout).strip().splitlines()
        raise RuntimeError(f"{ptxas} -arch=sm_{arch}a exited {report.returncode}: {said[-1] if said else 'no message'}")
    text = report.stdout + report.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs[1]) if regs else -1, "spill_bytes": int(spills[1]) if spills else -1,
            "shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"],
            **product_waits(compiled.asm["ptx"])}


_PTX_EVENT = re.compile(r"wgmma\.(mma_async|commit_group|wait_group)[.\w]*\s*(\d*)|(ex2)\.approx")


def product_waits(ptx: str) -> dict:
    """How compiled code waits for its warp-group matrix products (Hopper's asynchronous ``wgmma``), read from
    the PTX in text order: ``products``, the commit groups (one per ``tl.dot`` in the code, loops counted
    once), and ``waited_at_once``, the groups whose retiring ``wgmma.wait_group`` comes before any other
    product or exponential (``ex2``) is issued. Such a product keeps its warp group waiting until it is
    done: nothing of that warp group overlaps it (FlashAttention-3 overlaps a tile's softmax with the next
    tile's products). A wait at the top of a loop body counts for the groups committed before it in the
    text."""
    open_groups: list[bool] = []  # per committed, unretired group: did something overlap it yet?
    products = waited = 0
    for match in _PTX_EVENT.finditer(ptx):
        kind, pending = match.group(1), match.group(2)
        if kind == "commit_group":
            open_groups.append(False)
            products += 1
        elif kind == "wait_group":
            keep = int(pending or 0)
            retired, open_groups = (open_groups[:len(open_groups) - keep], open_groups[len(open_groups) - keep:]) \
                if keep else (open_groups, [])
            waited += sum(not busy for busy in retired)
        else:  # a product's instruction or an exponential issued while the open groups run
            open_groups = [True] * len(open_groups)
    return {"products": products, "waited_at_once": waited}
