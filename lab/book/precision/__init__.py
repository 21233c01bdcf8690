"""Notebook 02, mixed precision: its settings and answers (`present`); the experiments it runs are
`lab.measure.numerics` and the `lab.bench.lm` sweep.
"""
