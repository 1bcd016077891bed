"""``python -m scdviz``: the command line (scdviz.cli)."""

import sys

from scdviz.cli import main

if __name__ == "__main__":
    sys.exit(main())
