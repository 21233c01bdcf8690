"""The systems lab book: measure where a Transformer's training time and memory go.

Public names are imported lazily so that ``import lab`` works on a machine without Triton or a GPU. Importing
``lab`` from your own code changes nothing in the environment: on a machine without a GPU,
:func:`use_triton_interpreter` switches Triton to its interpreter when asked. The book's entry points ask: a
command of lab's own (``python -m lab...``, also as a torchrun rank) as it starts, before its modules import
Triton, and says so when it ends (:func:`lab.cli.run`); the render, each notebook's first cell, the test suite.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

__version__ = "0.1.0"

#: The one line :func:`use_triton_interpreter` says when it turns the interpreter on.
INTERPRETER_NOTICE = ("lab: no CUDA GPU, so Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1): slowly, "
                      "and their times say nothing about a GPU")


def use_triton_interpreter(announce: bool = True, this_process: bool = True) -> bool:
    """Run Triton kernels in Triton's interpreter in this process and the processes it starts, if this machine
    has no CUDA GPU and ``TRITON_INTERPRET`` is not set already (the user's setting always stands).

    Triton compiles for GPUs only; without one, its interpreter runs the book's kernels on the CPU (slowly: the
    tests, the quick book and the command lines on a CPU). The entry points ask for it (``lab.cli.run``, the
    render, each notebook's first cell, the test suite); ``import lab`` alone changes nothing. Triton reads the
    switch when it is first imported (its own library functions, ``tl.max`` and ``tl.sum`` among them, are
    defined then), so call this before anything imports Triton (``torch.compile``'s machinery does).

    Prints :data:`INTERPRETER_NOTICE` once on stderr when it turns the interpreter on (``announce``). Returns
    True when Triton runs interpreted from here on. Raises RuntimeError if the interpreter is needed but
    Triton was already imported without it (a restart, with this call first, is the way out), unless
    ``this_process`` is False: then only the processes started from here on need it (a launcher's parent).
    """
    current = os.environ.get("TRITON_INTERPRET")
    if current is not None:
        return current.strip().lower() in ("1", "true", "on", "yes")
    if torch.cuda.is_available():
        return False
    if this_process and "triton" in sys.modules:
        raise RuntimeError("Triton was imported before lab.use_triton_interpreter() and there is no CUDA GPU: "
                           "call it first (or start Python with TRITON_INTERPRET=1)")
    os.environ["TRITON_INTERPRET"] = "1"
    if announce:
        print(INTERPRETER_NOTICE, file=sys.stderr, flush=True)
    return True


def running_a_lab_command(argv: list[str] | None = None) -> bool:
    """Whether this process is one of lab's command lines: ``python -m lab`` or ``python -m lab.<module>``."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1].split(".")[0] == "lab" for i, a in enumerate(argv))


#: True when this process is a lab command that turned the interpreter on as it started (said when it ends).
COMMAND_INTERPRETED = running_a_lab_command() and use_triton_interpreter(announce=False, this_process=False)

# public name -> module that defines it
_LAZY = {
    "TransformerLM": "lab.model.transformer",
    "ModelConfig": "lab.model.transformer",
    "MODEL_SIZES": "lab.model.transformer",
    "FlashAttentionPytorch": "lab.kernels.flash_pytorch",
    "FlashAttentionTriton": "lab.kernels.flash_triton",
    "NaiveDDP": "lab.parallel.ddp",
    "FlatDDP": "lab.parallel.ddp",
    "DDPIndividualParameters": "lab.parallel.ddp",
    "DDPBucketed": "lab.parallel.ddp",
    "ShardedOptimizer": "lab.parallel.sharded_optimizer",
    "FSDP": "lab.parallel.fsdp",
    "ZeRO1Optimizer": "lab.parallel.zero1",
    "fused_linear_cross_entropy": "lab.kernels.fused_cross_entropy",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lab' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
