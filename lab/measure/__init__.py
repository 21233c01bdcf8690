"""Measurement: the one timer, the one phased training step, device facts, profiler traces turned into
timelines and overlap, memory snapshots and saved-tensor accounting, the results store with provenance,
the noise-aware verdicts every comparison uses, and what a floating-point format does to a computation
(:mod:`lab.measure.numerics`).

Everything here takes any ``nn.Module`` or callable; nothing knows which model it measures.

May import: torch, pandas, numpy, and the leaves ``lab.paths``, ``lab.dtypes``, ``lab.units``.
"""
