"""The lab book's own machinery: rendering notebooks with papermill, the provenance banner and the answers
box, prose generated from result tables, render-time consistency checks, one plotting style, and one
presentation module per notebook (its tables, plots and sentences, tested apart from the notebook).

May import: any other ``lab`` subpackage (it presents what ``lab.bench`` measures), pandas, matplotlib,
seaborn. Nothing in ``lab`` imports it.
"""
