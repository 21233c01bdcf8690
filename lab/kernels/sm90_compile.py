"""Compile a Triton kernel for Hopper (``sm_90a``) on any machine, GPU or not, and read what ``ptxas`` says
about it: registers and spilled bytes a thread, shared memory a block, whether it uses wgmma.

The interpreter checks what the kernels compute, not whether Triton's GPU compiler accepts them or how they
fit an SM. ``triton.compile`` takes a ``GPUTarget`` without a device, and Triton's wheel ships ``ptxas``.
Run it in a process without ``TRITON_INTERPRET`` (under it, ``@triton.jit`` makes interpreted functions).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path


def ptxas_path() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_sm90(kernel, signature: dict, constexprs: dict, divisible: Iterable[int], num_warps: int,
                 num_stages: int, arch: int = 90) -> dict:
    """Compile ``kernel`` (a ``@triton.jit`` function) for ``sm_<arch>a``. ``signature``: argument -> Triton
    type (``"*bf16"``, ``"i32"``, ``"constexpr"``, ...); ``constexprs``: their values; ``divisible``: indices
    of the arguments the JIT would mark 16-byte aligned / divisible by 16. Returns ``registers``,
    ``spill_bytes`` (-1 where ptxas does not say), ``shared_bytes`` and ``wgmma``. Raises FileNotFoundError
    when this Triton build ships no ptxas."""
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
                                capture_output=True, text=True, check=True)
    text = report.stdout + report.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs[1]) if regs else -1, "spill_bytes": int(spills[1]) if spills else -1,
            "shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"]}
