"""How much memory one benchmark step needs on the CPU, before it runs, and what change would make it fit.

On the CPU an allocation that does not fit is not an error the benchmark could turn into an ``oom`` row: the
operating system kills the process. So the command lines refuse a configuration whose estimate exceeds the
available memory, and the estimate must not under-count.

:func:`lab.accounting.training_memory` counts what a step *keeps* (parameters, gradients, AdamW's moments,
the activations autograd saves). The peak also holds temporaries that live between two operations, and on
the CPU (no kernel fuses them) the large ones are vocabulary- or score-sized:

* the LM head: the forward holds the logits (and under autocast their fp32 copy) while their log-softmax
  (saved) is made; the backward holds the log-softmax's saved output, the loss's gradient with respect to
  it and the gradient of the logits, all ``tokens x vocab`` in fp32 (log-softmax runs in fp32 under
  autocast too);
* naive attention (it materializes the scores): the scaled scores, their masked copy and the causal mask
  while the saved probabilities are made in the forward, and the gradients of the probabilities and of the
  scores in the backward, each ``batch x heads x T x T`` per block.

:func:`cpu_peak_bytes` adds those to the kept state. :func:`measured_cpu_peak_bytes` measures the same peak
(the profiler's memory timeline of one step) so the tests can hold the estimate to a real step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lab.accounting import BENCH_DTYPE_TO_POLICY, policy, training_memory
from lab.measure.step import TrainStep, make_optimizer, random_batch
from lab.model import MODEL_SIZES, QUICK_SIZES, ModelConfig, TransformerLM, config_for

GiB = 2**30
#: Bytes of the small temporaries (the loss and other scalars, per-row statistics) beside the large ones.
SMALL_TEMPORARIES = 2**20
#: Fraction of the available memory a step may plan to use (the rest: Python, the allocator, the page cache).
HEADROOM = 0.9


def transient_bytes(cfg: ModelConfig, batch: int, context: int, dtype: str, mode: str) -> int:
    """Bytes of the temporaries the kept-state accounting leaves out (see the module): the LM head's
    vocabulary-sized tensors and, for naive attention, the score-sized ones of one block."""
    tokens = batch * context
    act = policy(BENCH_DTYPE_TO_POLICY[dtype]).activation
    backward = mode != "forward"
    # forward: the logits beside their saved fp32 log-softmax (under autocast also the logits' fp32 copy, the
    # log-softmax's input; 2 + 4 bytes, rounded up to 8 to cover the smaller temporaries beside them);
    # backward: two fp32 gradients of vocabulary size
    head = 0 if cfg.fused_loss else tokens * cfg.vocab_size * (8 if backward or act < 4 else act)
    scores = 0
    if cfg.attention == "naive":
        per_score = batch * cfg.num_heads * context * context
        # forward: scaled scores and their masked copy (compute dtype), mask and its negation (bool);
        # backward: the gradients of the probabilities and of the scores
        scores = per_score * (2 * act + 2) + (2 * per_score * act if backward else 0)
    return head + scores + SMALL_TEMPORARIES


def cpu_peak_bytes(cfg: ModelConfig, batch: int, context: int, dtype: str, mode: str) -> int:
    """Estimated peak bytes of one ``mode`` step (``forward``, ``forward_backward``, ``train_step``) of
    ``TransformerLM(cfg)`` on the CPU at ``dtype`` (``fp32``, or autocast ``bf16``/``fp16``): the kept state
    of :func:`lab.accounting.training_memory` (gradients and activations both counted, as their ends of the
    backward overlap on the CPU) plus :func:`transient_bytes`."""
    kept = training_memory(cfg, batch, context, BENCH_DTYPE_TO_POLICY[dtype], mode, device_type="cpu")["total"]
    return int(kept + transient_bytes(cfg, batch, context, dtype, mode))


@dataclass(frozen=True)
class FitAdvice:
    """Whether a CPU step fits: ``need`` and ``available`` bytes, and the changes that would make it fit
    (``max_context``, ``max_batch``: the largest that fit, 0 if none; ``smaller_sizes``: size names that fit)."""

    need: int
    available: int
    max_context: int
    max_batch: int
    smaller_sizes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        """True when the estimate is within :data:`HEADROOM` of the available memory."""
        return self.need <= HEADROOM * self.available

    def change(self) -> str:
        """The changes that would fit, as command-line advice (empty if nothing on this CPU would)."""
        options = []
        if self.max_context:
            options.append(f"--context {self.max_context} or shorter")
        if self.max_batch:
            options.append(f"--batch {self.max_batch}" + (" or smaller" if self.max_batch > 1 else ""))
        if self.smaller_sizes:
            options.append(f"--size {self.smaller_sizes[-1]} or smaller")
        return "; ".join(options) if options else "no smaller context, batch or size fits: use a GPU"


def _largest(fits, high: int) -> int:
    """The largest n in [1, high) with ``fits(n)`` (monotone), 0 if none."""
    low, high = 0, high  # fits(low) holds (vacuously at 0), fits(high) does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def fit_advice(size: str | None, cfg: ModelConfig, batch: int, context: int, dtype: str, modes: Sequence[str],
               available: int) -> FitAdvice:
    """:class:`FitAdvice` for the largest of ``modes`` at ``context`` and ``batch``; ``size`` (a size name, or
    None for an explicit configuration) lets it also try the smaller named sizes."""
    budget = HEADROOM * available

    def need(c: ModelConfig, b: int, t: int) -> int:
        return max(cpu_peak_bytes(c, b, t, dtype, m) for m in modes)

    total = need(cfg, batch, context)
    if total <= budget:
        return FitAdvice(total, available, context, batch, ())
    max_context = _largest(lambda t: need(cfg, batch, t) <= budget, context)
    max_batch = _largest(lambda b: need(cfg, b, context) <= budget, batch)
    order = [*QUICK_SIZES, *MODEL_SIZES]
    smaller = ()
    if size in order:
        smaller = tuple(s for s in order[:order.index(size)]
                        if need(config_for(s, context_length=context, attention=cfg.attention), batch,
                                context) <= budget)
    return FitAdvice(total, available, max_context, max_batch, smaller)


def measured_cpu_peak_bytes(cfg: ModelConfig, batch: int, context: int, dtype: str, mode: str, seed: int = 0) -> int:
    """Peak bytes of live tensors during one ``mode`` step of ``TransformerLM(cfg)`` on the CPU, from the
    profiler's memory timeline (parameters and AdamW state included; a warm-up step runs first so the
    optimizer's moments exist). Small configurations only: it profiles a real step."""
    from torch.profiler._memory_profiler import Action, TensorKey  # the profiler's memory timeline


    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    optimizer = make_optimizer(model, "cpu") if mode == "train_step" else None
    tokens, targets = random_batch(cfg, batch, "cpu", context, seed=seed)
    step = TrainStep(model, optimizer, tokens, targets, dtype=dtype, device="cpu")
    run = {"forward": step.forward, "forward_backward": step.forward_backward, "train_step": step}[mode]
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        out = run()
        del out
    live, peak, sizes = 0, 0, {}
    for _, action, (key, version), size in prof._memory_profile().timeline:
        if not isinstance(key, TensorKey):
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            sizes[(key, version)] = size
            live += size
        elif action == Action.DESTROY:
            live -= sizes.pop((key, version), 0)
        elif action == Action.INCREMENT_VERSION and (key, version) in sizes:
            sizes[(key, version + 1)] = sizes.pop((key, version))
        peak = max(peak, live)
    return peak
