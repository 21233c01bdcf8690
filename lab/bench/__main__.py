"""``python -m lab.bench``: time a Transformer LM (see ``lab.bench.lm``)."""

from lab.bench.lm import main

main()
