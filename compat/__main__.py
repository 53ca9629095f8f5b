"""``python -m leanstate``: the command line (``leanstate._tools.cli``)."""

import sys

from leanstate._tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
