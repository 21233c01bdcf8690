"""The fastest training step the book's own parts make, and the stock PyTorch step it is measured against.

A :class:`~lab.recipes.recipe.Recipe` is configuration as data: which attention, whether the LM-head loss is
fused, how the model is sharded or replicated, what each block saves for backward, what is compiled, which AdamW
and when it updates (:mod:`lab.recipes.recipe`, with the ablations; re-exported here). :func:`build_step`
turns a model configuration and a recipe into a :class:`lab.measure.step.TrainStep`; the same model code
(``lab.model.TransformerLM``) runs in every recipe, with parameters and outputs unchanged.

The book's recipe (:data:`PROJECT`):

* **attention**: SDPA's cuDNN kernel, chosen by measurement on both rungs. On the leaderboard's shape (32k
  tokens, head dim 128) our Triton FlashAttention-2 kernels (``lab.kernels.flash_triton``, a
  ``torch.library`` op) take ~1.5x cuDNN's time forward+backward (notebook 05's grid,
  ``python -m lab.bench.flash_sweep``), and the step with them is slower by several hundred milliseconds. On the
  2.7B rung (512 tokens, head dim 80) the opaque op's host time per call starved the compiled step; with its
  kernels inlined into the compiled code (``FlashConfig.compile_inline``) the step ran within noise of SDPA's,
  not faster, so SDPA stays. The ablation ``flash_triton_attention`` measures the choice again in every render;
* **loss**: the fused LM head + cross-entropy (``lab.kernels.fused_cross_entropy``): the ``(tokens, vocab)``
  logits never exist (at the leaderboard's 32k tokens x 152k vocabulary they would be 10 GB in bf16);
* **sharding**: ``lab.FSDP``, one all-gather and one reduce-scatter per transformer block, prefetching two
  blocks ahead in forward and in the backward's recomputation;
* **checkpointing** ``save_outputs``: every block is recomputed in backward except the outputs of its
  attention op and of the two projections that write back to the residual stream (attention's ``o_proj``,
  the FFN's ``w2``): selective activation checkpointing. At 32k tokens attention is ~40% of a block's forward
  FLOPs, and each of the three outputs is only ``T x d_model`` (0.25 GiB a block at 32k tokens in bf16), so
  0.75 GiB a block removes the attention's recomputation and a quarter of the matmuls'. (``w2``'s output is
  needed by nothing in backward: without it saved, the recomputation would run that matmul only to throw its
  result away.) ``save_attention`` keeps only the attention's outputs; the ablations measure both;
* **offload** a quarter: the first quarter of the blocks is neither checkpointed nor kept on the device: what
  they save for backward goes to pinned host memory during the forward and comes back a block ahead of the
  backward (:mod:`lab.model.offload`), so those blocks are not recomputed. At 32k tokens such a block saves
  about 4.6 GB, 83 ms each way over a 55 GB/s host link, which the next block's forward and the backward of
  the block after it cover; the host's memory (every offloaded byte of every rank stays pinned through the
  step) holds about a quarter. The ablation ``no_offload`` measures it again in every render;
* **compile** ``pointwise``: ``torch.compile`` of the modules without matrices (RMSNorm, RoPE, the SwiGLU
  gate), which fuses their memory-bound chains of elementwise kernels; the matmuls are cuBLAS either way,
  and compiling whole blocks would trace into FSDP's hooks;
* **AdamW**: ``torch.optim.AdamW(fused=True)``: one multi-tensor kernel for the whole update (the foreach
  version launches several kernels per parameter group, the for-loop one per parameter, and keeps
  temporaries: the ablation ``foreach_adamw`` measures the difference).

The stock baseline (:data:`STOCK_EAGER`, :data:`STOCK_COMPILED`) is what a PyTorch user writes: FSDP2
``fully_shard`` per block and at the root, SDPA, ``torch.utils.checkpoint`` on every block, materialized
logits with ``F.cross_entropy``, fused AdamW; per-block ``torch.compile`` or eager. A comparison holds
precision fixed: every stock step exists at each precision the book's steps use (one GPU: bf16 parameters,
as the book's step, beside the course's fp32-master reference), and :func:`stock_options` says which of the
book's differences from a stock step are options any PyTorch user has (a dtype, a checkpointing policy, a
compile scope, an AdamW flag) rather than the book's own parts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from lab.accounting import forward_flops, saved_activation_bytes
from lab.measure.step import TrainStep, random_batch
from lab.model import ModelConfig, TransformerLM, config_for
from lab.model.transformer import RMSNorm, RotaryEmbedding, SiLUGate
from lab.parallel import launcher
from lab.parallel.fsdp import FSDP
from lab.parallel.optimizer_in_backward import OptimizerInBackward, block_buckets
from lab.recipes.checkpointing import SAVED_PROJECTIONS, CheckpointedBlock, saved_ops  # noqa: F401 - public here
from lab.recipes.recipe import (  # noqa: F401 - public here too, where the step is built
    ABLATION_BASE,
    ABLATION_LABELS,
    CHECKPOINTS,
    COMPILES,
    DATA_PARALLEL,
    HEADLINE,
    OURS,
    PRECISIONS,
    PROJECT,
    PROJECT_ONE_GPU,
    SHARDINGS,
    STOCK_COMPILED,
    STOCK_EAGER,
    STOCK_ONE_GPU_COMPILED,
    STOCK_ONE_GPU_COMPILED_BF16,
    STOCK_ONE_GPU_EAGER,
    STOCK_ONE_GPU_EAGER_BF16,
    WHOLE_MODEL,
    Recipe,
    ablation_base,
    ablations,
    change_label,
    compared_with,
    differences,
    is_stock,
    overlap_ablations,
    stock_options,
)
from lab.recipes.step_parts import (
    OFFLOAD_MIN_BYTES,
    check_host_memory,
    clip_before_step,
    compile_options,
    data_parallel_traffic,
    hsdp_mesh,
    keep_offloading,
    marking_steps,
    node_size,
    offload_that_fits,
    offloaded_count,
    sharded_traffic,
    uses_cuda_graphs,
    wrap_data_parallel,
)

#: The course's 2026 leaderboard model: 34 layers, d_model 4,096, d_ff 11,008, 32 heads, vocabulary 151,936,
#: 32,768 tokens of context, bf16 parameters; batch 2 (one sequence per GPU on two GPUs).
LEADERBOARD = ModelConfig(d_model=4096, d_ff=11008, num_layers=34, num_heads=32, vocab_size=151_936,
                          context_length=32_768)


@dataclass(frozen=True)
class StepConfig:
    """A model, its context, the batch per rank and the number of ranks: what one step trains."""

    name: str
    model: ModelConfig
    context: int
    batch_per_rank: int
    world_size: int
    #: ranks per node for hybrid sharding (0: the environment's ``LOCAL_WORLD_SIZE``, see
    #: :func:`lab.recipes.step_parts.node_size`)
    gpus_per_node: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.context * self.batch_per_rank * self.world_size


CONFIGS = {
    "leaderboard": StepConfig("leaderboard", LEADERBOARD, 32_768, 1, 2),
    "2.7B": StepConfig("2.7B", config_for("2.7B", context_length=512), 512, 4, 1),
    # CPU-sized stand-ins of the two (gloo ranks, Triton interpreted): the quick book and the tests
    "tiny": StepConfig("tiny", config_for("tiny", context_length=64, vocab_size=512), 64, 1, 2),
    "tiny_one_rank": StepConfig("tiny_one_rank", config_for("tiny", context_length=64, vocab_size=512), 64, 2, 1),
    # two nodes of two GPUs (HSDP: shard within a node, replicate across), and its CPU-sized stand-in
    "leaderboard_hsdp": StepConfig("leaderboard_hsdp", LEADERBOARD, 32_768, 1, 4, gpus_per_node=2),
    "tiny_hsdp": StepConfig("tiny_hsdp", config_for("tiny", context_length=64, vocab_size=512), 64, 1, 4,
                            gpus_per_node=2),
}


def recipes_for(config: StepConfig) -> dict[str, Recipe]:
    """The book's recipe and the stock baselines for ``config``, eager and compiled at each precision the
    book's steps use: on several GPUs (sharded and checkpointed) bf16 parameters, the book's own; on one (neither
    sharded nor checkpointed) the course's fp32 master weights under bf16 autocast and bf16 parameters. On
    several nodes (``gpus_per_node`` below the world size) the sharding is hybrid: ``hsdp`` and FSDP2's
    ``fsdp2_hsdp``."""
    if config.world_size > 1 and 0 < config.gpus_per_node < config.world_size:  # several nodes: hybrid sharding
        return {r.name: r for r in (dataclasses.replace(PROJECT, sharding="hsdp"),
                                    dataclasses.replace(STOCK_EAGER, sharding="fsdp2_hsdp"),
                                    dataclasses.replace(STOCK_COMPILED, sharding="fsdp2_hsdp"))}
    if config.world_size > 1:
        return {r.name: r for r in (PROJECT, STOCK_EAGER, STOCK_COMPILED)}
    return {r.name: r for r in (PROJECT_ONE_GPU, STOCK_ONE_GPU_EAGER, STOCK_ONE_GPU_COMPILED, STOCK_ONE_GPU_EAGER_BF16,
                                STOCK_ONE_GPU_COMPILED_BF16)}


#: What each ablation changes, in words, as the tables and sentences name it (read in one direction: the
#: step with this change, against the book's step).
# ----------------------------------------------------------------------------------------------------------
# building the step


def _compile_pointwise(model: TransformerLM) -> None:

    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, SiLUGate)):
            module.compile()


def build_model(cfg: ModelConfig, recipe: Recipe, device: torch.device, seed: int = 0,
                gpus_per_node: int = 0) -> nn.Module:
    """``TransformerLM(cfg)`` with the recipe's attention, loss, dtype, checkpointing, compilation and sharding
    applied from outside, in torchtitan's order (checkpoint, compile, shard). Every rank builds the same
    initial weights (``seed``); the sharding wrappers broadcast rank 0's anyway. The blocks a recipe offloads
    (:func:`lab.recipes.step_parts.offloaded_count`) are not checkpointed; :func:`build_step` offloads them.
    Hybrid sharding cuts the ranks into nodes of ``gpus_per_node`` (0: the environment's
    ``LOCAL_WORLD_SIZE``)."""
    cfg = dataclasses.replace(cfg, attention=recipe.attention, fused_loss=recipe.fused_loss)
    torch.manual_seed(seed)
    with torch.device(device):
        model = TransformerLM(cfg)
    if recipe.precision == "bf16":
        model.to(torch.bfloat16)
    if recipe.checkpoint != "none":
        offloaded = offloaded_count(recipe.offload, len(model.blocks))
        model.blocks = nn.ModuleList(CheckpointedBlock(b, recipe.checkpoint) if i >= offloaded else b
                                     for i, b in enumerate(model.blocks))
    if recipe.compile == "pointwise":
        _compile_pointwise(model)
    elif recipe.compile == "block":
        for block in model.blocks:
            block.compile()
    elif recipe.compile in WHOLE_MODEL:
        if recipe.sharding in OURS:
            raise ValueError(f"compile={recipe.compile!r} would trace into lab.FSDP's hooks; use 'pointwise' with "
                             f"{recipe.sharding!r}")
        if recipe.sharding != "torch_ddp":  # torch DDP is compiled around the model (wrap_data_parallel)
            model.compile(**compile_options(recipe.compile, device))
    if recipe.sharding in DATA_PARALLEL:
        compiled = compile_options(recipe.compile, device) if recipe.compile in WHOLE_MODEL else None
        return wrap_data_parallel(model, recipe.sharding, device, recipe.bucket_mb, recipe.bucket_order,
                                  recipe.reduce_dtype, compiled)
    world = launcher.world_size()
    if recipe.sharding == "fsdp":
        return FSDP(model)
    if recipe.sharding == "hsdp":
        return FSDP(model, process_group=hsdp_mesh(device.type, world, node_size(world, gpus_per_node)))
    if recipe.sharding in ("fsdp2", "fsdp2_hsdp"):
        from torch.distributed.device_mesh import init_device_mesh  # distributed-only: imported where it runs
        from torch.distributed.fsdp import fully_shard

        mesh = (init_device_mesh(device.type, (world,)) if recipe.sharding == "fsdp2" else
                hsdp_mesh(device.type, world, node_size(world, gpus_per_node)))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def summed_loss_on_logits(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The leaderboard's loss as the stock step computes it: ``F.cross_entropy`` of the materialized logits in
    their own dtype, summed (under autocast, cross-entropy runs in fp32 all the same)."""
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def summed_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The leaderboard's loss: next-token cross-entropy summed over every position."""
    return model(tokens, targets, reduction="sum")


def build_step(config: StepConfig, recipe: Recipe, device: torch.device, seed: int = 0, rank: int = 0,
               offload_min_bytes: int = OFFLOAD_MIN_BYTES) -> TrainStep:
    """The training step of ``config`` built with ``recipe`` on this rank: zero_grad, forward, summed loss,
    backward (with the wrapper's gradient synchronization), AdamW step. Each rank draws its own sequences.
    A recipe that offloads keeps its offloading entered for the step's life (``step.offloader``, storages of
    at least ``offload_min_bytes``; :func:`lab.recipes.step_parts.keep_offloading`); one captured in CUDA
    graphs marks each step's beginning (:func:`lab.recipes.step_parts.marking_steps`)."""
    recipe = recipe.for_world(config.world_size)
    model = build_model(config.model, recipe, device, seed, config.gpus_per_node)
    params = [p for p in model.parameters() if p.requires_grad]
    hyper = dict(lr=1e-4, weight_decay=0.01, fused=recipe.fused_adamw, foreach=None if recipe.fused_adamw else True)
    clip = recipe.clip_grad_norm or None
    if not recipe.optimizer_in_backward:
        optimizer = torch.optim.AdamW(params, **hyper)
        if clip:
            clip_before_step(optimizer, clip)
    elif recipe.sharding in OURS:  # each shard updated right after its reduce-scatter
        optimizer = OptimizerInBackward(params, fsdp=model, **hyper)
    elif recipe.sharding == "ddp":  # each block updated once the all-reduces of its gradients are done
        optimizer = OptimizerInBackward(params, ddp=model, max_grad_norm=clip, **hyper)
    else:  # unsharded (Recipe refuses the others): one fused update per block, as soon as its gradients are final
        optimizer = OptimizerInBackward(params, buckets=block_buckets(model), max_grad_norm=clip, **hyper)
    tokens, targets = random_batch(config.model, config.batch_per_rank, device, config.context, seed=seed + 1 + rank)
    dtype = "bf16" if recipe.precision == "bf16_autocast" else "fp32"  # bf16 parameters need no autocast
    loss_fn = summed_loss if recipe.fused_loss or recipe.loss_upcast else summed_loss_on_logits
    if uses_cuda_graphs(recipe.compile, device):
        loss_fn = marking_steps(loss_fn)
    step = TrainStep(model, optimizer, tokens, targets, dtype=dtype, loss_fn=loss_fn)
    offloaded = offloaded_count(recipe.offload, config.model.num_layers)
    if offloaded:  # at most what the blocks save, checked against the host before any of it is pinned
        cfg = dataclasses.replace(config.model, attention=recipe.attention)
        saved = saved_activation_bytes(cfg, config.batch_per_rank, config.context, recipe.precision)["blocks"]
        check_host_memory(saved * offloaded / cfg.num_layers, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        inner = model.module if isinstance(model, FSDP) else model
        hooks = model.saved_tensor_hooks() if isinstance(model, FSDP) else None
        keep_offloading(step, inner, offloaded, hooks, min_bytes=offload_min_bytes)
    return step


def offload_for_host(config: StepConfig, recipe: Recipe, available: int | None = None) -> float:
    """The ``offload`` share of ``recipe`` on ``config`` that this host's memory holds
    (:func:`lab.recipes.step_parts.offload_that_fits`): an offloaded block saves what an unchecked block saves
    (:func:`lab.accounting.saved_activation_bytes`), and every rank of the node pins its own."""
    cfg = dataclasses.replace(config.model, attention=recipe.attention)
    saved = saved_activation_bytes(cfg, config.batch_per_rank, config.context, recipe.precision)["blocks"]
    ranks_here = node_size(config.world_size, config.gpus_per_node)
    return offload_that_fits(saved / cfg.num_layers, cfg.num_layers, ranks_here, available)


def step_traffic(config: StepConfig, recipe: Recipe) -> dict[str, float]:
    """``nodes``, and ``within_node_bytes`` / ``across_node_bytes`` each rank sends per step (NaN on one rank;
    :func:`lab.recipes.step_parts.sharded_traffic`, the parameters' dtype gathered and reduced; under data
    parallelism :func:`lab.recipes.step_parts.data_parallel_traffic`, in the communication dtype)."""
    recipe, per_node = recipe.for_world(config.world_size), node_size(config.world_size, config.gpus_per_node)
    width = 2 if recipe.precision == "bf16" else 4
    if recipe.sharding in DATA_PARALLEL:
        reduce_bytes = 2 if recipe.reduce_dtype == "bf16" else width
        return dict(nodes=config.world_size // per_node,
                    **data_parallel_traffic(config.model, config.world_size, per_node, reduce_bytes))
    first_recomputed = recipe.checkpoint != "none" and offloaded_count(recipe.offload, config.model.num_layers) < 2
    return dict(nodes=config.world_size // per_node, **(
        sharded_traffic(config.model, recipe.sharding, config.world_size, per_node, width, width, first_recomputed)
        if recipe.sharding != "none" else dict(within_node_bytes=math.nan, across_node_bytes=math.nan)))


def model_flops_per_step(config: StepConfig) -> float:
    """Model FLOPs of one step over all ranks, without recomputation: 3x the forward's matmul FLOPs with the
    causal mask's half of the attention scores (the convention of MFU)."""

    cfg, tokens = config.model, config.context * config.batch_per_rank * config.world_size
    full = forward_flops(cfg, config.batch_per_rank * config.world_size, config.context)
    scores = tokens * cfg.num_layers * 4 * config.context * cfg.d_model  # both T x T matmuls, full square
    return 3.0 * (full - scores / 2)


def mfu(config: StepConfig, step_ms: float, peak_tflops_per_gpu: float) -> float:
    """Model FLOP utilisation: model FLOPs per second per GPU over ``peak_tflops_per_gpu``."""
    if not step_ms or math.isnan(step_ms):
        return math.nan
    return model_flops_per_step(config) / config.world_size / (step_ms * 1e-3) / (peak_tflops_per_gpu * 1e12)
