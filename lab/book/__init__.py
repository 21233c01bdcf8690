"""The lab book: one package per chapter, and the machinery they share.

Each chapter (``profiling`` 01, ``precision`` 02, ``memory`` 03, ``attention`` 04, ``flash`` 05,
``communication`` 06, ``ddp`` 07, ``sharding`` 08, ``accounting`` 09, ``fastest`` 10) holds everything its
notebook does that is not a parameter or a call: its experiment plan and the orchestration of its measurements
(``bench`` and its siblings) and its tables, plots and sentences (``present``), tested apart from the notebook.
Adding or changing a chapter touches that package, its tests (``tests/book/<chapter>/``) and its notebook.

The shared machinery: rendering notebooks with papermill (:mod:`lab.book.render`), the provenance banner, the
answers box and number formats (:mod:`lab.book.report`), render-time consistency checks
(:mod:`lab.book.consistency`) and one plotting style (:mod:`lab.book.plots`).

May import: any other ``lab`` subpackage (it measures with the engine and presents what it measured), pandas,
matplotlib, seaborn. Nothing in ``lab`` imports it but the command lines that render or run the book
(``lab.render``, ``lab.fastest``).
"""
