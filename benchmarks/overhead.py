"""Run ``kvtier bench overhead`` from a checkout: ``python benchmarks/overhead.py [--quick] [options]``.

The same as ``kvtier bench overhead [options]`` (this checkout's kvtier, its parser and its error handling: a bad
option is one line and exit 2). Results go to benchmarks/results/ under the current directory, or ``--out DIR``
(see kvtier/bench/overhead.py for what is measured and how).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.ops.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "overhead", *sys.argv[1:]]))
