"""Disk faults under the REAL reference engine with KVTierConnector: a full filesystem (a real tmpfs), quota
pressure, an engine process SIGKILLed while writing records, two engine processes sharing one directory.

The tier-level versions (every acknowledged record survives a SIGKILL, ENOSPC on a 1 MiB tmpfs, two processes
hammering one directory with puts / gets / deletes) are in tests/tiers/test_disk_faults.py; these add what the
engine sees: identical outputs, hits from what survived, no leaked blocks, pins or temp files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faultkit import (
    assert_clean,
    assert_identical,
    fault_waves,
    make_config,
    record_files,
    run_faulted,
    temp_files,
    tier_section,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WAVES = fault_waves()
PRELUDE = f"""
import json, sys, time
sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]
from faultkit import *
from kvtier.engine import Engine, KVTierPair, RequestSpec
"""

# Runs waves 0 and 2 (their records are what a restarted engine should find), says "ready", then keeps
# computing fresh prompts (each one writes new records, fsync'ed) until it is killed.
WRITER = PRELUDE + """
cfg = make_config([tier_section("disk", root=sys.argv[1], fsync=True)])
engine = Engine(ARGS, KVTierPair(cfg))
waves = fault_waves()
for wave in (waves[0], waves[2]):
    engine.run(wave)
print("ready", flush=True)
i = 0
while True:
    engine.run([RequestSpec(f"x{i}", tuple(prompts(1000 + i, 150)[0]), 2)])
    print(i, flush=True)
    i += 1
"""

# Two rounds over the same waves with a fresh engine each (the second round starts from whatever both
# processes wrote); each round is compared with this process's own no-connector run.
SHARER = PRELUDE + """
from kvtier.engine.harness import compare
out = {"identical": True, "hits": 0, "corrupt": 0, "leaked": 0, "residue": [0, 0]}
waves = fault_waves(seed=int(sys.argv[2]))
for _ in range(2):
    run = run_faulted(make_config([tier_section("disk", root=sys.argv[1])]), waves)
    same, logits, _, failures = compare(baseline(waves), run.record, 0.0)
    out["identical"] &= same and logits and not failures
    out["hits"] += sum(r.external_tokens for r in run.record.requests.values())
    out["corrupt"] += run.tier_stats("disk").corrupt
    out["leaked"] += run.record.leaked_blocks
    out["residue"] = list(directory_residue(run.pair.store.directory))
print(json.dumps(out))
"""


def disk_config(root: Path, capacity: str = "32MiB") -> object:
    return make_config([tier_section("disk", root=root, capacity=capacity)])


def test_full_filesystem_drops_writes_and_keeps_serving_reads(small_tmpfs: Callable[[str], Path]) -> None:
    root = small_tmpfs("192k")  # room for about 11 of this workload's ~16 KiB records; the quota says 32 MiB
    run = run_faulted(make_config([tier_section("disk", root=root)]), WAVES)
    assert_identical(run, WAVES)
    assert_clean(run, root)
    stats = run.tier_stats("disk")
    assert stats.errors > 0 and stats.puts > 0  # ENOSPC: writes dropped and counted, some landed
    assert stats.puts_refused == 0  # a filesystem error, not a quota refusal
    assert run.record.stats.get("hits_disk", 0) > 0  # what was written is still read back
    on_disk = sum(p.stat().st_size for p in record_files(root))
    assert stats.get_hits > 0 and run.pair.store.tier("disk").used_bytes() == on_disk
    assert run.pair.store.directory.used_bytes("disk") == on_disk  # failed writes never became entries


def test_quota_pressure_evicts_and_never_exceeds(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    run = run_faulted(make_config([tier_section("disk", root=root, capacity="256KiB")]), WAVES)
    assert_identical(run, WAVES)
    assert_clean(run, root)
    stats, directory = run.tier_stats("disk"), run.pair.store.directory
    assert stats.deletes > 0 and directory.stats.evictions_by_tier["disk"] > 0  # chosen by the directory, run by the tier
    assert sum(p.stat().st_size for p in record_files(root)) <= 256 << 10
    assert run.record.stats.get("hits_disk", 0) > 0


def start_writer(root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("extra_records", [1, 4])
def test_engine_killed_mid_write_then_restarted(tmp_path: Path, extra_records: int) -> None:
    root = tmp_path / "disk"
    proc = start_writer(root)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    seen = 0
    while seen < extra_records + 1 and time.monotonic() < deadline:  # "ready", then N more requests
        line = proc.stdout.readline()
        assert line, "the writer exited early"
        seen += 1
    time.sleep(0.004 * extra_records)  # land the kill at varying points of the next writes
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = len(record_files(root))
    run = run_faulted(disk_config(root), WAVES[3:])
    assert_identical(run, WAVES[3:])
    assert_clean(run, root)  # the dead writer's temp files were removed at start
    stats = run.tier_stats("disk")
    assert stats.corrupt == 0  # complete records only: os.replace publishes a record whole or not at all
    assert run.wave_hits("w3-") > 0  # the killed engine's records are served after the restart
    assert before > 0 and len(record_files(root)) >= before


@pytest.mark.slow
def test_two_engine_processes_share_one_directory(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(root), str(seed)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for seed in (7, 7, 8)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["identical"] and r["corrupt"] == 0 and r["leaked"] == 0 and r["residue"] == [0, 0], r
    assert all(r["hits"] > 0 for r in results)
    assert temp_files(root) == []
