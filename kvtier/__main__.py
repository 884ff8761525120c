"""``python -m kvtier``: the command-line interface (same as the ``kvtier`` command)."""

import sys

from kvtier.cli import main

sys.exit(main())
