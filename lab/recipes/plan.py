"""Which recipes a render of the fastest step measures (notebook 10, ``python -m lab.fastest``): the book's
recipe, the stock steps and the ablations asked for, and what a render carries from the last one instead of
measuring it again, so that a machine too small for a configuration's every recipe in one call measures them in
two."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pandas as pd

from lab.recipes.fastest_step import CONFIGS, HEADLINE, StepConfig, ablation_base, ablations, recipes_for

#: The ablations the quick (CPU) book runs: interpreted Triton takes seconds a step.
QUICK_ABLATIONS = ("flash_triton_attention", "no_fused_loss")


def recipes(config: StepConfig, quick: bool, ablate: bool | Sequence[str] | Mapping = True) -> list:
    """The book's recipe, both stock steps and each optimization switched off alone where ``ablate`` says so:
    True or False for every configuration, a list of the configurations to ablate, or a mapping from
    configuration to True or the names of its ablations (``{"leaderboard": ["no_fused_loss"]}``). On the
    CPU (``quick``) nothing is compiled (inductor's C++ compile would take longer than the whole quick book), so
    the stock compiled steps, which would run eagerly under their name, are left out, and only the attention's
    and the loss's ablations run."""
    every = ablations(recipes_for(config)["project"])
    if isinstance(ablate, str) or not isinstance(ablate, (bool, Sequence, Mapping)):
        raise ValueError(f"ablate must be True, False, a list of configuration names or a mapping, got {ablate!r}")
    names = ablate if isinstance(ablate, (bool, Mapping)) else dict.fromkeys(ablate, True)
    if isinstance(names, Mapping):
        unknown = sorted(set(names) - set(CONFIGS))
        if unknown:
            raise ValueError(f"ablate names unknown configurations {unknown}; known: {sorted(CONFIGS)}")
        names = names.get(config.name, False)
    if isinstance(names, bool):
        chosen = every if names else []
    else:
        known = [r.name for r in every]
        if isinstance(names, str) or set(names) - set(known):
            raise ValueError(f"ablations of {config.name} are among {known}, got {names!r}")
        chosen = [r for r in every if r.name in names]
    out = list(recipes_for(config).values()) + chosen
    if quick:  # interpreted Triton takes seconds a step: the three headline steps and the Triton attention
        out = [dataclasses.replace(r, compile="none") for r in out
               if (r.name in HEADLINE and r.compile == "none") or r.name in QUICK_ABLATIONS
               or r.name == "project"]
    return out


def _ablations_only(chosen: list) -> list:
    """The ablations among ``chosen``, led by the book's step again (``ablation_base``); none if it has none."""
    rest = [r for r in chosen if r.name not in HEADLINE]
    return [ablation_base(next(r for r in chosen if r.name == "project")), *rest] if rest else []


def _carry_entries(configs: Sequence[str], carry: Sequence[str]) -> dict[str, str]:
    """``carry``'s entries as configuration -> ``"all"`` (``"name"``) or ``"headline"`` (``"name:headline"``)."""
    if isinstance(carry, str):
        raise ValueError(f"carry must be a list of configuration names, got {carry!r}")
    out = {}
    for entry in carry:
        name, _, part = entry.partition(":")
        if name not in configs or part not in ("", "headline"):
            raise ValueError(f"carry entries are a configuration of this render ({', '.join(configs)}), alone or "
                             f"with ':headline', got {entry!r}")
        out[name] = part or "all"
    return out


def measured_recipes(configs: Sequence[str], carry: Sequence[str], quick: bool,
                     ablate: bool | Sequence[str] | Mapping = True) -> dict[str, list]:
    """What this render measures, per configuration (:func:`recipes`), given what it carries from the last
    render: nothing of a configuration carried whole (``"leaderboard"``); of one whose headline rows are
    carried (``"leaderboard:headline"``), its ablations with the book's step measured again beside them
    (``ablation_base``), so that a machine too small for a configuration's every recipe in one call measures
    them in two."""
    parts = _carry_entries(configs, carry)
    out = {}
    for name in configs:
        chosen = recipes(CONFIGS[name], quick, ablate)
        if parts.get(name) == "headline":
            chosen = _ablations_only(chosen)
        if parts.get(name) != "all" and chosen:
            out[name] = chosen
    return out


def host_ablations(configs: Sequence[str], quick: bool, ablate: bool | Sequence[str] | Mapping = True) -> dict:
    """The ablations to time a second time with the host busy: those of the one-GPU configurations among
    ``configs``, led by the book's step again (``ablation_base``), whose steps of tens of milliseconds the host's
    launches can set (a step of seconds on several GPUs is the GPUs' own, and a second pass would cost minutes)."""
    out = {}
    for name in configs:
        chosen = _ablations_only(recipes(CONFIGS[name], quick, ablate)) if CONFIGS[name].world_size == 1 else []
        if chosen:
            out[name] = chosen
    return out


def carried_rows(saved: pd.DataFrame, configs: Sequence[str], carry: Sequence[str]) -> pd.DataFrame:
    """The rows of the last render that ``carry`` keeps (see :func:`measured_recipes`)."""
    parts = _carry_entries(configs, carry)
    whole = saved["config"].map(parts).eq("all")
    headline = saved["config"].map(parts).eq("headline") & saved["impl"].isin(HEADLINE)
    return saved[whole | headline]
