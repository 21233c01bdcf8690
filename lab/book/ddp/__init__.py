"""Notebook 07, data parallelism: what a render measures (`bench`: the DDP wrappers against torch DDP, through
:mod:`lab.bench.ddp`), and its tables, plots and claims (`present`: overlap, the bucket model, the goal).
"""
