"""Notebook 02, mixed precision: the accumulation and autocast experiments (`bench`) and their tables, plot and
sentences (`present`).
"""
