"""Run ``kvtier bench overhead`` from a checkout: ``python benchmarks/overhead.py [--quick] [options]``.

Results go to benchmarks/results/ (see kvtier/bench/overhead.py for what is measured and how).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.bench import overhead


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/overhead.py", description=overhead.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    overhead.add_arguments(parser)
    return overhead.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
