"""Notebook 10, the fastest step: the recipes run side by side and profiled by phase (`bench`, which `python -m
lab.fastest` drives), the fused loss against its peers (`fused_loss`), like-for-like goal verdicts (`compare`),
tables, plots and sentences (`present`).
"""
