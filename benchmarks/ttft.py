"""Run ``kvtier bench ttft`` from a checkout: ``python benchmarks/ttft.py [--quick] [options]``.

Results go to benchmarks/results/ (see kvtier/bench/ttft.py for what is measured and how).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.bench import ttft


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/ttft.py", description=ttft.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ttft.add_arguments(parser)
    return ttft.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
