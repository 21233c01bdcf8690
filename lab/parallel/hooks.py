"""Gradient hooks that hold their owner weakly.

A tensor's hooks (``register_post_accumulate_grad_hook``) are held from C++, in the tensor's autograd
metadata, where Python's cycle collector cannot see them. A hook that holds its wrapper strongly (a bound
method, a closure over ``self``) therefore makes a cycle the collector can never break: parameter -> hook ->
wrapper -> parameter. Dropping every reference to such a wrapper then frees nothing, neither the wrapper nor
its buffers nor the model; in notebook 08, which builds and drops each implementation 36 times a size, that
filled an 80 GB GPU. A weak hook breaks the cycle: once the owner is gone, the hook does nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


def weak_hook(method: Callable, *leading) -> Callable:
    """A hook calling the bound ``method(*leading, *hook_args)`` while its object lives, and doing nothing
    after. ``leading`` must not hold the object (or what holds its parameters) either."""
    # The object by a weak reference and the plain function: a WeakMethod rebuilds a bound method in Python at
    # every call, and a hook runs once per gradient, on the autograd thread.
    owner, func = weakref.ref(method.__self__), method.__func__

    def hook(*args, **kwargs):
        obj = owner()
        if obj is not None:
            return func(obj, *leading, *args, **kwargs)
        return None
    return hook
