"""Notebook 08, sharding: optimizer-state sharding, ZeRO-1 and FSDP against torch's (`bench`), the bytes each step
sends (`traffic`), tables, goals and sentences (`present`).
"""
