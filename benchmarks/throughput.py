"""Run ``kvtier bench throughput`` from a checkout: ``python benchmarks/throughput.py [--quick] [options]``.

Results go to benchmarks/results/ (see kvtier/bench/throughput.py for what is measured and how).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.bench import throughput


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/throughput.py", description=throughput.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(parser)
    return throughput.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
