"""Notebook 05, FlashAttention in Triton: correctness and speed against SDPA's backends and FlexAttention
(`bench`), the backward's variant sweep and cost breakdown (`sweep`, also `python -m lab.book.flash.sweep`), the
host's share of a short sequence's time (`host`), the comparisons and goals (`goals`), each missed goal against
a measured bound (`bounds`), the grid's tables (`grid`), how the compiled kernels wait for their products
(`schedule`) and the chapter's sentences (`present`).
"""
