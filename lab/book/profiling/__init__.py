"""Notebook 01, profiling a Transformer step: the kernel profiles (`kernels`), the warm-up study (`warmup`) and
the chapter's tables, plots and sentences (`present`). Its timings come from `lab.bench.lm`.
"""
