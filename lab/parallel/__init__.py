"""Parallelism, applied from outside the model: the process launcher, collective primitives, four
data-parallel wrappers, optimizer-state sharding, ZeRO-1, FSDP and the optimizer step inside the backward.

One file per idea, each readable top to bottom (picotron style): ``launcher`` (run a function on N ranks, spawned or
under torchrun; ``forking``: its CPU ranks as forks of a server that has imported torch), ``runner`` (several items
measured on the ranks of a launch, one item's failure a row), ``collectives`` (the primitives and their bandwidth
arithmetic), ``process_groups`` (which ranks a wrapper talks to: a group, a DeviceMesh or the default group),
``ddp`` (with ``buckets``, its flat gradient buffers), ``sharded_optimizer``, ``zero1``, ``fsdp`` (with
``fsdp_layout``, its data, and ``fsdp_grads``, its gradient collectives, hybrid sharding included),
``optimizer_in_backward`` (each group of parameters updated as soon as its gradients are final: alone, after
DDPBucketed's all-reduce or after FSDP's reduce-scatter).

May import: torch, ``lab.measure``, ``lab.accounting`` (the collective cost model).
"""
