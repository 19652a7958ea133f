"""``python -m torchpmap.bench``: see :mod:`torchpmap.bench.cli`."""

import sys

from torchpmap.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
