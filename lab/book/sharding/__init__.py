"""Notebook 08, sharding: what a render measures (`bench`: optimizer-state sharding, ZeRO-1 and FSDP against
torch's, through :mod:`lab.bench.sharding`), and its tables, plots and claims (`present`).
"""
