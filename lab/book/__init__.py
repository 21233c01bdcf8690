"""The lab book: one package per chapter, and the machinery they share.

Each chapter (``profiling`` 01, ``precision`` 02, ``memory`` 03, ``attention`` 04, ``flash`` 05,
``communication`` 06, ``ddp`` 07, ``sharding`` 08, ``accounting`` 09, ``fastest`` 10) holds what its notebook
does that is not a parameter or a call: its plan, its tables and plots, and its answers stated as claims
(data: the question, the rows compared, the goal), tested apart from the notebook. Chapters are siblings: none
imports another; what two share lives in the engine (``lab.bench``, ``lab.measure``, ...) or here. Adding or
changing a chapter touches that package, its tests (``tests/book/<chapter>/``) and its notebook.

The shared machinery: the provenance banner, the rule and the answers box (:mod:`lab.book.report`); the one
module that says every claim, in numbers as a person writes them and verdicts under the one rule
(:mod:`lab.book.claims`); the ledger that makes two reports of the same measurement agree
(:mod:`lab.book.ledger`); the reader's index (:mod:`lab.book.index`); one plotting style (:mod:`lab.book.plots`).
Running the notebooks with papermill is :mod:`lab.render`'s: it renders the book, it says nothing in it.

May import: any other ``lab`` subpackage (it measures with the engine and presents what it measured), pandas,
matplotlib, seaborn. Nothing in ``lab`` imports it but the command lines that render or run the book
(``lab.render``, ``lab.fastest``).
"""
