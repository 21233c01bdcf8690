"""What a training step is built from, as data: the :class:`Recipe`, the book's and the stock recipes, the
ablations that switch one choice at a time, and which of the book's differences from a stock step are options
any PyTorch user has. :mod:`lab.recipes.fastest_step` builds the step a recipe describes (and says why the
book's recipe chooses what it does).

The choices that hide the optimizer and the gradients' communication behind the backward each have a switch
of their own, so that each is measured on and off (:func:`overlap_ablations`):

* ``optimizer_in_backward``: each block's AdamW update runs as soon as its gradients are final (and reduced),
  on a side stream beside the rest of the backward (:mod:`lab.parallel.optimizer_in_backward`). A model
  compiled as one graph hands every gradient over at the end of its one backward node, so the updates could
  not overlap anything: with this switch the blocks are compiled one by one instead (``block_compile`` is the
  same change alone, what the switch is read against);
* ``sharding="ddp"``: ``lab.DDPBucketed`` (``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel``), with
  buckets of ``bucket_mb`` MiB; ``bucket_order`` ``ready`` (the first backward's order) or ``reverse``
  (registration order reversed); ``reduce_dtype`` ``bf16``: the gradients travel in bf16 (``torch_ddp``:
  its ``bf16_compress_hook``), ``grad`` in their own dtype;
* ``clip_grad_norm`` (0: off): clip by the global gradient norm before the update, as
  ``torch.nn.utils.clip_grad_norm_``; inside the backward the updates then wait for the end of it (the norm
  needs every gradient): the ablation ``optimizer_in_backward_clipped``, read against ``optimizer_in_backward``,
  measures what that costs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lab.parallel.ddp import BUCKET_ORDERS

CHECKPOINTS = ("none", "block", "save_attention", "save_outputs")
COMPILES = ("none", "pointwise", "block", "model", "model_cudagraphs")
#: the ``compile`` choices that make the whole model one graph (one backward node for every block)
WHOLE_MODEL = ("model", "model_cudagraphs")
PRECISIONS = ("bf16", "bf16_autocast", "fp32")
SHARDINGS = ("none", "fsdp", "fsdp2", "hsdp", "fsdp2_hsdp", "ddp", "torch_ddp")
#: the shardings of the book's own wrapper (lab.FSDP), flat and hybrid
OURS = ("fsdp", "hsdp")
#: data parallelism without sharding: the book's bucketed wrapper and torch's
DATA_PARALLEL = ("ddp", "torch_ddp")
REDUCE_DTYPES = ("grad", "bf16")


@dataclass(frozen=True)
class Recipe:
    """How to build the step (see :mod:`lab.recipes.fastest_step`). ``precision``: ``bf16`` parameters,
    gradients and AdamW state (the leaderboard's rule); ``bf16_autocast``: fp32 master weights, matmuls under
    bf16 autocast (the course's 2.7B reference); ``fp32``: everything fp32 (exact comparisons in tests).
    ``loss_upcast`` (materialized logits only): the model's own loss, cross-entropy of the logits cast to fp32;
    False: ``F.cross_entropy`` of the logits as they come (bf16 with bf16 parameters), as the stock step the
    issue measured does: at the leaderboard's 32k x 152k logits the fp32 copy and fp32 log-softmax cost ~28 GiB.

    ``sharding``: ``hsdp`` is ``lab.FSDP`` sharding within a node and replicating across nodes, ``fsdp2_hsdp``
    stock ``fully_shard`` on the same ("replicate", "shard") mesh; ``ddp`` and ``torch_ddp`` replicate the whole
    model (module docstring: ``bucket_mb``, ``bucket_order``, ``reduce_dtype``). ``compile="model_cudagraphs"``:
    the whole model under ``torch.compile(mode="reduce-overhead")``, captured in CUDA graphs on a GPU
    (:mod:`lab.recipes.step_parts`). ``offload``: the share of the blocks (the first ones, at most every block
    but the last) whose saved activations go to host memory instead of being recomputed; those blocks are not
    checkpointed, the others keep ``checkpoint``. ``clip_grad_norm``: the largest global gradient norm (0: no
    clipping)."""

    name: str = "project"
    attention: str = "flash_triton"
    fused_loss: bool = True
    sharding: str = "fsdp"
    checkpoint: str = "save_outputs"
    compile: str = "pointwise"
    fused_adamw: bool = True
    precision: str = "bf16"
    loss_upcast: bool = True
    optimizer_in_backward: bool = False
    offload: float = 0.0
    bucket_mb: float = 25.0
    bucket_order: str = "ready"
    reduce_dtype: str = "grad"
    clip_grad_norm: float = 0.0

    def __post_init__(self):
        for field, allowed in (("checkpoint", CHECKPOINTS), ("compile", COMPILES), ("sharding", SHARDINGS),
                               ("precision", PRECISIONS), ("bucket_order", BUCKET_ORDERS),
                               ("reduce_dtype", REDUCE_DTYPES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {', '.join(allowed)}, got {getattr(self, field)!r}")
        if self.optimizer_in_backward and (self.sharding.startswith("fsdp2") or self.sharding == "torch_ddp"):
            raise ValueError(f"optimizer_in_backward runs with lab.FSDP, lab.DDPBucketed or no sharding, not "
                             f"{self.sharding!r}")
        if self.optimizer_in_backward and self.compile in WHOLE_MODEL:
            raise ValueError(f"optimizer_in_backward with compile={self.compile!r}: a whole-model graph hands every "
                             "gradient over at the end of its backward, so no update could overlap it; compile "
                             "'block' or 'pointwise'")
        if self.sharding == "ddp" and self.compile in WHOLE_MODEL:
            raise ValueError(f"sharding='ddp' with compile={self.compile!r}: a whole-model graph hands every gradient "
                             "over at the end of its backward, so no all-reduce could overlap it; compile 'block'")
        if not 0 <= self.offload <= 1:
            raise ValueError(f"offload is a share of the blocks between 0 and 1, got {self.offload}")
        if self.offload and (self.sharding.startswith("fsdp2") or self.sharding in DATA_PARALLEL
                             or self.compile in WHOLE_MODEL):
            raise ValueError("offload wraps the blocks from outside: it runs with lab.FSDP or no sharding and "
                             f"without a whole-model compile, not sharding={self.sharding!r}, compile={self.compile!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.bucket_order != "ready" and self.sharding != "ddp":
            raise ValueError(f"bucket_order is lab.DDPBucketed's (sharding='ddp'), not {self.sharding!r}'s")
        if self.reduce_dtype != "grad" and self.sharding not in DATA_PARALLEL:
            raise ValueError(f"reduce_dtype applies to {' and '.join(DATA_PARALLEL)}, not {self.sharding!r}")
        if self.clip_grad_norm < 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0: no clipping), got {self.clip_grad_norm}")
        if self.clip_grad_norm and self.sharding in OURS:
            raise ValueError("clip_grad_norm with lab.FSDP: each rank holds shards of the gradients, whose global "
                             "norm this recipe does not form")

    def for_world(self, world_size: int) -> Recipe:
        """The same recipe on ``world_size`` ranks: one rank shards and reduces nothing."""
        if world_size > 1 or self.sharding == "none":
            return self
        return dataclasses.replace(self, sharding="none", bucket_order="ready", reduce_dtype="grad")


PROJECT = Recipe(attention="sdpa", offload=0.25)  # several GPUs, the leaderboard's shape: see fastest_step
STOCK_EAGER = Recipe("stock_eager", attention="sdpa", fused_loss=False, sharding="fsdp2", checkpoint="block",
                     compile="none", loss_upcast=False)
STOCK_COMPILED = dataclasses.replace(STOCK_EAGER, name="stock_compiled", compile="block")

#: One GPU, where the model fits without sharding or recomputation: the book's step compiles the whole model
#: (the fused loss is an op inside its graph) and keeps bf16 parameters; the stock steps are the course's
#: reference (fp32 master weights under bf16 autocast, whole-model torch.compile, fused AdamW) and the same
#: with bf16 parameters, the book's precision.
PROJECT_ONE_GPU = Recipe(attention="sdpa", sharding="none", checkpoint="none", compile="model")
STOCK_ONE_GPU_COMPILED = Recipe("stock_compiled", attention="sdpa", fused_loss=False, sharding="none",
                                checkpoint="none", compile="model", precision="bf16_autocast", loss_upcast=False)
STOCK_ONE_GPU_EAGER = dataclasses.replace(STOCK_ONE_GPU_COMPILED, name="stock_eager", compile="none")
#: The same stock steps at the book's precision (bf16 parameters and AdamW state): what the book's one-GPU step
#: is set against with precision held fixed.
STOCK_ONE_GPU_COMPILED_BF16 = dataclasses.replace(STOCK_ONE_GPU_COMPILED, name="stock_compiled_bf16", precision="bf16")
STOCK_ONE_GPU_EAGER_BF16 = dataclasses.replace(STOCK_ONE_GPU_EAGER, name="stock_eager_bf16", precision="bf16")


#: The recipes every render of a configuration times with do_bench and profiles (those a configuration has).
HEADLINE = ("project", "stock_eager", "stock_compiled", "stock_eager_bf16", "stock_compiled_bf16")


def is_stock(name: str) -> bool:
    """Whether a recipe name is one of the stock PyTorch steps (:data:`STOCK_EAGER` and its kin)."""
    return name.startswith("stock_")


#: The name of the book's step measured again beside its ablations where they run on GPUs of their own
#: (``lab.bench.fastest.plan``): what they are compared with, on the same cards and timed the same way.
ABLATION_BASE = "ablation_base"


def ablation_base(project: Recipe) -> Recipe:
    """The book's recipe under the name :data:`ABLATION_BASE`."""
    return dataclasses.replace(project, name=ABLATION_BASE)


#: What each ablation changes, in words, as the tables and sentences name it (read in one direction: the
#: step with this change, against the step it is compared with, :func:`compared_with`).
ABLATION_LABELS = {
    "no_flash_attention": "swap in SDPA for our Triton attention",
    "flash_triton_attention": "swap in our Triton attention for SDPA",
    "no_fused_loss": "turn off the fused loss (materialized logits)",
    "full_recompute": "recompute whole blocks (save nothing inside them)",
    "save_attention_only": "save only the attention outputs",
    "no_compile": "turn off torch.compile",
    "foreach_adamw": "foreach AdamW instead of fused",
    "fp32_master_weights": "fp32 master weights under bf16 autocast",
    "optimizer_in_backward": "update each block's parameters inside the backward",
    "cuda_graphs": "capture the compiled model in CUDA graphs",
    "offload_quarter": "offload the first quarter of the blocks' activations to the host instead of recomputing",
    "offload_half": "offload the first half of the blocks' activations to the host instead of recomputing",
    "offload_all": "offload every block's activations but the last's to the host instead of recomputing",
    "no_offload": "recompute the offloaded blocks instead of offloading them",
    "flat_sharding": "shard over every rank (no replicas) instead of within each node",
    "block_compile": "compile block by block instead of the whole model",
    "no_optimizer_in_backward": "update after the backward instead of inside it",
    "clip_grad_norm": "clip the gradients by their global norm",
    "optimizer_in_backward_clipped": "update inside the backward, clipped by the global norm",
    "reverse_bucket_order": "fill the buckets in reverse registration order instead of the backward's order",
    "bf16_reduce": "communicate the gradients in bf16",
    "grad_dtype_reduce": "communicate the gradients in their own dtype instead of bf16",
}


def change_label(name: str) -> str:
    """What the ablation ``name`` changes, in words (:data:`ABLATION_LABELS`); the name itself if unknown."""
    return ABLATION_LABELS.get(name, name)


#: Per field, whether a recipe's value is an option of stock PyTorch (a dtype, a ``torch.utils.checkpoint``
#: policy, a ``torch.compile`` scope, an AdamW flag, SDPA, FSDP2, torch DDP and its bucket size, order and
#: bf16 compression hook, ``clip_grad_norm_``) rather than one of the book's own parts (its Triton attention
#: and fused loss, ``lab.FSDP`` and ``lab.DDPBucketed``, the optimizer inside the backward, offloading).
_STOCK_VALUE = {
    "attention": lambda v: v != "flash_triton",
    "fused_loss": lambda v: not v,
    "sharding": lambda v: v not in OURS and v != "ddp",
    "checkpoint": lambda v: True,
    "compile": lambda v: True,
    "fused_adamw": lambda v: True,
    "precision": lambda v: True,
    "loss_upcast": lambda v: True,
    "optimizer_in_backward": lambda v: not v,
    "offload": lambda v: not v,
    "bucket_mb": lambda v: True,
    "bucket_order": lambda v: v == "ready",
    "reduce_dtype": lambda v: True,
    "clip_grad_norm": lambda v: True,
}


def differences(recipe: Recipe, stock: Recipe) -> list[tuple[str, object, object, bool]]:
    """The fields in which ``recipe`` differs from ``stock`` (both as they run on the same ranks): ``(field,
    recipe's value, stock's value, stock_option)``, ``stock_option`` True where the recipe's value is a choice
    any PyTorch user can make. ``loss_upcast`` is skipped when the recipe fuses the loss (it then has no
    materialized logits to upcast)."""
    out = []
    for f in dataclasses.fields(Recipe):
        if f.name == "name" or (f.name == "loss_upcast" and recipe.fused_loss):
            continue
        ours, theirs = getattr(recipe, f.name), getattr(stock, f.name)
        if ours != theirs:
            out.append((f.name, ours, theirs, _STOCK_VALUE[f.name](ours)))
    return out


def stock_options(recipe: Recipe, stock: Recipe) -> list[str]:
    """The fields of :func:`differences` that are stock PyTorch options: the part of any gain over ``stock``
    that a PyTorch user gets without the book's parts."""
    return [field for field, _, _, option in differences(recipe, stock) if option]


def _in_backward(recipe: Recipe) -> dict:
    """The change that turns on the optimizer inside the backward: with the blocks compiled one by one where
    the recipe compiles the whole model (see the module docstring)."""
    return dict(optimizer_in_backward=True, **(dict(compile="block") if recipe.compile in WHOLE_MODEL else {}))


def ablations(recipe: Recipe = PROJECT) -> list[Recipe]:
    """``recipe`` with each optimization switched off (or, for the attention, swapped) alone, named by what
    changes (:data:`ABLATION_LABELS` says it in words): ``no_flash_attention`` (SDPA instead of the Triton
    kernels) or ``flash_triton_attention`` (the other way round), ``no_fused_loss``, ``full_recompute``,
    ``save_attention_only`` (the smaller checkpointing policy), ``no_compile``, ``foreach_adamw``,
    ``fp32_master_weights``, and some switched on: ``optimizer_in_backward`` (each block's AdamW update runs
    as soon as its gradients are final, :class:`lab.parallel.optimizer_in_backward.OptimizerInBackward`; where
    the whole model is compiled, compiled block by block instead: read it against ``block_compile`` of
    :func:`overlap_ablations`); where the whole model is compiled, ``cuda_graphs`` (captured in CUDA graphs);
    where blocks are checkpointed, ``offload_quarter``, ``offload_half`` and ``offload_all`` (the first quarter
    or half of the blocks, or every block but the last, offloaded instead of recomputed: at the leaderboard's
    32k tokens a block saves several GiB, and the host's memory may hold only the quarter; those the recipe has
    are skipped) and, where the recipe offloads, ``no_offload``; under HSDP ``flat_sharding`` (lab.FSDP over
    every rank)."""
    out = []
    attention = (("no_flash_attention", dict(attention="sdpa")) if recipe.attention == "flash_triton" else
                 ("flash_triton_attention", dict(attention="flash_triton")))
    switches = (attention, ("no_fused_loss", dict(fused_loss=False)), ("full_recompute", dict(checkpoint="block")),
                ("save_attention_only", dict(checkpoint="save_attention")), ("no_compile", dict(compile="none")),
                ("foreach_adamw", dict(fused_adamw=False)), ("fp32_master_weights", dict(precision="bf16_autocast")),
                ("optimizer_in_backward", _in_backward(recipe)),
                ("cuda_graphs", dict(compile="model_cudagraphs")),
                ("offload_quarter", dict(offload=0.25)), ("offload_half", dict(offload=0.5)),
                ("offload_all", dict(offload=1.0)), ("no_offload", dict(offload=0.0)),
                ("flat_sharding", dict(sharding="fsdp")))
    for name, change in switches:
        if recipe.checkpoint == "none" and (change.get("checkpoint") or change.get("offload")):
            continue  # nothing is recomputed: no checkpointing to switch off or to replace by offloading
        if name == "cuda_graphs" and recipe.compile != "model":
            continue  # CUDA graphs capture a whole compiled model
        if name == "flat_sharding" and recipe.sharding != "hsdp":
            continue  # only hybrid sharding has replicas to give up
        if any(getattr(recipe, k) != v for k, v in change.items()):
            _append_valid(out, recipe, name, change)
    return out


def _append_valid(out: list[Recipe], recipe: Recipe, name: str, change: dict) -> None:
    """``recipe`` with ``change`` appended to ``out``, unless the recipe's other choices refuse the change (the
    optimizer inside the backward beside stock FSDP2, offloading beside data parallelism, clipping lab.FSDP's
    shards: :class:`Recipe` says why)."""
    try:
        out.append(dataclasses.replace(recipe, name=name, **change))
    except ValueError:
        pass


def overlap_ablations(recipe: Recipe) -> list[Recipe]:
    """The choices that hide the optimizer and the gradients' communication behind the backward (the module
    docstring), each switched on or off alone where ``recipe`` admits it (``optimizer_in_backward`` itself is
    one of :func:`ablations`): ``block_compile`` (where the whole model is compiled: the step that
    ``optimizer_in_backward`` changes), ``no_optimizer_in_backward`` (where the recipe has it),
    ``clip_grad_norm`` (at 1.0, where the recipe does not clip and can) and, where the recipe updates after the
    backward, ``optimizer_in_backward_clipped`` (both); under ``ddp`` ``reverse_bucket_order``, and under data
    parallelism ``bf16_reduce`` (or ``grad_dtype_reduce``) where the gradients are not bf16 already.
    :func:`compared_with` names the step each is read against."""
    switches = []
    if recipe.compile in WHOLE_MODEL:
        switches.append(("block_compile", dict(compile="block")))
    if recipe.optimizer_in_backward:
        switches.append(("no_optimizer_in_backward", dict(optimizer_in_backward=False)))
    clip = dict(clip_grad_norm=recipe.clip_grad_norm or 1.0)
    switches.append(("clip_grad_norm", clip))
    if not recipe.optimizer_in_backward:
        switches.append(("optimizer_in_backward_clipped", {**clip, **_in_backward(recipe)}))
    if recipe.sharding == "ddp":
        switches.append(("reverse_bucket_order", dict(bucket_order="reverse")))
    if recipe.sharding in DATA_PARALLEL and recipe.precision != "bf16":
        switches.append(("grad_dtype_reduce", dict(reduce_dtype="grad")) if recipe.reduce_dtype == "bf16" else
                        ("bf16_reduce", dict(reduce_dtype="bf16")))
    out = []
    for name, change in switches:
        if any(getattr(recipe, k) != v for k, v in change.items()):
            _append_valid(out, recipe, name, change)
    return out


def compared_with(ablation: Recipe, base: Recipe) -> str:
    """The name of the step an ablation of ``base`` is read against, so that each reading changes one choice:
    the base's own (``base.name``), except for the optimizer inside the backward where it also compiles the
    blocks one by one (``block_compile``) and the clipped update inside the backward, whose reading is the
    cost of clipping there (``optimizer_in_backward``)."""
    if ablation.name == "optimizer_in_backward_clipped":
        return "optimizer_in_backward"
    if ablation.name == "optimizer_in_backward" and base.compile in WHOLE_MODEL:
        return "block_compile"
    return base.name
