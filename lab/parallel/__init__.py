"""Parallelism, applied from outside the model: the process launcher, collective primitives, four
data-parallel wrappers, optimizer-state sharding, ZeRO-1 and FSDP.

One file per idea, each readable top to bottom (picotron style): ``launcher`` (run a function on N ranks,
spawned or under torchrun), ``collectives`` (the primitives and their bandwidth arithmetic), ``ddp``,
``sharded_optimizer``, ``zero1``, ``fsdp``.

May import: torch, ``lab.measure``, ``lab.accounting`` (the collective cost model).
"""
