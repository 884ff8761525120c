"""The save admission before commit 4e6dfee, in today's replay: ``python benchmarks/hit_rate_admission_before.py``.

Until a lag and a window of offers had passed, ``SaveAdmission.matched`` compared a whole window of reuses with
the offers made before the lag (a shorter span); since 4e6dfee both spans are as long. This runs
``kvtier bench hit-rate --engine 10,25,40%`` with the old comparison patched in, and writes
benchmarks/results/hit_rate_admission_before.json, the "before" rows of docs/benchmarks/serve.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.connector.scheduler.admission import SaveAdmission
from kvtier.ops.cli import main

RESULT = Path(__file__).resolve().parent / "results" / "hit_rate_admission_before.json"


def matched_before(self: SaveAdmission, cls: int) -> tuple[int, int]:
    """``SaveAdmission.matched`` as of 7146f2d."""
    now, lag = self._offered, self.lag()
    offered = self._at(now - lag)[0][cls] - self._at(now - lag - self.window)[0][cls]
    reused = self.reuses[cls] - self._at(now - self.window)[1][cls]
    return offered, reused


if __name__ == "__main__":
    SaveAdmission.matched = matched_before  # type: ignore[method-assign]
    sys.exit(main(["bench", "hit-rate", "--engine", "10,25,40%", "--no-progress", "--json", str(RESULT),
                   *sys.argv[1:]]))
