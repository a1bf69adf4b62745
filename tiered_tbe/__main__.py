"""``python -m tiered_tbe``: the ``tiered-tbe`` command."""

import sys

from tiered_tbe.cli import main

if __name__ == "__main__":
    sys.exit(main())
