"""Activation checkpointing per transformer block, applied from outside the model: what a block saves for
backward and what its backward recomputes (the fastest step's ``checkpoint`` choice,
:mod:`lab.recipes.fastest_step`).

Non-reentrant ``torch.utils.checkpoint`` around the whole block (``block``), or selective checkpointing that
keeps some ops' outputs: the attention op's (``save_attention``), and those plus the matmul outputs of the two
projections that write back to the residual stream (``save_outputs``).
"""

from __future__ import annotations

import functools
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@functools.cache
def saved_ops() -> frozenset:
    """The attention operators whose outputs ``save_attention`` keeps (every attention implementation of
    the registry that runs as one op); looked up once, not at every block's forward."""
    ops = set()
    aten = torch.ops.aten
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    try:
        # registers torch.ops.lab.* (Triton is an optional dependency)
        import lab.kernels.flash_triton  # noqa: F401

        ops.add(torch.ops.lab.flash_attention_forward.default)
        # what the op decomposes into where its launches cannot be traced (compiled, in the interpreter)
        ops.add(torch.ops.lab.flash_attention_forward_opaque.default)
    except (ImportError, AttributeError):
        pass
    return frozenset(ops)


#: The submodules whose matmul outputs ``save_outputs`` keeps besides the attention's: the two projections
#: that write back to the residual stream.
SAVED_PROJECTIONS = ("attn.o_proj", "ffn.w2")


@functools.cache
def matmul_ops() -> frozenset:
    """The matmul operators whose outputs ``save_outputs`` keeps inside :data:`SAVED_PROJECTIONS`."""
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})


class CheckpointedBlock(nn.Module):
    """Run ``block`` under non-reentrant ``torch.utils.checkpoint``: ``policy="block"`` saves only the block's
    input and recomputes the rest in backward; ``"save_attention"`` also keeps the attention op's outputs;
    ``"save_outputs"`` keeps those and the matmul outputs of :data:`SAVED_PROJECTIONS` (selective activation
    checkpointing). The recomputation runs inside a profiler range ``recompute`` and runs the whole block (no
    early stop), so every module's hooks (FSDP's gathers and releases) pair up."""

    def __init__(self, block: nn.Module, policy: str = "block"):
        super().__init__()
        if policy not in ("block", "save_attention", "save_outputs"):
            raise ValueError(f"policy must be 'block', 'save_attention' or 'save_outputs', got {policy!r}")
        self.block, self.policy = block, policy
        # looked up here, not in forward: a compiled block would trace the lookup (and its imports)
        self._saved = saved_ops() if policy != "block" else frozenset()
        self._matmuls = matmul_ops()
        self._inside = 0  # > 0 while a saved projection runs (its module's hooks count it)
        if policy == "save_outputs":
            for name in SAVED_PROJECTIONS:
                module = block.get_submodule(name)
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        self._inside += 1

    def _leave(self, module, args, output) -> None:
        self._inside -= 1

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # A compiled block (the stock recipe's per-block torch.compile) traces the checkpoint as one
            # higher-order op, which must not hold the graph-task query below: Dynamo cannot trace it, and
            # the whole checkpointed block then ran eagerly, so "stock_compiled" was the eager step. A
            # compiled block's recomputation has no range of its own: its profile counts it with the block's.
            return self.block(x)
        # The same range op in the forward and in the recomputation (selective checkpointing replays the
        # forward's ops one for one), named by which one this is: inside backward it is the recomputation.
        name = "recompute" if torch._C._current_graph_task_id() != -1 else "block"
        with torch.profiler.record_function(name):
            return self.block(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        if self.policy == "block":
            return checkpoint(self._run, x, use_reentrant=False, early_stop=False)
        saved, matmuls = self._saved, self._matmuls
        if self.policy == "save_attention":  # constants only: a compiled block can trace it

            def policy(ctx, op, *args, **kwargs):
                return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
        else:

            def policy(ctx, op, *args, **kwargs):
                # only the matmul's own output inside a saved projection: not the views of its weight around
                # it, which under FSDP would keep the whole gathered block alive
                if op in saved or (self._inside and op in matmuls):
                    return CheckpointPolicy.MUST_SAVE
                return CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(self._run, x, use_reentrant=False, early_stop=False,
                          context_fn=partial(create_selective_checkpoint_contexts, policy))
