"""Activation checkpointing per transformer block, applied from outside the model: what a block saves for
backward and what its backward recomputes (the fastest step's ``checkpoint`` choice,
:mod:`lab.recipes.fastest_step`).

Non-reentrant ``torch.utils.checkpoint`` around the whole block (``block``), or selective checkpointing that
keeps some ops' outputs: the attention op's (``save_attention``), and those plus the matmul outputs of the two
projections that write back to the residual stream (``save_outputs``).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
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
        self._recomputing = 0  # > 0 while the checkpoint recomputes the block (_Recomputation counts it)
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
            # higher-order op, whose context_fn may only be selective checkpointing's dispatch modes: nothing
            # marks its recomputation, which has no range of its own (its profile counts it with the block's).
            return self.block(x)
        # The same range op in the forward and in the recomputation (selective checkpointing replays the
        # forward's ops one for one), named by which one this is.
        with torch.profiler.record_function("recompute" if self._recomputing else "block"):
            return self.block(x)

    def _contexts(self, selective=None):
        """``context_fn`` of the checkpoint: ``selective``'s (forward, recompute) contexts, or none, with the
        recompute context also marking the block as recomputing. torch.utils.checkpoint enters the recompute
        context around exactly the recomputation, which is how the block knows (no query of autograd's
        engine state needed)."""
        forward_context, recompute_context = selective() if selective is not None else (nullcontext(), nullcontext())
        return forward_context, _Recomputation(self, recompute_context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        selective = None
        if self.policy != "block":
            selective = partial(create_selective_checkpoint_contexts, self._policy())
        if torch.compiler.is_compiling():  # compiled, checkpoint takes no context but dispatch modes
            context = {} if selective is None else {"context_fn": selective}
        else:
            context = {"context_fn": partial(self._contexts, selective)}
        return checkpoint(self._run, x, use_reentrant=False, early_stop=False, **context)

    def _policy(self):
        """The selective checkpointing policy of ``save_attention`` or ``save_outputs``."""
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
        return policy


class _Recomputation:
    """The recompute context of one checkpointed call: ``inner`` (selective checkpointing's mode, or nothing)
    with ``block._recomputing`` raised while it is entered. A class, not a generator, because a second
    backward through the same graph (``retain_graph``) enters it again."""

    def __init__(self, block: CheckpointedBlock, inner):
        self.block, self.inner = block, inner

    def __enter__(self):
        self.block._recomputing += 1
        try:
            return self.inner.__enter__()
        except BaseException:
            self.block._recomputing -= 1
            raise

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.block._recomputing -= 1
