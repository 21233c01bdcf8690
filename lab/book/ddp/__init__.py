"""Notebook 07, data parallelism: the DDP wrappers against torch DDP, overlap and the bucket model (`bench`),
tables, goals and sentences (`present`).
"""
