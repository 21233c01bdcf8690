"""Parallelism arithmetic in closed form (sympy): memory, FLOPs, the collective cost model, the XXL and
TPU questions, DP/FSDP/TP limits, and a step-by-step ring simulator that checks the closed forms.

Formulas take numbers, sympy symbols or any object with a model config's fields; nothing here builds or
runs a model (measured-vs-predicted checks live in ``lab.bench``).

May import: sympy, numpy, pandas. Nothing else from ``lab``.
"""
