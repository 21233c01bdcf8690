"""Notebook 06, communication: the collective grid it measures and its tables, plots and claims (`present`);
the benchmark itself is `lab.bench.collectives`.
"""
