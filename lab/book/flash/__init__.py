"""Notebook 05, FlashAttention in Triton: correctness and speed against SDPA's backends and FlexAttention
(`bench`), the backward's variant sweep and cost breakdown (`sweep`, also `python -m lab.book.flash.sweep`), the
host's share of a short sequence's time (`host`), the grid's tables and goals (`grid`) and the chapter's
sentences (`present`).
"""
