"""Notebook 04, attention: the naive attention grid and compile study (`bench`), its closed-form costs (`costs`),
the grid's tables and sentences (`present`) and the whole model eager against compiled (`whole_model`).
"""
