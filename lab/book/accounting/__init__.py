"""Notebook 09, accounting in closed form: equations, figures and claims (`present`) and the XXL questions (`xxl`),
from the tables of :mod:`lab.accounting` and the measured-against-predicted rows of :mod:`lab.bench.predicted_memory`.
"""
