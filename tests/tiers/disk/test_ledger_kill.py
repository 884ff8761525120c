"""The shared-directory ledger survives a process killed while it changes it, and rebuilds a torn one: the quota
still holds when another process writes, and no running process's records are deleted
(kvtier.tiers.disk.ledger)."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
from contract import rand
from ledger_kit import RECORD, Child, described_tier, disk_bytes, key_of, ledger, records

from kvtier.tiers.disk import ledger as ledger_module
from kvtier.tiers.disk.ledger import LEDGER_NAME, Ledger, seal

QUOTA = 8 * RECORD
# the steps of one put into a nearly full directory, in its one ledger transaction: the evictions for room, the
# ledger written in place (records counted) and cut to its length, the records renamed into place
STEPS = ["evicted", "ledger:written", "ledger:whole", "counted", "placed"]


def kill_mid_put(k: Child, at: int, log: Path) -> None:
    """K deletes one of its records, then puts 2 into the directory, one record short of full (evicting one of
    its own, so that the counts change), and is SIGKILLed at step ``at`` of that put."""
    assert k.ask("delete 0 1 1") == 1
    k.send(f"arm {at} {log}")
    k.send("put 5 7 2")
    assert k.proc.wait(timeout=10) == -signal.SIGKILL, "the child was not killed at that step"
    assert log.read_text() == STEPS[at - 1]


def tear(root: Path) -> None:
    """What a crash can leave of an in-place rewrite: the page holding the counts from an older ledger, the rest
    new (here: every namespace's count halved, an undercount that would let the directory over its quota)."""
    data = json.loads((root / LEDGER_NAME).read_bytes())
    check = data.pop("check")
    stale = {**data, "bytes": {h: n // 2 for h, n in data["bytes"].items()}}
    raw = json.dumps(stale, sort_keys=True, separators=(",", ":")).encode()[:-1] + b',"check":"%s"}' % check.encode()
    assert json.loads(raw)["check"] == check  # valid JSON, the new check
    (root / LEDGER_NAME).write_bytes(raw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at", range(1, len(STEPS) + 1))
async def test_a_process_killed_mid_ledger_write_leaves_the_quota_and_the_running_processs_records(
        tmp_path: Path, at: int) -> None:
    """B (3 records) and K (5) fill the directory; C (this process, with a larger capacity of its own) joins; K is
    killed at one step of a put; then C writes 10 records. The directory stays within its quota after each,
    B's records all stay (it runs, below its fair share), and the ledger ends equal to the files."""
    root = tmp_path / "shared"
    b = Child(root, "model-b", QUOTA).started()
    k = Child(root, "model-k", QUOTA).started()
    try:
        assert b.ask("put 0 3 1") == [True] * 3
        assert k.ask("put 0 5 1") == [True] * 5
        c, digest = await described_tier(root, "model-c", 4 * QUOTA)
        kept = records(root)[b.digest]
        kill_mid_put(k, at, tmp_path / "step")
        assert Ledger(str(root)).read(QUOTA).bytes == disk_bytes(root)  # whole or rebuilt, whichever step the kill hit
        assert sum(disk_bytes(root).values()) <= QUOTA
        for i in range(10):
            await c.put([(key_of(digest, i), rand((1024,), seed=i))])
            assert sum(disk_bytes(root).values()) <= QUOTA, i
            assert records(root)[b.digest] == kept, i
        assert records(root).get(digest.hex())  # C wrote into the full directory
        book = ledger(root)
        assert book["quota"] == QUOTA and book["bytes"] == disk_bytes(root)
        assert {m["pid"] for m in book["members"].values()} == {b.pid, os.getpid()}  # K is gone
        await c.close()
    finally:
        b.close()
        k.close()


@pytest.mark.timeout(60)
async def test_a_torn_ledger_fails_its_check_and_is_counted_again(tmp_path: Path) -> None:
    """B (another process, the directory's quota) fills the directory; C (this process, a larger capacity of its
    own) joins; then the ledger is torn as a crash mid-rewrite can leave it, undercounting B. C's 10 records
    still keep the directory within its quota: the torn ledger was counted again from the files."""
    root = tmp_path / "shared"
    b = Child(root, "model-b", QUOTA).started()
    try:
        assert b.ask("put 0 8 1") == [True] * 8
        c, digest = await described_tier(root, "model-c", 4 * QUOTA)
        tear(root)
        for i in range(10):
            await c.put([(key_of(digest, i), rand((1024,), seed=i))])
            assert sum(disk_bytes(root).values()) <= QUOTA, i
        assert records(root).get(digest.hex()) and ledger(root)["bytes"] == disk_bytes(root)
        await c.close()
    finally:
        b.close()


def test_a_ledger_left_longer_than_its_rewrite_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed between the in-place write of a shorter ledger and the cut to its length leaves the new
    JSON followed by the old file's tail: not a ledger, so the next transaction counts the files again."""
    ledger_ = Ledger(str(tmp_path))
    with ledger_.locked(QUOTA) as state:
        state.add("aa" * 16, 100)
        state.add("bb" * 16, 200)
    longer = (tmp_path / LEDGER_NAME).read_bytes()

    def killed(step: str) -> None:
        if step == "ledger:written":
            raise KeyboardInterrupt

    monkeypatch.setattr(ledger_module, "STEP_HOOK", killed)
    with pytest.raises(KeyboardInterrupt), ledger_.locked(QUOTA) as state:
        state.add("bb" * 16, -200)
    monkeypatch.setattr(ledger_module, "STEP_HOOK", None)
    left = (tmp_path / LEDGER_NAME).read_bytes()
    assert len(left) == len(longer) and left != longer  # the shorter ledger, then the old tail
    state = Ledger(str(tmp_path)).read(QUOTA)
    assert state.fresh and state.bytes == {}  # counted from the files: there are none


def test_a_ledger_of_another_version_is_rebuilt_with_one_warning(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A ledger another kvtier version wrote (version 3: renamed into place, no check, perhaps a temp file left)
    is not trusted: it is counted again from the files, its temp file removed, and the operator told once."""
    (tmp_path / LEDGER_NAME).write_text('{"kvtier_ledger": 3, "quota": 5, "bytes": {"aa": 4}, "members": {}}')
    (tmp_path / (LEDGER_NAME + ".tmp")).write_text("{")
    ledger_ = Ledger(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert ledger_.read(QUOTA).bytes == {}
        ledger_.read(QUOTA)
    assert len(caplog.records) == 1 and "version 3" in caplog.records[0].getMessage()  # two reads, one warning
    assert not (tmp_path / (LEDGER_NAME + ".tmp")).exists()


async def test_a_deleted_ledger_is_rebuilt_from_the_files_and_the_member_files(tmp_path: Path) -> None:
    """Without its ledger file the directory is counted again from its record files, under the lock, before
    anything else; the quota and the running members come from the member files (not the reader's default)."""
    root = tmp_path / "shared"
    tier, digest = await described_tier(root, "model-a", 4 * RECORD)
    assert await tier.put([(key_of(digest, i), rand((1024,), seed=i)) for i in range(3)]) == [True] * 3
    (root / LEDGER_NAME).unlink()
    state = Ledger(str(root)).read(1 << 30)
    assert state.fresh and state.quota == 4 * RECORD and state.bytes == disk_bytes(root)
    assert [m["namespaces"] for m in state.members.values()] == [[digest.hex()]]
    (root / LEDGER_NAME).write_bytes(seal(b'{"bytes":{"aa":-1},"kvtier_ledger":4,"members":{},"quota":5}'))
    assert Ledger(str(root)).read(1 << 30).bytes == disk_bytes(root)  # a negative count: not a ledger
    assert await tier.put([(key_of(digest, 9), rand((1024,), seed=9))]) == [True]  # evicts its oldest: full
    assert sum(disk_bytes(root).values()) <= 4 * RECORD and ledger(root)["bytes"] == disk_bytes(root)
    await tier.close()
