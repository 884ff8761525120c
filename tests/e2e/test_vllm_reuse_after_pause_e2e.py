"""The first reuse after a pause hits (issue 32), in vLLM's multiprocess engine: A, a 1 s pause with nothing to
compute, then A2 (A's 260 tokens + 30), while A's writes are still in flight: the disk takes 3 s per write
(``KVTIER_E2E_DISK_DELAY_S``, sitecustomize.py), as a large prompt's KV takes on a slow disk. No worker report can
have told the scheduler of them at A2's lookup. A2 used to compute every token; now it loads the 4 whole chunks it
shares with A once they are written, and computes only the rest.

(A pause longer than the write does not miss in vLLM 0.32/0.33, old code included: the engine keeps stepping while
a finished request's blocks wait for its saves, and those steps deliver the reports. The reference engine's tests,
tests/engine/test_reuse_after_pause.py, hold the report back after the write landed as well.)

vLLM's prefix cache is off (by choice: ``serve_without_prefix_caching``), so that A2 asks kvtier. A cpu tier alone
writes within the step and reports it in that step's output; the cpu case writes through to the slow disk, so that
its cpu records are reported with the disk write, as any cpu save queued behind a slower one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK, EngineRunner, assert_hit, assert_uncached, close_output, kvtier_yaml, prompts, same_output

HIT = 4 * CHUNK
DISK = "{name: disk, kind: disk, capacity: 256MiB, path: %s}"
TIERS = {"cpu": (f"[{{name: cpu, kind: cpu, capacity: 256MiB}}, {DISK}]", "write_through"),
         "disk": (f"[{DISK}]", "write_back")}


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_the_first_reuse_after_a_pause_hits(tier: str, run_engine: EngineRunner,
                                            models: Callable[[str], tuple[str, str]],
                                            references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    tiers, write = TIERS[tier]
    config = kvtier_yaml(workdir / "kvtier.yaml", tiers % (workdir / "kv"), policy={"write": write})
    model, dtype = models("llama")
    p = prompts()
    result = run_engine({"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": config,
                         "extra": {"serve_without_prefix_caching": True}, "pause_s": 1.0,
                         "phases": [[p["A"]], [p["A2"]]]}, multiprocessing=True,
                        env={"KVTIER_E2E_DISK_DELAY_S": "3"})
    assert_uncached(result["phases"][0][0], p["A"])
    out = result["phases"][1][0]
    assert_hit(out, p["A2"], HIT)  # vLLM's own count: 256 cached (it was 0), only 34 computed
    ref = references("llama")
    assert same_output(out, ref["A2_prefix_cached"])  # vLLM's prefix cache splits the prefill at the same point
    assert close_output(out, ref["A2"])
