"""Benchmarks a user runs from the command line and the measuring parts the book's chapters share:
``python -m lab.bench`` times a Transformer LM (:mod:`lab.bench.lm`, :mod:`lab.bench.cli`); the data-parallel
wrappers against torch DDP (``python -m lab.bench.ddp``) and sharding against DDP, ZeRO and FSDP
(``python -m lab.bench.sharding``), with what they share (:mod:`lab.bench.distributed`) and the bytes each
sharding schedule sends (:mod:`lab.bench.traffic`); interleaved timing of several implementations in the same
processes (:mod:`lab.bench.interleaved`); the CPU memory pre-check every command line runs before it starts
(:mod:`lab.bench.memory_estimate`); progress lines (:mod:`lab.bench.progress`). What a chapter alone does with
them (its plan, tables, plots and claims) lives with the chapter, in ``lab.book.<chapter>``.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
