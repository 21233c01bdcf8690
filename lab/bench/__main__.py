"""``python -m lab.bench``: time a Transformer LM (see ``lab.bench.cli``)."""

import sys

from lab.bench.cli import main

sys.exit(main())
