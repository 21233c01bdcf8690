"""Notebook 03, where memory goes: the setup (`workload`), its experiments (`bench`; the measuring is
:mod:`lab.bench.memory` and :mod:`lab.measure`), and its tables, figures and claims (`present`)."""
