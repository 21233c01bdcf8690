"""Recipes: training steps composed from the book's own parts (kernels, parallelism, checkpointing,
compilation), each switchable so that every optimization can be measured on and off.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
