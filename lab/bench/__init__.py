"""Benchmarks a user runs from the command line and the measuring parts the book's chapters share:
``python -m lab.bench`` times a Transformer LM (:mod:`lab.bench.lm`, :mod:`lab.bench.cli`) and profiles each mode of
its step (:mod:`lab.bench.profiles`); the attention implementations and the naive attention grid
(:mod:`lab.bench.attention`), checked against float64 and timed over a grid of shapes
(:mod:`lab.bench.attention_grid`), and the Triton FlashAttention kernels' variants, compile reports and the course's
timing test (:mod:`lab.bench.flash_variants`; ``python -m lab.bench.flash_sweep`` sweeps them); where a model's
training memory goes: snapshots, peaks and checkpointing (:mod:`lab.bench.memory`), and the closed forms of
:mod:`lab.accounting` against measured memory (:mod:`lab.bench.predicted_memory`); collectives over gloo or NCCL
(``python -m lab.bench.collectives``); the data-parallel wrappers against torch DDP (``python -m lab.bench.ddp``)
and sharding against DDP, ZeRO and FSDP (``python -m lab.bench.sharding``), with what they share
(:mod:`lab.bench.distributed`) and the bytes each sharding schedule sends (:mod:`lab.bench.traffic`); the book's
fastest step against stock PyTorch (:mod:`lab.bench.fastest`, ``python -m lab.fastest``) and the LM-head loss
(``python -m lab.bench.fused_loss``); the optimizer inside the backward and data parallelism's hidden communication,
the recipes' switches for both (``python -m lab.bench.overlap``); interleaved timing of several implementations in
the same processes (:mod:`lab.bench.interleaved`); the CPU memory pre-check every command line runs before it starts
(:mod:`lab.bench.memory_estimate`); progress lines (:mod:`lab.bench.progress`). What a chapter alone does with them
(its plan, tables, plots and claims) lives with the chapter, in ``lab.book.<chapter>``.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
