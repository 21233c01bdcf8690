"""The book's experiments: each module measures one notebook's subject with the shared parts
(``lab.measure`` for timing, phases, memory and results; ``lab.model``; ``lab.kernels``; ``lab.parallel``)
and returns tables. ``python -m lab.bench`` is the language-model benchmark CLI.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
