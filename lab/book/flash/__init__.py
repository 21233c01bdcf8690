"""Notebook 05, FlashAttention in Triton: its measurements (`bench`; the timing itself is lab.bench.attention_grid),
its answers as claims about correctness, the course's test and the model (`present`), the grid (`grid`) and the
goals with what bounds them (`goals`). The kernels' variant sweep from the command line is lab.bench.flash_sweep.
"""
