"""The fastest step's parts that live beside the model rather than in it: CUDA-graph capture of the compiled
one-GPU step, activation offloading kept for a step's life, and hybrid sharding's two-level rank grid with the
bytes a step sends within and across nodes. :mod:`lab.recipes.fastest_step` applies them from its recipes.

* **CUDA graphs** (``compile="model_cudagraphs"``): ``torch.compile(mode="reduce-overhead")`` of the whole
  model records each compiled graph's kernels once and replays them with one launch, which removes the host's
  launch time from a step whose kernels are short (the 2.7B rung's 512-token sequences). Inductor's
  cudagraph trees reuse the graphs' output memory on the next replay, so every step first calls
  ``torch.compiler.cudagraph_mark_step_begin()`` (:func:`marking_steps`): the previous step's outputs (its
  loss) are then declared dead, and nothing of one step is read after the next begins (``TrainStep`` drops
  its gradients with ``zero_grad(set_to_none=True)``). A compiled function's first call under cudagraph
  trees runs it without a graph (warm-up), its second records the graph, later ones replay it: a step is
  timed only after :data:`CUDA_GRAPH_WARMUP_STEPS` steps beyond the first (:func:`warm_up_cuda_graphs`).
  CUDA graphs need a GPU: on the CPU the same recipe compiles the model without them
  (:func:`compile_options`), and the row says so.
* **Activation offloading** (``offload``): the first blocks' saved activations wait in host memory instead of
  being recomputed (:mod:`lab.model.offload`); :func:`keep_offloading` enters the offloading for the step's
  life and leaves it when the step is dropped; :func:`offload_that_fits` is the largest share the host's memory
  holds, so that only what it cannot take is recomputed.
* **HSDP** (``sharding="hsdp"``): the ranks of one node shard the model, and the nodes hold replicas;
  :func:`hsdp_mesh` builds the ("replicate", "shard") grid, :func:`node_size` reads the node's size, and
  :func:`sharded_traffic` computes what each rank sends per step within its node and across nodes;
* **data parallelism** (``sharding="ddp"`` or ``"torch_ddp"``): :func:`wrap_data_parallel` and the all-reduce's
  bytes, :func:`data_parallel_traffic`;
* **clipping** by the global norm before a plain update: :func:`clip_before_step`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from lab.accounting import parameter_count
from lab.accounting.collectives import ring_bytes_per_rank
from lab.measure.device import available_memory_bytes, synchronize
from lab.measure.step import TrainStep
from lab.model import ModelConfig
from lab.model.offload import activation_offloading
from lab.parallel.ddp import DDPBucketed, torch_ddp

#: The storages smaller than this stay on the device when offloading (their copies cost more in launches than
#: they free); tests pass 0 to move a toy model's small activations too.
OFFLOAD_MIN_BYTES = 1 << 16


# ----------------------------------------------------------------------------------------------------------
# CUDA graphs


def uses_cuda_graphs(compile: str, device: torch.device) -> bool:
    """Whether a recipe's ``compile`` captures the step in CUDA graphs on ``device`` (only on a GPU)."""
    return compile == "model_cudagraphs" and torch.device(device).type == "cuda"


def compile_options(compile: str, device: torch.device) -> dict:
    """The ``torch.compile`` keyword arguments of a whole-model ``compile`` choice on ``device``:
    ``mode="reduce-overhead"`` (CUDA graphs) for ``model_cudagraphs`` on a GPU, none otherwise (the CPU has
    no CUDA graphs: the model is compiled as with ``compile="model"``)."""
    return dict(mode="reduce-overhead") if uses_cuda_graphs(compile, device) else {}


def _mark_then(loss_fn: Callable, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    torch.compiler.cudagraph_mark_step_begin()
    return loss_fn(model, tokens, targets)


def marking_steps(loss_fn: Callable) -> Callable:
    """``loss_fn`` that first tells cudagraph trees a new step begins (see the module docstring)."""
    return functools.partial(_mark_then, loss_fn)


#: Steps run after a captured step's first one before it is timed: the first of them records the forward's
#: and the backward's graphs (the first step ran them as cudagraph trees' warm-up), the others replay them,
#: so that the timing sees replays only (one more than needed, in case a graph is recorded a step late).
CUDA_GRAPH_WARMUP_STEPS = 3


def warm_up_cuda_graphs(step: Callable[[], object], device: torch.device,
                        steps: int = CUDA_GRAPH_WARMUP_STEPS) -> list[float]:
    """Run ``step`` ``steps`` times (after its first run) so that cudagraph trees have recorded its graphs
    before it is timed; returns each step's host time in ms (``device`` synchronized after each): the
    recording step's far above the replays'."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


# ----------------------------------------------------------------------------------------------------------
# activation offloading


def offloaded_count(offload: float, num_layers: int) -> int:
    """How many blocks (the first ones) a recipe's ``offload`` share offloads: ``round(offload * num_layers)``,
    at least one for any share above zero, at most every block but the last (whose backward starts as soon as
    the forward ends, so its copies could not be hidden)."""
    return min(num_layers - 1, max(1, round(offload * num_layers))) if offload > 0 else 0


#: Share of the host's available memory the offloaded activations of every rank on it may plan to fill.
HOST_HEADROOM = 0.8


def check_host_memory(offloaded_bytes: float, ranks_here: int, available: int | None = None) -> None:
    """Refuse an offload the host cannot hold: each of the ``ranks_here`` ranks on this host keeps
    ``offloaded_bytes`` of a step's activations in pinned host memory; more than :data:`HOST_HEADROOM` of the
    ``available`` bytes (default: the kernel's ``MemAvailable``) raises ``MemoryError`` (a row's ``oom``), one
    line with both numbers, before pinned allocations push the host into its out-of-memory killer."""
    available = available_memory_bytes("cpu") if available is None else available
    if offloaded_bytes * ranks_here > HOST_HEADROOM * available:
        raise MemoryError(f"offloading needs {offloaded_bytes / 2**30:.1f} GiB of pinned host memory per rank x "
                          f"{ranks_here} ranks, but the host has {available / 2**30:.1f} GiB available")


def offload_that_fits(block_bytes: float, num_layers: int, ranks_here: int, available: int | None = None) -> float:
    """The largest share of the blocks whose saved activations (``block_bytes`` each, per rank) the host holds
    for its ``ranks_here`` ranks within :data:`HOST_HEADROOM` of ``available`` bytes (default: the kernel's
    ``MemAvailable``): ``k / num_layers`` for the largest ``k`` up to every block but the last (see
    :func:`offloaded_count`), 0 where not even one block fits. Every block offloaded is one block less
    recomputed, so a recipe recomputes only what the host cannot take."""
    available = available_memory_bytes("cpu") if available is None else available
    fits = int(HOST_HEADROOM * available // (block_bytes * ranks_here)) if block_bytes > 0 else num_layers
    return min(num_layers - 1, fits) / num_layers


def keep_offloading(step: TrainStep, model: nn.Module, blocks: int, fsdp_hooks: tuple | None = None,
                     min_bytes: int = OFFLOAD_MIN_BYTES, prefetch: int = 1) -> None:
    """Offload the saved activations of ``model``'s first ``blocks`` blocks for as long as ``step`` lives:
    :func:`lab.model.offload.activation_offloading` entered now, its offloader kept as ``step.offloader``
    (its ``stats()`` give the bytes moved and the time waited), and left (the model's blocks restored) when
    the step is garbage-collected or ``step.close_offloading()`` is called. ``model`` is the unwrapped model
    (``fsdp.module`` under ``lab.FSDP``, whose ``saved_tensor_hooks()`` go in ``fsdp_hooks``: FSDP's pack
    sees every saved tensor first and keeps its gathered weights)."""
    stack = contextlib.ExitStack()
    step.offloader = stack.enter_context(activation_offloading(
        model, offload_blocks=range(blocks), min_bytes=min_bytes, prefetch=prefetch, delegate=fsdp_hooks))
    step.close_offloading = weakref.finalize(step, stack.close)


# ----------------------------------------------------------------------------------------------------------
# hybrid sharding over nodes


def node_size(world_size: int, gpus_per_node: int | None = None) -> int:
    """Ranks per node: ``gpus_per_node`` if given, else the environment's ``LOCAL_WORLD_SIZE`` (torchrun sets
    it; the spawning launcher sets it to the world size, one node). Raises unless it divides the world."""
    per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if per_node < 1 or world_size % per_node:
        raise ValueError(f"{world_size} ranks do not make whole nodes of {per_node}")
    return per_node


def hsdp_mesh(device_type: str, world_size: int, per_node: int):
    """The ("replicate", "shard") ``DeviceMesh`` of ``world_size`` ranks in nodes of ``per_node``: consecutive
    ranks (one node) shard, the same position on every node replicates."""
    from torch.distributed.device_mesh import init_device_mesh  # distributed-only: imported where it runs

    return init_device_mesh(device_type, (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def _param_counts(cfg: ModelConfig) -> dict[str, list[int]]:
    """Element counts of the model's parameters by where FSDP groups them: per block (2-D and 1-D), the
    embedding, the LM head and the final norm."""
    d, f = cfg.d_model, cfg.d_ff
    block_2d = [d * d] * 4 + [f * d] * 3
    return dict(block_2d=block_2d, block_1d=[d, d], embedding=[cfg.vocab_size * d], head=[cfg.vocab_size * d],
                final_norm=[d])


def sharded_traffic(cfg: ModelConfig, sharding: str, world_size: int, per_node: int,
                    gather_bytes: int, reduce_bytes: int, regather_embedding: bool = False) -> dict[str, float]:
    """Bytes each rank sends per step (ring collectives, :func:`lab.accounting.collectives.ring_bytes_per_rank`)
    within its node and across nodes, from the model's shapes, for a sharded step: ``fsdp``/``fsdp2`` shard
    over every rank, ``hsdp``/``fsdp2_hsdp`` within the node (``per_node`` ranks) and replicate across nodes.

    ``hsdp`` and ``fsdp`` (``lab.FSDP``): each block's seven matrices and the embedding and LM head are gathered in
    the forward, and every one but the embedding (whose backward needs only the token ids) again in the backward, in
    ``gather_bytes`` per element (``regather_embedding``: the embedding too, which lab.FSDP's prefetch for the
    recomputation of the first two blocks gathers when they are checkpointed); each matrix's gradient is
    reduce-scattered once, in ``reduce_bytes``; under HSDP each rank's gradient shard is then all-reduced across
    nodes. The 1-D parameters stay whole: their gradients are all-reduced once within the node and once across.
    ``fsdp2`` (stock ``fully_shard`` per block and at the root): every parameter is sharded; each block is gathered
    in the forward and again in the backward, the root's parameters (embedding, head, final norm) once (the root
    keeps them after the forward); every gradient reduce-scattered, and under HSDP its shard all-reduced. Without
    HSDP everything is within the node on one node; over several, a ring of consecutive ranks sends one hop in
    ``per_node`` across nodes (bytes averaged over the ranks). Shards are padded to a multiple of the shard group.
    Returns ``within_node_bytes``, ``across_node_bytes``."""
    if sharding not in ("fsdp", "hsdp", "fsdp2", "fsdp2_hsdp"):
        raise ValueError(f"sharding must be fsdp, hsdp, fsdp2 or fsdp2_hsdp, got {sharding!r}")
    hybrid = sharding.endswith("hsdp")
    shard = per_node if hybrid else world_size
    nodes = world_size // per_node
    replicas = nodes if hybrid else 1
    p = _param_counts(cfg)
    L = cfg.num_layers

    def padded(n: int) -> int:
        return math.ceil(n / shard) * shard

    within = across = 0.0

    def collective(op: str, full_bytes: float, group: str) -> None:
        nonlocal within, across
        size = shard if group == "shard" else replicas
        sent = ring_bytes_per_rank(op, full_bytes, size) if size > 1 else 0.0
        if group == "replicate":
            across += sent
        elif hybrid or nodes == 1:  # the shard group is one node
            within += sent
        else:  # a ring over consecutive ranks of several nodes: one hop in per_node leaves its node
            across += sent / per_node
            within += sent * (1 - 1 / per_node)

    if sharding in ("fsdp", "hsdp"):
        block = sum(padded(n) for n in p["block_2d"])
        emb, head = padded(p["embedding"][0]), padded(p["head"][0])
        gathered = (2 * L * block + (2 if regather_embedding else 1) * emb + 2 * head) * gather_bytes
        grads = (L * block + emb + head) * reduce_bytes
        small = (L * sum(p["block_1d"]) + p["final_norm"][0]) * reduce_bytes
        collective("all_gather", gathered, "shard")
        collective("reduce_scatter", grads, "shard")
        collective("all_reduce", small, "shard")
        if hybrid:
            collective("all_reduce", grads / shard, "replicate")
            collective("all_reduce", small, "replicate")
    else:
        block = padded(sum(p["block_2d"]) + sum(p["block_1d"]))
        root = padded(p["embedding"][0] + p["head"][0] + p["final_norm"][0])
        collective("all_gather", (2 * L * block + root) * gather_bytes, "shard")
        grads = (L * block + root) * reduce_bytes
        collective("reduce_scatter", grads, "shard")
        if hybrid:
            collective("all_reduce", grads / shard, "replicate")
    return dict(within_node_bytes=within, across_node_bytes=across)


def data_parallel_traffic(cfg: ModelConfig, world_size: int, per_node: int, reduce_bytes: int) -> dict[str, float]:
    """Bytes each rank sends per step within its node and across nodes for data parallelism: one ring
    all-reduce of every parameter's gradient in ``reduce_bytes`` per element (on several nodes, one hop in
    ``per_node`` of the ring leaves its node, as in :func:`sharded_traffic`). Returns ``within_node_bytes``,
    ``across_node_bytes``."""
    sent = ring_bytes_per_rank("all_reduce", parameter_count(cfg) * reduce_bytes, world_size) if world_size > 1 else 0.0
    nodes = world_size // per_node
    if nodes == 1:
        return dict(within_node_bytes=sent, across_node_bytes=0.0)
    return dict(within_node_bytes=sent * (1 - 1 / per_node), across_node_bytes=sent / per_node)


# ----------------------------------------------------------------------------------------------------------
# data parallelism and clipping


def wrap_data_parallel(model: nn.Module, sharding: str, device: torch.device, bucket_mb: float,
                       bucket_order: str = "ready", reduce_dtype: str = "grad", compile_kwargs: dict | None = None
                       ) -> nn.Module:
    """``model`` replicated on every rank: ``lab.DDPBucketed`` (``sharding="ddp"``, buckets of ``bucket_mb`` MiB
    in ``bucket_order``) or ``torch.nn.parallel.DistributedDataParallel`` (``"torch_ddp"``:
    :func:`lab.parallel.ddp.torch_ddp`), the gradients communicated in bf16 where ``reduce_dtype`` is ``"bf16"``
    (torch DDP: its ``bf16_compress_hook``). ``compile_kwargs`` (torch DDP only): compile the wrapped model as a
    whole, as torch recommends (its graph is then split at the buckets, so that their all-reduces overlap the
    backward)."""
    bf16 = reduce_dtype == "bf16"
    if sharding == "ddp":
        return DDPBucketed(model, bucket_size_mb=bucket_mb, bucket_order=bucket_order,
                           reduce_dtype=torch.bfloat16 if bf16 else None)
    if sharding != "torch_ddp":
        raise ValueError(f"sharding must be ddp or torch_ddp, got {sharding!r}")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # distributed-only: imported where it runs

    wrapped = torch_ddp(model, bucket_size_mb=bucket_mb)
    if bf16:
        wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook if device.type == "cuda" else
                                   bf16_compress_on_gloo)
    if compile_kwargs is not None:
        wrapped.compile(**compile_kwargs)
    return wrapped


def bf16_compress_on_gloo(process_group, bucket):
    """torch DDP's ``bf16_compress_hook`` itself, under a name torch DDP does not refuse on the CPU: it accepts
    its own only where NCCL runs it, while gloo reduces bf16 as well (the CPU-sized runs and tests)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # distributed-only: imported where it runs

    return default_hooks.bf16_compress_hook(process_group, bucket)


def _clip(params: list[torch.Tensor], max_norm: float, _optimizer, _args, _kwargs) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Clip the gradients of ``optimizer``'s parameters by their global norm (``torch.nn.utils.clip_grad_norm_``,
    to ``max_norm``) before each of its steps: a step pre-hook, so the clipping runs inside the step's
    ``optimizer_step`` phase and its cost is the update's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.register_step_pre_hook(functools.partial(_clip, params, max_norm))
