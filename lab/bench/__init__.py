"""Benchmarks a user runs from the command line and the measuring parts the book's chapters share:
``python -m lab.bench`` times a Transformer LM (:mod:`lab.bench.lm`, :mod:`lab.bench.cli`); interleaved timing
of several implementations in the same processes (:mod:`lab.bench.interleaved`); collectives over gloo or
NCCL, ``python -m lab.bench.collectives`` (:mod:`lab.bench.collectives`); the kernel profiles of an LM step,
one per mode (:mod:`lab.bench.profiles`); the CPU memory pre-check
every command line runs before it starts (:mod:`lab.bench.memory_estimate`); progress lines
(:mod:`lab.bench.progress`). A chapter's own experiments live with the chapter, in ``lab.book.<chapter>``.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
