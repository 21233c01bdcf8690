"""Parallelism arithmetic in closed form (sympy): memory, FLOPs, the collective cost model, the XXL and
TPU questions, DP/FSDP/TP limits, and a step-by-step ring simulator that checks the closed forms.

Modules: ``attention`` (attention's FLOPs and memory), ``symbols`` (shared symbols and units),
``transformer`` (memory and FLOPs of the book's model), ``collectives`` (the one ring cost model),
``parallelism`` (one FFN under DP/FSDP/TP, the XXL model, TPU v5p), ``xxl`` (the XXL questions as tables),
``ring_sim`` (the simulator). Formulas take numbers, sympy symbols or any object with a model config's
fields; nothing here builds or runs a model (measured-vs-predicted checks live in
``lab.bench.predicted_memory``). Their public names are importable from ``lab.accounting`` directly.

May import: sympy, numpy, pandas, torch (for dtype sizes), and the leaves ``lab.units`` and ``lab.dtypes``.
Nothing else from ``lab``.
"""

from lab.accounting.collectives import *  # noqa: F401,F403
from lab.accounting.parallelism import *  # noqa: F401,F403
from lab.accounting.symbols import *  # noqa: F401,F403
from lab.accounting.transformer import *  # noqa: F401,F403
from lab.accounting.xxl import *  # noqa: F401,F403
