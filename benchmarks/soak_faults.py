"""Faults of the soak (benchmarks/soak.py), drawn with a seeded RNG; every kind occurs within the first waves, then
they are drawn at random. Between waves:

* ``redis_kill``: SIGKILL the Redis server; it is restarted (empty) at the next wave boundary (``redis_restart``);
* ``disk_corrupt``: flip a byte in, or truncate, some record files; ``disk_delete``: remove some record files
  behind the engine's back (another process or an operator cleaning up);
* ``redis_corrupt``: overwrite part of some Redis values, or truncate them.

With the worker's faults (the split-halves soak), besides, between waves and within them (``within``, from the
engine's step hook):

* ``redis_flush``: ``FLUSHALL`` (an operator, or another tenant's script);
* ``cpu_loss``: records deleted from the worker's cpu pool while the scheduler's directory still lists them: the
  next load of them fails (synchronously when a request's hit lies all in the cpu tier of a one-group model);
* ``loop_stall``: the worker's I/O loop is held (a job blocking it) longer than the worker waits for it: a
  synchronous load from the cpu pool still completes on the engine's thread (a record it lost is a miss at once),
  while what needs the loop (a save awaited within the step) gives up within its bound and is dropped.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KINDS = ("redis_kill", "disk_corrupt", "disk_delete", "redis_corrupt")
WORKER_KINDS = ("redis_flush", "cpu_loss", "loop_stall")
WITHIN = ("redis_kill", "disk_corrupt", "disk_delete", "redis_corrupt", "redis_flush", "cpu_loss", "loop_stall")


class LoopStall:
    """Holds the worker's I/O loop: ``arm(n)`` queues ``n`` jobs on it that each block it for ``seconds`` (cut short
    once ``disarm`` is called). Thread-safe."""

    def __init__(self, loop: Any, seconds: float) -> None:
        self._loop = loop
        self.seconds = seconds
        self._free = threading.Event()
        self.stalled = 0

    def arm(self, jobs: int) -> None:
        self._free.clear()
        for _ in range(jobs):
            self._loop.loop.call_soon_threadsafe(self._hold)

    def _hold(self) -> None:
        if not self._free.is_set():
            self.stalled += 1
            self._free.wait(self.seconds)

    def disarm(self) -> None:
        self._free.set()


class WorkerFaults:
    """Faults inside the worker half: its cpu pool loses records, its I/O loop stalls (``stall_seconds`` > 0)."""

    def __init__(self, store: Any, loop: Any, stall_seconds: float) -> None:
        self.pool = store.tier("cpu")
        self.loop = loop
        self.stall = LoopStall(loop, stall_seconds) if stall_seconds > 0 else None

    def lose(self, rng: random.Random) -> int:
        """Delete 1-4 random records of the pool; how many went. Both on the worker's I/O loop, which alone stores
        and deletes records (the engine's thread only pins them)."""
        async def keys() -> list[bytes]:
            return sorted(self.pool.pool.keys())

        held = self.loop.run(keys())
        victims = rng.sample(held, min(len(held), rng.randint(1, 4)))
        return int(self.loop.run(self.pool.delete(victims))) if victims else 0

    def settle(self) -> None:
        """Stop stalling and let the I/O loop run what is queued: a job submitted now runs after it."""
        if self.stall is not None:
            self.stall.disarm()
        self.loop.run(asyncio.sleep(0.01))

    def close(self) -> None:
        if self.stall is not None:
            self.stall.disarm()


class FaultInjector:
    """Draws and applies faults at wave boundaries (``__call__``) and, with ``worker``, within waves (``within``);
    counts what it did."""

    def __init__(self, seed: int, disk_root: Path, server: Any, worker: WorkerFaults | None = None) -> None:
        self.rng = random.Random(seed * 7919 + 1)
        self.disk_root = disk_root
        self.server = server
        self.worker = worker
        self.counts: Counter[str] = Counter()
        self.within_counts: Counter[str] = Counter()
        self.damaged: Counter[str] = Counter()
        self.kinds = KINDS if worker is None else KINDS + tuple(k for k in WORKER_KINDS if self._applies(k))
        self._within = tuple(k for k in WITHIN if k in self.kinds)
        self._order = list(self.kinds)
        self.rng.shuffle(self._order)
        self._down = False

    def _applies(self, kind: str) -> bool:
        return kind != "loop_stall" or (self.worker is not None and self.worker.stall is not None)

    def __call__(self, wave: int, _pair: object = None) -> None:
        self._restart()
        kind = self._order[wave] if wave < len(self._order) else self.rng.choice(self.kinds)
        getattr(self, kind)()
        self.counts[kind] += 1

    def within(self) -> None:
        """One fault during a wave (never a restart: a killed server comes back at the next wave boundary)."""
        kind = self.rng.choice(self._within)
        if kind == "redis_kill" and self._down:
            return
        getattr(self, kind)()
        self.counts[kind] += 1
        self.within_counts[kind] += 1

    def _restart(self) -> None:
        if self._down:  # a killed server comes back at the next wave boundary
            self.server.start()
            self._down = False
            self.counts["redis_restart"] += 1

    def redis_kill(self) -> None:
        self.server.kill()
        self._down = True

    def _files(self) -> list[Path]:
        try:
            files = sorted(self.disk_root.rglob("*.kvt"))
        except FileNotFoundError:  # a directory removed while listed (within a wave, the engine writes and evicts)
            files = []
        return self.rng.sample(files, min(len(files), self.rng.randint(1, 6)))

    def disk_corrupt(self) -> None:
        for path in self._files():
            try:  # in place: a record the engine removed meanwhile is not created again
                with path.open("r+b") as f:
                    data = bytearray(f.read())
                    if len(data) < 2:
                        continue
                    if self.rng.random() < 0.5:
                        data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
                    else:
                        del data[self.rng.randrange(1, len(data)):]
                    f.seek(0)
                    f.write(data)
                    f.truncate()
            except FileNotFoundError:
                continue
            self.damaged["disk_records"] += 1

    def disk_delete(self) -> None:
        for path in self._files():
            path.unlink(missing_ok=True)
            self.damaged["disk_deleted"] += 1

    @contextmanager
    def _client(self) -> Iterator[Any]:
        import redis  # the redis extra: main() checks for it

        client = redis.Redis(host="127.0.0.1", port=self.server.port, socket_timeout=5)
        try:
            yield client
        finally:
            client.close()

    def redis_corrupt(self) -> None:
        if self._down:
            return
        with self._client() as client:
            names = sorted(client.scan_iter(count=1000))
            for name in self.rng.sample(names, min(len(names), self.rng.randint(1, 6))):
                size = int(client.strlen(name))
                if self.rng.random() < 0.5 and size > 1:
                    client.setrange(name, self.rng.randrange(size), bytes([self.rng.randrange(256)]) * 3)
                else:
                    client.set(name, client.getrange(name, 0, max(0, size // 2)))
                self.damaged["redis_records"] += 1

    def redis_flush(self) -> None:
        if self._down:
            return
        with self._client() as client:
            self.damaged["redis_flushed"] += int(client.dbsize())
            client.flushall()

    def cpu_loss(self) -> None:
        assert self.worker is not None
        self.damaged["cpu_lost"] += self.worker.lose(self.rng)

    def loop_stall(self) -> None:
        assert self.worker is not None and self.worker.stall is not None
        self.worker.stall.arm(self.rng.randint(1, 3))

    def finish(self) -> None:
        self._restart()
        if self.worker is not None:
            self.worker.close()
