"""Notebook 09, accounting in closed form: the tables it computes and checks (`bench`), the XXL and TPU questions
(`xxl`), equations and sentences (`present`).
"""
