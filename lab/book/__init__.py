"""The lab book's own machinery: rendering notebooks with papermill, the provenance banner, prose
generated from result tables, and the one plotting style.

May import: ``lab.measure`` (results, verdicts), ``lab.paths``, pandas, matplotlib, seaborn.
"""
