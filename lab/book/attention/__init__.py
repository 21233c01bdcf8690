"""Notebook 04, attention: the naive attention grid and compile study (`bench`), its closed-form costs (`costs`),
tables and sentences (`present`).
"""
