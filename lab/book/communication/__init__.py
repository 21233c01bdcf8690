"""Notebook 06, collectives: bandwidth of all-reduce, all-gather and reduce-scatter (`collectives`, also `python
-m lab.book.communication.collectives`) and the chapter's tables and sentences (`present`).
"""
