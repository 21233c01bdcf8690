"""``python -m lab.render``: render the lab book (see ``lab.book.render``)."""

import sys

from lab.book.render import main

if __name__ == "__main__":
    sys.exit(main())
