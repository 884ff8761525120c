"""Persisting write-back chunks (kvtier.control.persist): both halves of TieredConnector as vLLM runs them (separate
stores, pickled metadata and outputs), cpu + disk under write-back. What only the cpu tier holds reaches disk at a
graceful stop, while the engine is idle, and when cpu evicts it before either; a new engine on the same directory
hits it; the scheduler's directory counts every copy once and never plans it again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from roundtrip_helpers import BS, NUM_BLOCKS, C, new_req, receive, step

import kvtier.tiers.disk.tier as disk_tier
from kvtier.bench.redis_servers import RedisServer
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, RedisTierConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces, request_keys
from kvtier.connector.tiered import TieredConnector
from kvtier.connector.worker.persisting import ROUND_CHUNKS
from kvtier.engine.types import KVCacheBlocks, Request, SchedulerOutput
from kvtier.layout import simple_config
from kvtier.records.keys import Key
from kvtier.tiers.disk.shared import SharedDirectory
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.runtime import STOP_MARGIN_S

KCC = simple_config(2, 2, 4, dtype="float32", block_size=BS, num_blocks=NUM_BLOCKS)
CHUNK_BYTES = KCC.kv_cache_groups[0].bytes_per_chunk(C)
CPU_SLOT = CpuTier(CpuTierConfig("cpu", 1 << 20)).stored_size(CHUNK_BYTES)  # a chunk's room in the cpu pool
PREFIX = list(range(500, 532))  # 4 chunks
A = [*PREFIX, *range(900, 909)]  # 41 tokens: 5 full chunks saved
B = [*PREFIX, *range(700, 709)]  # shares A's 4 prefix chunks
D = list(range(100, 141))  # shares nothing
A_IDS, B_IDS, D_IDS = list(range(1, 12)), list(range(20, 31)), list(range(40, 51))
IDLE = 0.2


def config(tmp: Path, *, idle: float, close: float, lag: float = 0.0, cpu_chunks: int = 64,
           disk_bytes: int = 1 << 22) -> KvtierConfig:
    tiers = (CpuTierConfig("cpu", cpu_chunks * CPU_SLOT), DiskTierConfig("disk", disk_bytes, path=str(tmp)))
    return KvtierConfig(chunk_size=C, tiers=tiers, policy=PolicyConfig(
        eviction="lru", write=WritePolicy.WRITE_BACK, persist_after_idle=idle, persist_max_lag=lag,
        persist_at_close=close))


def engine(cfg: KvtierConfig, seed: int) -> tuple[TieredConnector, TieredConnector, dict[str, torch.Tensor]]:
    sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
    g = torch.Generator().manual_seed(seed)
    kv = {name: torch.randn(2, NUM_BLOCKS, BS, 2, 4, generator=g) for name in KCC.kv_cache_groups[0].layer_names}
    work.register_kv_caches(kv)
    return sched, work, kv


def run(sched: TieredConnector, work: TieredConnector, req_id: str, tokens: list[int], ids: list[int]) -> None:
    """Prefill and finish a request that hits nothing (its chunks saved into cpu)."""
    req = Request(req_id, tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, KVCacheBlocks((ids,)), 0)
    step(sched, work, new_req(req, (ids,), 0))
    sched.request_finished_all_groups(req, (ids,))
    work.flush_saves()
    step(sched, work, SchedulerOutput(finished_req_ids={req_id}))


def keys(cfg: KvtierConfig, tokens: list[int]) -> list[Key]:
    return request_keys(namespaces(identity_from(cfg, None, tp_rank=0), KCC, C), tokens, C, b"")[0]


def records(tmp: Path) -> set[str]:
    return {p.stem for p in tmp.rglob("*.kvt")}


def wait_for(tmp: Path, want: set[str], limit_s: float = 10.0) -> float:
    """Seconds until the disk holds exactly the records ``want`` (at most ``limit_s``)."""
    t0 = time.monotonic()
    while records(tmp) != want and time.monotonic() - t0 < limit_s:
        time.sleep(0.005)
    return time.monotonic() - t0


def reported(sched: TieredConnector, work: TieredConnector, written: list[Key]) -> None:
    """Empty engine steps until the workers' reports made ``written`` READY on disk in the scheduler's directory."""
    directory = sched._sched().directory
    for _ in range(500):
        step(sched, work, SchedulerOutput())
        if all(directory.contains("disk", k) for k in written):
            return
        time.sleep(0.01)
    raise AssertionError("the copies were never reported written")


def hits_b_from_disk(cfg: KvtierConfig, kv_a: dict[str, torch.Tensor]) -> None:
    """A new engine on the same directory: B's 4 prefix chunks load from disk, bit for bit A's."""
    sched, work, kv = engine(cfg, seed=9)
    try:
        b = Request("B", B)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, True)  # asynchronous: from disk
        sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        counts = receive(sched, work, "B")
        assert counts["hits_disk"] == 4
        for name in kv:
            assert torch.equal(kv[name][:, B_IDS[:8]], kv_a[name][:, A_IDS[:8]])
    finally:
        sched.shutdown()
        work.shutdown()


def test_a_graceful_stop_leaves_on_disk_what_only_the_cpu_tier_held(tmp_path: Path) -> None:
    """Nothing is persisted while the engine runs (``persist_after_idle: 0``): A's 5 chunks are in cpu only
    (write-back), the disk is empty; the worker's shutdown copies them (the old code left them in memory, and the
    next engine missed)."""
    cfg = config(tmp_path, idle=0, close=4.0)
    sched, work, kv_a = engine(cfg, seed=1)
    run(sched, work, "A", A, A_IDS)
    assert records(tmp_path) == set()
    t0 = time.monotonic()
    work.shutdown()
    sched.shutdown()
    assert time.monotonic() - t0 < 4.0
    assert records(tmp_path) == {k.hex() for k in keys(cfg, A)}
    hits_b_from_disk(cfg, kv_a)


def test_while_idle_chunks_reach_disk_within_the_bound_and_the_directory_counts_them_once(tmp_path: Path) -> None:
    """Busy steps (tokens scheduled) keep the copies waiting; once the engine computes nothing, A's chunks are on
    disk within ``persist_after_idle`` + 1 s (measured here: printed). The next step's report makes them READY on
    disk in the scheduler's directory, counted once each; an engine that then crashes (never closed) leaves them
    for the next one."""
    cfg = config(tmp_path, idle=IDLE, close=0.0)
    sched, work, kv_a = engine(cfg, seed=2)
    run(sched, work, "A", A, A_IDS)
    for _ in range(6):  # the engine keeps computing (another request's tokens): nothing is copied
        time.sleep(IDLE / 2)
        step(sched, work, SchedulerOutput(num_scheduled_tokens={"other": 1}))
    assert records(tmp_path) == set()
    want = {k.hex() for k in keys(cfg, A)}
    took = wait_for(tmp_path, want)  # from the last step that computed
    print(f"A's {len(want)} chunks on disk {took:.3f}s after the engine went idle (persist_after_idle {IDLE}s)")
    assert records(tmp_path) == want and took < IDLE + 1.0
    directory = sched._sched().directory
    reported(sched, work, keys(cfg, A))  # the next steps' reports: the copies are written
    disk_size = work._work().store.tier("disk").stored_size(CHUNK_BYTES)
    assert all(directory.contains("disk", k) and directory.contains("cpu", k) for k in keys(cfg, A))
    assert directory.used_bytes("disk") == len(want) * disk_size
    # a new scheduler (the old worker never closed: a crash) adopts them
    hits_b_from_disk(cfg, kv_a)
    sched.shutdown()
    work.shutdown()


def test_a_chunk_cpu_evicts_before_its_copy_ran_is_written_to_disk_once(tmp_path: Path) -> None:
    """cpu holds 5 chunks. D's 5 evict A's while A's copies still wait (no idle time, no stop): the directory plans
    no demotion (the copies hold their room on disk), so the scheduler turns each eviction into a move into disk
    before it, run by D's save job (in order, off the engine's step) and settled by its report; the copies are
    dropped. Each of A's chunks is written to disk once; D's wait in cpu."""
    cfg = config(tmp_path, idle=60.0, close=0.0, cpu_chunks=5)  # the copies wait: no idle time, no stop
    sched, work, kv_a = engine(cfg, seed=3)
    run(sched, work, "A", A, A_IDS)
    run(sched, work, "D", D, D_IDS)
    assert records(tmp_path) == {k.hex() for k in keys(cfg, A)}  # by D's save job, done when D's saves are
    directory = sched._sched().directory
    reported(sched, work, keys(cfg, A))
    disk = work._work().store.tier("disk")
    assert records(tmp_path) == {k.hex() for k in keys(cfg, A)}
    assert disk.stats().puts == 5
    assert all(directory.contains("disk", k) and not directory.contains("cpu", k) for k in keys(cfg, A))
    assert all(directory.contains("cpu", k) and directory.holds("disk", k) for k in keys(cfg, D))
    assert directory.used_bytes("disk") == 10 * disk.stored_size(CHUNK_BYTES)  # A's written, D's reserved
    work.shutdown()
    sched.shutdown()
    hits_b_from_disk(cfg, kv_a)


def test_copies_into_a_full_disk_evict_its_oldest_records_and_stay_within_its_quota(tmp_path: Path) -> None:
    """The disk holds 6 records. A's 5 are persisted while idle; D's 5 evict A's from cpu (already on disk: nothing
    written) and their copies need room: the disk's policy drops 4 of A's (oldest first) as the copies are planned,
    so D's land with the disk at its quota, the directory's count equal to the disk tier's own, no write refused."""
    size = DiskTier(DiskTierConfig("disk", 1, path=str(tmp_path))).stored_size(CHUNK_BYTES)  # a record's file
    cfg = config(tmp_path, idle=IDLE, close=0.0, cpu_chunks=5, disk_bytes=6 * size)
    sched, work, _ = engine(cfg, seed=4)
    try:
        run(sched, work, "A", A, A_IDS)
        wait_for(tmp_path, {k.hex() for k in keys(cfg, A)})
        reported(sched, work, keys(cfg, A))
        run(sched, work, "D", D, D_IDS)
        assert wait_for(tmp_path, {keys(cfg, A)[4].hex(), *(k.hex() for k in keys(cfg, D))}) < IDLE + 1.0
        reported(sched, work, keys(cfg, D))
        disk, directory = work._work().store.tier("disk"), sched._sched().directory
        assert directory.used_bytes("disk") == disk.used_bytes() == 6 * size
        assert disk.stats().puts == 10 and disk.stats().puts_refused == 0
        assert [directory.contains("disk", k) for k in keys(cfg, A)] == [False] * 4 + [True]
    finally:
        sched.shutdown()
        work.shutdown()


def test_under_continuous_load_chunks_reach_disk_within_the_lag(tmp_path: Path) -> None:
    """No idle persisting (``persist_after_idle: 0``) and an engine that never stops computing: a request every
    50 ms, each saving new chunks. A's chunks still reach disk within ``persist_max_lag`` + 1 s of their save
    (measured here: printed), and the directory counts them READY there; a new engine hits them (before, only an
    idle engine or a graceful stop copied anything, so a server under load lost every chunk at a kill)."""
    lag = 0.4
    cfg = config(tmp_path, idle=0.0, close=0.0, lag=lag, cpu_chunks=4096)  # nothing is demoted from cpu
    sched, work, kv_a = engine(cfg, seed=5)
    try:
        run(sched, work, "A", A, A_IDS)
        saved, want = time.monotonic(), {k.hex() for k in keys(cfg, A)}
        n = 0
        while not want <= records(tmp_path) and time.monotonic() - saved < lag + 5:
            tokens = [2000 + 41 * n + i for i in range(41)]
            run(sched, work, f"busy{n}", tokens, D_IDS)  # computes and saves 5 chunks
            n += 1
            time.sleep(0.05)
        took = time.monotonic() - saved
        print(f"A's {len(want)} chunks on disk {took:.2f}s after their save, under load ({n} requests since)")
        assert want <= records(tmp_path) and took < lag + 1.0
        reported(sched, work, keys(cfg, A))
        directory = sched._sched().directory
        assert all(directory.contains("cpu", k) and directory.contains("disk", k) for k in keys(cfg, A))  # copies
        hits_b_from_disk(cfg, kv_a)
    finally:
        sched.shutdown()
        work.shutdown()


def test_the_copies_of_hot_chunks_run_first(tmp_path: Path) -> None:
    """D's 5 copies are planned before A's 5; B then loads A's 4 prefix chunks from cpu. A stop whose budget allows
    one round of 8 copies writes A's 4 hit chunks first, then the oldest others (in plan order, the old code
    wrote D's 5 and only 3 of A's)."""
    cfg = config(tmp_path, idle=0.0, close=4.0)  # copies only at a stop
    sched, work, _ = engine(cfg, seed=6)
    try:
        run(sched, work, "D", D, D_IDS)
        run(sched, work, "A", A, A_IDS)
        b = Request("B", B)
        assert sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)  # from cpu: synchronous
        sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        step(sched, work, new_req(b, (B_IDS,), 4 * C))
        persister = work._persister
        assert persister is not None
        # the persister's clock stands still until the first round has written: then the budget is spent
        persister._clock = lambda: 1000.0 if records(tmp_path) else 0.0
        assert persister.close(100.0) == ROUND_CHUNKS
        hot = {k.hex() for k in keys(cfg, A)[:4]}
        assert hot <= records(tmp_path) and len(records(tmp_path)) == ROUND_CHUNKS
        assert records(tmp_path) - hot <= {k.hex() for k in keys(cfg, D)}
    finally:
        sched.shutdown()
        work.shutdown()


def test_a_stop_is_bounded_when_the_disk_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``persist_at_close`` 1 s. A's chunks reach disk while the engine runs; then every disk write hangs (60 s
    before its temp file is made) and D is saved into cpu, its copies stuck in the disk's writer. The worker's stop
    returns within ``persist_at_close`` + ``STOP_MARGIN_S`` (it waited for the disk without limit: 60 s and more);
    this process has left the directory's ledger; the stuck writes, once they end, place nothing; a new engine on
    the directory serves every complete record (A's chunks, bit for bit)."""
    cfg = config(tmp_path, idle=0.0, close=1.0, lag=0.2)
    sched, work, kv_a = engine(cfg, seed=7)
    release = threading.Event()
    try:
        run(sched, work, "A", A, A_IDS)
        assert wait_for(tmp_path, {k.hex() for k in keys(cfg, A)}) < 5
        reported(sched, work, keys(cfg, A))
        stage = disk_tier.stage_record

        def hung(*args: object, **kwargs: object) -> object:
            release.wait(60)
            return stage(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(disk_tier, "stage_record", hung)
        store = SharedDirectory.store
        writing = [0]  # batches inside SharedDirectory.store (stuck ones included)

        def counted(*args: Any, **kwargs: Any) -> Any:
            writing[0] += 1
            try:
                return store(*args, **kwargs)
            finally:
                writing[0] -= 1

        monkeypatch.setattr(SharedDirectory, "store", counted)
        run(sched, work, "D", D, D_IDS)
        time.sleep(0.3)  # D's copies are due (half the lag): a round is stuck in the writer
        t0 = time.monotonic()
        work.shutdown()
        took = time.monotonic() - t0
        sched.shutdown()
        print(f"the worker's stop with a hung disk: {took:.2f}s (bound {1.0 + STOP_MARGIN_S:.1f}s)")
        assert took < 1.0 + STOP_MARGIN_S
        assert writing[0] == 1  # D's batch, still stuck in the writer thread
        assert list((tmp_path / ".kvtier-members").glob("*.json")) == []
    finally:
        release.set()
    t0 = time.monotonic()  # the stuck batch ends: dropped (its temp files removed), never placed
    while writing[0] and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert writing[0] == 0
    assert records(tmp_path) == {k.hex() for k in keys(cfg, A)}
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and ".kvt." in p.name]
    hits_b_from_disk(cfg, kv_a)


def test_a_stop_is_bounded_when_redis_is_frozen(redis_factory: Callable[..., RedisServer]) -> None:
    """cpu + Redis, write-through, Redis operations allowed 20 s each. The server is frozen (SIGSTOP) while D's
    save writes to it: each half's stop returns within ``persist_at_close`` + ``STOP_MARGIN_S`` (the worker waited
    30 s for pending saves before)."""
    server = redis_factory()
    tiers = (CpuTierConfig("cpu", 64 * CPU_SLOT), RedisTierConfig("redis", 1 << 24, url=server.url, timeout=20.0))
    cfg = KvtierConfig(chunk_size=C, tiers=tiers, policy=PolicyConfig(
        eviction="lru", write=WritePolicy.WRITE_THROUGH, persist_at_close=1.0))
    sched, work, _ = engine(cfg, seed=8)
    run(sched, work, "A", A, A_IDS)
    server.pause()
    try:
        d = Request("D", D)
        sched.get_num_new_matched_tokens(d, 0)  # the lookup in Redis times out: a miss
        sched.update_state_after_alloc(d, KVCacheBlocks((D_IDS,)), 0)
        step(sched, work, new_req(d, (D_IDS,), 0))  # D's save to Redis hangs
        sched.request_finished_all_groups(d, (D_IDS,))
        for half in (work, sched):
            t0 = time.monotonic()
            half.shutdown()
            took = time.monotonic() - t0
            print(f"a stop with Redis frozen: {took:.2f}s (bound {1.0 + STOP_MARGIN_S:.1f}s)")
            assert took < 1.0 + STOP_MARGIN_S
    finally:
        server.resume()
