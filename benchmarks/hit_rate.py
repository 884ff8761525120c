"""Run ``kvtier bench hit-rate`` from a checkout: ``python benchmarks/hit_rate.py [options]``.

With no options it replays the Mooncake conversation trace (``../shared/traces/``) at 5/10/20/40% of its
unique chunks plus a two-tier set-up, for every registered policy, and writes
benchmarks/results/hit_rate_mooncake.json and .png. See kvtier/bench/hitrate.py for the semantics.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.bench import hitrate

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = ["--sweep", "5,10,20,40%", "--tiers", "5%,10%",
            "--json", str(RESULTS / "hit_rate_mooncake.json"), "--plot", str(RESULTS / "hit_rate_mooncake.png")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/hit_rate.py", description=hitrate.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hitrate.add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return hitrate.run(parser.parse_args(argv or DEFAULTS))


if __name__ == "__main__":
    sys.exit(main())
