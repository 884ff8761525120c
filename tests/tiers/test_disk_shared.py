"""A disk directory that several processes share: one quota for the directory, counted across processes in its
ledger, and no process deleting what another running process serves (kvtier.tiers.disk.shared)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from contract import rand

from kvtier.config import DiskTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.records.codec import HEADER_SIZE
from kvtier.records.keys import Namespace
from kvtier.store.assembly import Role, build_tiers, directory_for, start_tiers
from kvtier.tiers.disk.ledger import LEDGER_NAME, Ledger
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.manifest import manifest_of, read_manifest

REPO = Path(__file__).resolve().parents[2]
RECORD = HEADER_SIZE + 4096  # one record of rand((1024,)) float32
WRITER = r"""
import asyncio, hashlib, json, os, sys, time
sys.path.insert(0, sys.argv[1])
from contract import rand
from kvtier.config import DiskTierConfig
from kvtier.records.keys import Namespace
from kvtier.tiers.manifest import manifest_of
from kvtier.tiers.disk.tier import DiskTier

root, model, capacity, count, go, done = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:8]
ns = Namespace(model=model, group={"kind": "full_attention"}, layer_names=("l0", "l1"))
digest = ns.digest()

def key(i):
    return digest + hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()

async def main():
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=root))
    await tier.describe({digest: manifest_of(ns, digest)})
    await tier.start()
    open(done + ".ready." + model, "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    written = []
    for start in range(0, count, 3):
        batch = [(key(i), rand((1024,), seed=i)) for i in range(start, min(count, start + 3))]
        for (k, _), ok in zip(batch, await tier.put(batch)):
            if ok:
                written.append(k.hex())
    kept = [e.key.hex() for e in tier.entries()]
    print(json.dumps({"namespace": digest.hex(), "written": written, "kept": kept,
                      "evictions": tier.stats().evictions, "used": tier.used_bytes()}), flush=True)
    open(done + "." + model, "w").close()
    if sys.stdin.readline() != "close\n":  # stay a running member until the test says so
        raise SystemExit(3)
    await tier.close()

asyncio.run(main())
"""


def start_writer(root: Path, model: str, capacity: int, count: int, go: Path, done: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(Path(__file__).parent), str(root), model,
                             str(capacity), str(count), str(go), str(done)],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def finish(procs: Sequence[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("close\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=60) == 0


def records(root: Path) -> dict[str, set[str]]:
    """Record files per namespace hex, by key hex."""
    out: dict[str, set[str]] = {}
    for f in root.rglob("*.kvt"):
        out.setdefault(f.relative_to(root).parts[0], set()).add(f.name[:-4])
    return out


def disk_bytes(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in root.rglob("*.kvt"):
        space = f.relative_to(root).parts[0]
        out[space] = out.get(space, 0) + f.stat().st_size
    return out


def ledger(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / LEDGER_NAME).read_text())
    return data


def namespace(model: str) -> tuple[Namespace, bytes]:
    ns = Namespace(model=model, group={"kind": "full_attention"}, layer_names=("l0", "l1"))
    return ns, ns.digest()


def key_of(digest: bytes, i: int) -> bytes:
    return digest + hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def age_in_write_order(root: Path, keys: Sequence[str]) -> None:
    """Give these records distinct modification times, one second apart in this order (oldest first): records
    written within one clock tick share a time, and which of them is "oldest" would be a coin toss."""
    files = {f.name[:-4]: f for f in root.rglob("*.kvt")}
    base = time.time() - len(keys) - 1
    for i, key in enumerate(keys):
        os.utime(files[key], (base + i, base + i))


async def described_tier(root: Path, model: str, capacity: int) -> DiskTier:
    ns, digest = namespace(model)
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=str(root)))
    await tier.describe({digest: manifest_of(ns, digest)})
    await tier.start()
    return tier


def run_three(root: Path, tmp_path: Path, quota: int) -> list[dict[str, Any]]:
    """Three processes of three models write 40 records each (about three times the quota) at once."""
    go, done = tmp_path / "go", tmp_path / "done"
    procs = [start_writer(root, f"model-{m}", quota, 40, go, done) for m in "abc"]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("done.ready.*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # all three started and members of the ledger: then all write at once
    go.touch()
    reports = []
    for p in procs:
        assert p.stdout is not None
        reports.append(json.loads(p.stdout.readline()))
    # every process is still running (a member): no namespace is an orphan, so another process may have cut
    # one only under the fair-share rule, never below its share (a third of the quota)
    on_disk = records(root)
    for r in reports:
        assert r["written"], f"{r['namespace']} wrote nothing"  # the fair share lets no process starve
        mine = on_disk.get(r["namespace"], set())
        assert mine <= set(r["kept"]) <= set(r["written"]) and len(r["written"]) - len(r["kept"]) <= r["evictions"]
        if mine != set(r["kept"]):  # cut by another process
            assert len(mine) * RECORD >= quota // 3 - RECORD, (len(mine), len(r["kept"]))
    finish(procs)
    return reports


def test_three_processes_share_one_quota_and_keep_each_others_records(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    quota = 12 * RECORD
    reports = run_three(root, tmp_path, quota)
    on_disk = records(root)
    assert len(on_disk) == 3 and all(on_disk.values())  # every namespace still has records
    assert sum(disk_bytes(root).values()) <= quota  # each record is counted, under the lock, before it lands
    book = ledger(root)
    assert book["quota"] == quota and book["members"] == {}  # every process left when it closed
    assert book["bytes"] == disk_bytes(root)  # counted exactly across processes
    assert sum(len(r["written"]) for r in reports) > 12  # the quota was reached: processes evicted their own
    for r in reports:
        manifest = read_manifest(str(root / r["namespace"]))
        assert manifest is not None and manifest["namespace"] == r["namespace"]


async def test_a_restart_with_a_smaller_capacity_trims_only_its_own_namespace(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    reports = run_three(root, tmp_path, 12 * RECORD)
    before = records(root)
    a = reports[0]["namespace"]
    small = await described_tier(root, "model-a", 2 * RECORD)  # model-a again, with a smaller capacity
    after = records(root)
    assert len(after[a]) == min(2, len(before[a])) and after[a] <= before[a]
    assert {s: k for s, k in after.items() if s != a} == {s: k for s, k in before.items() if s != a}
    _, digest = namespace("model-a")
    assert await small.put([(key_of(digest, 100), rand((1024,)))]) == [False]  # its own capacity is full
    assert await small.delete([e.key for e in small.entries()]) == len(after[a])
    assert await small.put([(key_of(digest, 100 + i), rand((1024,), seed=i)) for i in range(3)]) == [True] * 2 + [False]
    assert {s: k for s, k in records(root).items() if s != a} == {s: k for s, k in before.items() if s != a}
    assert ledger(root)["quota"] == 12 * RECORD  # the first writer's quota stays the directory's
    await small.close()
    assert ledger(root)["bytes"] == disk_bytes(root)


async def test_a_running_processs_records_go_only_down_to_its_fair_share_an_orphans_go(tmp_path: Path) -> None:
    """The directory is full of another running process's records: a newcomer takes their oldest only while it
    holds less than its fair share (half the quota for two namespaces), then its own. Once that process
    has exited, its namespace is an orphan: its oldest records make room."""
    root = tmp_path / "shared"
    go, done = tmp_path / "go", tmp_path / "done"
    go.touch()
    other = start_writer(root, "model-x", 4 * RECORD, 4, go, done)
    assert other.stdout is not None
    report = json.loads(other.stdout.readline())
    assert len(report["kept"]) == 4
    age_in_write_order(root, report["kept"])
    mine = await described_tier(root, "model-y", 4 * RECORD)
    _, digest = namespace("model-y")
    got = [(await mine.put([(key_of(digest, i), rand((1024,)))]))[0] for i in range(3)]
    assert got == [True, True, True]  # the third makes room from our own oldest: x is at its share
    left = records(root)[report["namespace"]]
    # x never goes below its share and keeps its newest; the newcomer made room without refusing a write
    assert set(report["kept"][2:]) <= left, (sorted(left), report["kept"], [e.key.hex() for e in mine.entries()])
    assert key_of(digest, 2).hex() in records(root)[digest.hex()]
    assert mine.stats().puts_refused == 0 and sum(disk_bytes(root).values()) <= 4 * RECORD
    finish([other])  # x closed its tier (left the ledger) and exited: no live member serves its namespace
    assert all(report["namespace"] not in m["namespaces"] for m in ledger(root)["members"].values())
    assert await mine.put([(key_of(digest, 3), rand((1024,)))]) == [True]  # x is gone: an orphan's oldest go
    assert len(records(root)[report["namespace"]]) == 1
    assert sum(disk_bytes(root).values()) <= 4 * RECORD and ledger(root)["bytes"] == disk_bytes(root)
    await mine.close()


async def test_raw_keys_own_what_they_write_and_adopt_unclaimed_namespaces_without_a_manifest(
        tmp_path: Path) -> None:
    root = tmp_path / "shared"
    described = await described_tier(root, "model-d", 1 << 20)
    _, digest = namespace("model-d")
    await described.put([(key_of(digest, 0), rand((1024,)))])
    raw = DiskTier(DiskTierConfig(name="disk", capacity=1 << 20, path=str(root)))
    await raw.start()
    await raw.put([(b"\x01" * 16 + b"\x02" * 16, rand((16,)))])
    await raw.close()
    await described.close()
    again = DiskTier(DiskTierConfig(name="disk", capacity=1 << 20, path=str(root)))
    await again.start()  # the raw namespace has no manifest: adopted; model-d's has one: left to model-d
    assert [e.key for e in again.entries()] == [b"\x01" * 16 + b"\x02" * 16]
    assert again.used_bytes() == HEADER_SIZE + 64
    ns, digest = namespace("model-d")
    await again.describe({digest: manifest_of(ns, digest)})
    assert {e.key for e in again.entries()} == {b"\x01" * 16 + b"\x02" * 16, key_of(digest, 0)}
    await again.close()


def test_ledger_transactions_count_and_prune_gone_members(tmp_path: Path) -> None:
    book = Ledger(str(tmp_path))
    with book.locked(1000) as state:
        assert state.fresh and state.quota == 1000
        state.add("aa" * 16, 300)
        state.members["h:1:x"] = {"host": "elsewhere", "pid": 1, "seen": time.time() - 7200, "namespaces": []}
        state.members["h:2:y"] = {"host": "elsewhere", "pid": 2, "seen": time.time(), "namespaces": ["bb" * 16]}
    with book.locked(5) as state:
        assert not state.fresh and state.quota == 1000  # the first writer's quota stays
        assert state.bytes == {"aa" * 16: 300} and set(state.members) == {"h:2:y"}  # not seen for 2 h: gone
        assert state.claimed_by_others("me") == {"bb" * 16}
        state.add("aa" * 16, -500)  # never below zero
    assert book.read(5).bytes == {}
    (tmp_path / LEDGER_NAME).write_text("{not json")
    assert book.read(7).fresh and book.read(7).quota == 7


@pytest.mark.parametrize("make", ["file", "readonly"])
async def test_an_impossible_path_is_a_config_error_naming_the_key(tmp_path: Path, make: str) -> None:
    if make == "file":
        (tmp_path / "plain").write_text("x")
        path = tmp_path / "plain" / "cache"
    else:
        if os.geteuid() == 0:
            pytest.skip("root may write a read-only directory")
        (tmp_path / "ro").mkdir(mode=0o500)
        path = tmp_path / "ro" / "cache"
    tier = DiskTier(DiskTierConfig(name="d", capacity=1 << 20, path=str(path)), key_path="tiers[2]")
    with pytest.raises(ConfigError) as info:
        await tier.start()
    text = str(info.value)
    assert text.startswith("tiers[2].path: cannot use ") and str(path) in text and "\n" not in text
    assert "directory this user may create and write" in text


@pytest.mark.parametrize("role", list(Role))
async def test_an_impossible_path_in_a_config_is_one_line_naming_the_key_in_every_role(tmp_path: Path,
                                                                                        role: Role) -> None:
    """``build_tiers`` gives the disk tier its key path (``tiers[1]``), and ``start_tiers`` raises the config error
    even as the scheduler, which otherwise skips a tier that cannot start (a miss source)."""
    (tmp_path / "plain").write_text("x")
    cfg = load_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"},
                                 {"name": "ssd", "kind": "disk", "capacity": "1MiB",
                                  "path": str(tmp_path / "plain" / "cache")}]}, env={})
    tiers = build_tiers(cfg)
    with pytest.raises(ConfigError) as info:
        await start_tiers(tiers, role, directory_for(cfg, tiers))
    text = str(info.value)
    assert text.startswith("tiers[1].path: cannot use ") and str(tmp_path / "plain" / "cache") in text
    assert "\n" not in text


async def test_a_failing_disk_at_start_is_a_tier_the_scheduler_serves_without_not_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error that is not about the path (EIO from the ledger or the scan) stays an OSError: the scheduler
    logs it and serves without the tier (a miss source), the engine still starts; the worker sees the OSError."""
    import errno

    from kvtier.tiers.disk import shared

    def failing_join(*_args: Any, **_kw: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(shared.SharedDirectory, "join", failing_join)
    cfg = load_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"},
                                 {"name": "ssd", "kind": "disk", "capacity": "1MiB", "path": str(tmp_path / "c")}]},
                      env={})
    tiers = build_tiers(cfg)
    started = await start_tiers(tiers, Role.SCHEDULER, directory_for(cfg, tiers))
    assert [t.name for t in started] == []  # the memory tier is the worker's; the disk tier could not start
    with pytest.raises(OSError) as info:
        await start_tiers(build_tiers(cfg), Role.WORKER)
    assert info.value.errno == errno.EIO and not isinstance(info.value, ConfigError)


async def test_closing_at_interpreter_exit_still_leaves_the_ledger(tmp_path: Path) -> None:
    """vLLM may shut an engine down from an exit handler, after Python has stopped the default executor: the tier
    still leaves the shared directory's ledger (found by kvtier bench vllm-contention's engines)."""
    root = tmp_path / "shared"
    tier = await described_tier(root, "model-a", 4 * RECORD)
    assert len(ledger(root)["members"]) == 1
    await asyncio.get_running_loop().shutdown_default_executor()  # what interpreter exit does to to_thread
    await tier.close()
    assert ledger(root)["members"] == {}
