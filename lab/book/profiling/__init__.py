"""Notebook 01, profiling a Transformer step: the sweep's settings and answers (`present`), the warm-up study
(`warmup`) and the kernel profiles (`kernels`, taken by `lab.bench.profiles`). Its timings come from `lab.bench.lm`.
"""
