"""Recipes: training steps composed from the book's own parts (kernels, parallelism, checkpointing,
compilation), each switchable so that every optimization can be measured on and off: ``recipe`` (the
:class:`~lab.recipes.recipe.Recipe` as data, the book's and the stock recipes, their ablations),
``fastest_step`` (building the step a recipe describes), ``step_parts`` (what the step wraps around the model:
CUDA graphs, offloading, hybrid sharding, data parallelism, clipping) and ``checkpointing``.

May import: every other ``lab`` subpackage except ``lab.book``.
"""
