"""Notebook 03, where memory goes: the model and batch being studied (`workload`), snapshots, timelines, saved
tensors and checkpointing measured (`bench`), the snapshot pages (`snapshot_pages`), tables and sentences
(`present`).
"""
