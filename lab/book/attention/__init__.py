"""Notebook 04, attention: the naive attention grid's answers, tables and plots (`present`; the grid itself is
:func:`lab.bench.attention.run_naive_grid`) and the whole model eager against compiled (`whole_model`).
"""
