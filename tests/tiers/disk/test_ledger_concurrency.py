"""Two processes writing one namespace's keys at once into a directory with a tight quota: the shared ledger
counts exactly what the record files hold at every moment, and the directory never goes over its quota
(kvtier.tiers.disk.shared)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from ledger_kit import RECORD, Child, disk_bytes, ledger

from kvtier.tiers.disk.ledger import Ledger

QUOTA = 6 * RECORD


def sample(root: Path, stop: threading.Event, out: list[tuple[int, int, bool]]) -> None:
    """Under the ledger's lock (no file changes meanwhile): (bytes of the files, the ledger's total, whether its
    counts equal the files), until ``stop``."""
    book = Ledger(str(root))
    while not stop.is_set():
        with book.locked(QUOTA, write=False) as state:
            files = disk_bytes(root)
            out.append((sum(files.values()), state.total(), state.bytes == files))
        time.sleep(0.001)  # sampling rate only: nothing waits on it


@pytest.mark.timeout(60)
def test_two_writers_of_the_same_keys_keep_the_ledger_equal_to_the_files_within_the_quota(tmp_path: Path) -> None:
    """The directory's quota is set first (6 records); each writer has a capacity of its own far above it, so the
    directory's quota is what makes room. Each writes keys 0-89 in batches of 3, in the same order (both write
    each key at about the same time: the old ledger counted such a key twice), then deletes every fourth."""
    root = tmp_path / "shared"
    root.mkdir()
    with Ledger(str(root)).locked(QUOTA):
        pass  # the ledger's creator sets the directory's quota
    writers = [Child(root, "model-s", 8 * QUOTA) for _ in range(2)]
    try:
        for w in writers:
            w.started()
        samples: list[tuple[int, int, bool]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(root, stop, samples))
        sampler.start()
        try:
            for w in writers:
                w.send("put 0 90 3")
                w.send("delete 0 90 4")
            written = [w.reply() for w in writers]
            for w in writers:
                w.reply()
        finally:
            stop.set()
            sampler.join(10)
        assert sum(sum(ok) for ok in written) > 4 * QUOTA // RECORD  # the quota was reached: writers made room
        assert len(samples) >= 5
        assert all(files <= QUOTA and total <= QUOTA for files, total, _ in samples), max(samples)
        assert all(exact for _, _, exact in samples), sum(not exact for _, _, exact in samples)
    finally:
        for w in writers:
            w.close()
    book = ledger(root)
    assert book["bytes"] == disk_bytes(root) and book["members"] == {}
