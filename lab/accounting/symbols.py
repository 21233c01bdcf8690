"""The symbols and units every closed form of :mod:`lab.accounting` shares.

Units: bytes, FLOPs, seconds, bytes/s, FLOP/s. ``B`` is a number of *tokens* (batch x sequence). For
collectives ``S`` is the size in bytes of the full array, ``N`` the number of devices on the ring, ``W`` the
bytes/s each device can send (its egress bandwidth), ``alpha`` a per-step latency.
"""

from __future__ import annotations

import sympy as sp

from lab.units import GB, GiB  # noqa: F401 (re-exported: the closed forms' units)

S, N, W, alpha = sp.symbols("S N W alpha", positive=True)
B, D, F, L, V, H, T = sp.symbols("B D F L V H T", positive=True)
C, p = sp.symbols("C p", positive=True)  # FLOP/s per device; bytes per communicated element
X, Y, W_X, W_Y, M_X, M_Y, W_ici = sp.symbols("X Y W_X W_Y M_X M_Y W_ici", positive=True)

HALF = sp.Rational(1, 2)  # FSDP shards every other layer's activations


def as_float(expr, **values) -> float:
    """Evaluate a sympy expression to a float after substituting ``values`` (symbol name -> number)."""
    expr = sp.sympify(expr)
    subs = {sym: values[sym.name] for sym in expr.free_symbols if sym.name in values}
    out = expr.subs(subs)
    if out.free_symbols:
        raise ValueError(f"no value given for {sorted(s.name for s in out.free_symbols)}")
    return float(out)


