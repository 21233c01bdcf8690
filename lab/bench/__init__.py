"""Benchmarks a user runs from the command line and the measuring parts the book's chapters share:
``python -m lab.bench`` times a Transformer LM (:mod:`lab.bench.lm`, :mod:`lab.bench.cli`); interleaved timing
of several implementations in the same processes (:mod:`lab.bench.interleaved`); the CPU memory pre-check
every command line runs before it starts (:mod:`lab.bench.memory_estimate`); progress lines
(:mod:`lab.bench.progress`); attention implementations checked against float64 and timed over a grid of shapes
(:mod:`lab.bench.attention_grid`), and the Triton FlashAttention kernels' variants, compile reports and the
course's timing test (:mod:`lab.bench.flash_variants`). A chapter's own experiments live with the chapter, in
``lab.book.<chapter>``.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
