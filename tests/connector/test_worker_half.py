"""TieredConnector's worker half: load errors from a corrupt or deleted disk record, finished reports, preemption
flush, layouts, pickling of metadata and stats. Real cpu and disk tiers; the scheduler half writes the plans.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtier.assembly import Role
from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces, request_keys
from kvtier.connector.plans import KVTierMetadata, LoadSpec, SaveSpec
from kvtier.connector.tiered import TieredConnector
from kvtier.connector.types import KVCacheBlocks, KVConnectorOutput, NewRequestData, Request, SchedulerOutput
from kvtier.connector.worker import WorkerHalf
from kvtier.directory import StorePlan
from kvtier.errors import ConnectorError
from kvtier.keys import Key
from kvtier.layout import simple_config
from kvtier.runtime import LoopThread
from kvtier.store import TieredStore
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.transfer import KVLayout, gather

C, BS, NB = 8, 4, 48
KCC = simple_config(2, 2, 4, dtype="bfloat16", block_size=BS, num_blocks=NB)
TOKENS = list(range(40))  # 5 chunks: a hit may cover all 4 before the last token's chunk... up to 39 tokens
A_IDS = list(range(1, 11))
B_IDS = list(range(20, 30))


def make_cfg(tmp: Path, tiers: tuple[str, ...] = ("disk",)) -> KvtierConfig:
    sections = {"cpu": CpuTierConfig("cpu", 1 << 20), "disk": DiskTierConfig("disk", 1 << 22, path=str(tmp))}
    return KvtierConfig(chunk_size=C, tiers=tuple(sections[t] for t in tiers),
                        policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_THROUGH))


def paged(seed: int, layout: str = "kv_first") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NB, BS, 2, 4) if layout == "kv_first" else (NB, 2, BS, 2, 4)
    return {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n in KCC.kv_cache_groups[0].layer_names}


class Engine:
    """Drives both halves like vLLM's scheduler and model runner (metadata and outputs pickled)."""

    def __init__(self, cfg: KvtierConfig, kv: dict[str, torch.Tensor]) -> None:
        self.sched = TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, KCC)
        self.work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, KCC)
        self.work.register_kv_caches(kv)

    def step(self, out: SchedulerOutput, *, save: bool = True) -> KVConnectorOutput:
        meta = pickle.loads(pickle.dumps(self.sched.build_connector_meta(out)))
        self.work.bind_connector_metadata(meta)
        self.work.start_load_kv(None)
        if save:
            self.work.wait_for_save()
        sending, recving = self.work.get_finished(out.finished_req_ids)
        result = KVConnectorOutput(sending, recving, self.work.get_kv_connector_stats(),
                                   self.work.get_block_ids_with_load_errors())
        self.work.clear_connector_metadata()
        if not result.is_empty():
            self.sched.update_connector_output(result)
        return result

    def run_prefill(self, req: Request, ids: list[int], computed: int = 0, *, save: bool = True) -> KVConnectorOutput:
        return self.step(SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(req.request_id, req.prompt_token_ids, (ids,), computed)],
            num_scheduled_tokens={req.request_id: req.num_tokens - computed}), save=save)

    def close(self) -> None:
        self.sched.shutdown()
        self.work.shutdown()


def save_a(eng: Engine) -> KVConnectorOutput:
    """Prefill request A into blocks A_IDS, finish it, and run the step that saves it; return that step's output."""
    a = Request("A", TOKENS)
    eng.sched.get_num_new_matched_tokens(a, 0)
    eng.run_prefill(a, A_IDS)
    eng.sched.request_finished(a, A_IDS)
    eng.work.flush_saves()
    return eng.step(SchedulerOutput(finished_req_ids={"A"}))


def store_a(tmp: Path, kv: dict[str, torch.Tensor]) -> None:
    eng = Engine(make_cfg(tmp), kv)
    try:
        assert save_a(eng).finished_sending == {"A"}
    finally:
        eng.close()


def disk_file(tmp: Path, chunk: int) -> Path:
    spaces = namespaces(identity_from(make_cfg(tmp), None, tp_rank=0), KCC, C)
    key = request_keys(spaces, TOKENS, C, b"")[0][chunk]
    return next(tmp.rglob(key.hex() + ".kvt"))


def load_b_async(eng: Engine) -> tuple[set[int], set[str]]:
    b = Request("B", TOKENS)
    hit, is_async = eng.sched.get_num_new_matched_tokens(b, 0)
    assert (hit, is_async) == (4 * C, True)
    eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), hit)
    errors: set[int] = set()
    received: set[str] = set()
    for _ in range(500):
        out = eng.step(SchedulerOutput())
        errors |= out.invalid_block_ids
        received |= out.finished_recving or set()
        if received:
            return errors, received
        time.sleep(0.01)
    raise AssertionError("the asynchronous load never finished")


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_damaged_disk_record_reports_its_blocks(tmp_path: Path, damage: str) -> None:
    kv_a = paged(1)
    store_a(tmp_path, kv_a)
    kv_b = paged(2)
    eng = Engine(make_cfg(tmp_path), kv_b)  # adopts A's records, then one goes bad behind its back
    path = disk_file(tmp_path, 2)
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    try:
        errors, received = load_b_async(eng)
        assert received == {"B"}  # reported even though part of it failed
        assert errors == {B_IDS[4], B_IDS[5]}  # chunk 2's blocks: the engine recomputes them
        for n in kv_a:
            assert torch.equal(kv_b[n][:, B_IDS[:4]], kv_a[n][:, A_IDS[:4]])
            assert torch.equal(kv_b[n][:, B_IDS[6:8]], kv_a[n][:, A_IDS[6:8]])
        # the failed chunk left the directory: the next lookup stops before it
        assert eng.sched.get_num_new_matched_tokens(Request("C", TOKENS), 0) == (2 * C, True)
    finally:
        eng.close()


def test_blocks_first_layout_roundtrip(tmp_path: Path) -> None:
    kv = paged(3, layout="blocks_first")
    eng = Engine(make_cfg(tmp_path, ("cpu",)), kv)
    try:
        save_a(eng)
        b = Request("B", TOKENS)
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)
        eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        eng.run_prefill(b, B_IDS, 4 * C)
        for n in kv:
            assert torch.equal(kv[n][B_IDS[:8]], kv[n][A_IDS[:8]])
    finally:
        eng.close()


def test_finished_sending_waits_for_finish_and_saves(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(4))
    try:
        a = Request("A", TOKENS)
        eng.sched.get_num_new_matched_tokens(a, 0)
        out = eng.run_prefill(a, A_IDS)
        assert out.finished_sending is None  # saves may be done, but A has not finished
        assert out.kv_connector_stats is not None
        assert eng.sched.request_finished(a, A_IDS) == (True, None)
        eng.work.flush_saves()
        assert eng.step(SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}
        assert eng.step(SchedulerOutput()).finished_sending is None  # reported once
    finally:
        eng.close()


def test_saves_of_a_step_without_forward_run_at_get_finished(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(5))
    try:
        a = Request("A", TOKENS)
        eng.sched.get_num_new_matched_tokens(a, 0)
        eng.run_prefill(a, A_IDS, save=False)
        eng.work.flush_saves()
        eng.sched.request_finished(a, A_IDS)
        assert eng.step(SchedulerOutput(finished_req_ids={"A"})).finished_sending == {"A"}
        assert eng.sched.get_num_new_matched_tokens(Request("B", TOKENS), 0) == (4 * C, False)
    finally:
        eng.close()


def test_metadata_and_stats_pickle(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(6))
    try:
        a = Request("A", TOKENS)
        eng.sched.get_num_new_matched_tokens(a, 0)
        out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("A", TOKENS, (A_IDS,), 0)],
                              num_scheduled_tokens={"A": 40})
        meta = eng.sched.build_connector_meta(out)
        assert pickle.loads(pickle.dumps(meta)) == meta
        eng.work.bind_connector_metadata(meta)
        eng.work.start_load_kv(None)
        eng.work.wait_for_save()
        eng.work.flush_saves()
        stats = eng.work.get_kv_connector_stats()
        assert stats is not None and stats.data["save_chunks"] == 5
        assert pickle.loads(pickle.dumps(stats)).data == stats.data
        assert eng.work.get_kv_connector_stats() is None  # stats are per-step deltas
    finally:
        eng.close()


def test_methods_of_the_other_role_are_refused(tmp_path: Path) -> None:
    eng = Engine(make_cfg(tmp_path, ("cpu",)), paged(7))
    try:
        with pytest.raises(ConnectorError):
            eng.work.get_num_new_matched_tokens(Request("x", TOKENS), 0)
        with pytest.raises(ConnectorError):
            eng.sched.start_load_kv(None)
    finally:
        eng.close()


def test_kv_cache_config_none_derives_one_group(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, ("cpu",))
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, None)
    try:
        work.register_kv_caches(paged(8))
        assert work._worker is not None and work._worker.kcc is not None
        assert len(work._worker.kcc.kv_cache_groups[0].layer_names) == 2
    finally:
        work.shutdown()


def test_built_from_the_engine_extra_config(tmp_path: Path) -> None:
    conf = tmp_path / "kvtier.yaml"
    conf.write_text("chunk_size: 16\ntiers:\n  - {name: cpu, kind: cpu, capacity: 1MiB}\n")
    extra = {"config_file": str(conf), "chunk_size": C}  # the engine's keys override the file
    engine = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    for role in KVConnectorRole:
        conn = TieredConnector(engine, role, KCC)
        try:
            assert conn.kvtier_config.chunk_size == C
            assert [t.name for t in conn.kvtier_config.tiers] == ["cpu"]
            assert conn._kv_cache_config is KCC
        finally:
            conn.shutdown()


def test_a_paged_layout_that_disagrees_with_the_config_disables_kvtier_or_fails_in_strict_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    heads_first = {n: torch.zeros(2, NB, 2, BS, 4) for n in KCC.kv_cache_groups[0].layer_names}
    work = TieredConnector.from_config(make_cfg(tmp_path, ("cpu",)), KVConnectorRole.WORKER, KCC)
    try:
        with caplog.at_level("ERROR"):
            work.register_kv_caches(heads_first)  # the engine still starts
        worker = work._worker
        assert worker is not None and worker.disabled is not None and "heads" in worker.disabled
        assert worker.disabled.endswith("Set strict: true in kvtier's config to fail at start instead")
        assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
            f"kvtier is disabled for this engine (it serves without the cache): {worker.disabled}"]
        stats, report = work.get_kv_connector_stats(), work.build_connector_worker_meta()
        assert stats is not None and stats.data["kvtier_disabled"] == 1
        assert report is not None and report.disabled and work.build_connector_worker_meta() is None  # said once
    finally:
        work.shutdown()
    strict = dataclasses.replace(make_cfg(tmp_path, ("cpu",)), strict=True)
    work = TieredConnector.from_config(strict, KVConnectorRole.WORKER, KCC)
    try:
        with pytest.raises(ConnectorError, match="heads"):
            work.register_kv_caches(heads_first)
    finally:
        work.shutdown()


def test_cpu_load_scatters_from_borrowed_views_and_releases_them(tmp_path: Path) -> None:
    kv = paged(11)
    eng = Engine(make_cfg(tmp_path, ("cpu",)), kv)
    try:
        save_a(eng)
        worker = eng.work._worker
        assert worker is not None
        cpu = worker.store.tier("cpu")
        hits_before = cpu.stats().get_hits
        b = Request("B", TOKENS)
        assert eng.sched.get_num_new_matched_tokens(b, 0) == (4 * C, False)
        eng.sched.update_state_after_alloc(b, KVCacheBlocks((B_IDS,)), 4 * C)
        out = eng.run_prefill(b, B_IDS, 4 * C)
        assert not out.invalid_block_ids
        for n in kv:
            assert torch.equal(kv[n][:, B_IDS[:8]], kv[n][:, A_IDS[:8]])
        assert cpu.stats().get_hits - hits_before == 4  # read as views, counted as gets
        assert cpu.pool.pinned() == 0  # type: ignore[attr-defined]  # every borrowed view was released
    finally:
        eng.close()


class StuckCpuTier(CpuTier):
    """A cpu tier whose medium hangs: reads and writes wait on an event nobody sets."""

    def __init__(self, section: CpuTierConfig) -> None:
        super().__init__(section)
        self.never = asyncio.Event()

    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        await self.never.wait()
        return [None] * len(keys)

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        await self.never.wait()
        return [False] * len(items)


class BrokenReleaseCpuTier(CpuTier):
    """A cpu tier whose ``release`` raises."""

    def release(self, keys: Sequence[Key]) -> None:
        super().release(keys)
        raise RuntimeError("release broke")


BOUND = 0.3
CHUNK_KEYS = tuple(bytes([i]) * 32 for i in range(1, 3))
CHUNK_BLOCKS = ((21, 22), (23, 24))


def bounded_worker(tier: CpuTier, kv: dict[str, torch.Tensor]) -> tuple[WorkerHalf, LoopThread]:
    loop = LoopThread()
    store = TieredStore([tier], None, role=Role.WORKER)
    loop.run(store.start())
    worker = WorkerHalf(KCC, store, loop, chunk_size=C)
    worker.register_kv_caches(kv)
    worker.wait_timeout_s = worker.async_load_timeout_s = BOUND
    return worker, loop


@pytest.mark.timeout(20)  # without the bounds this test hangs: fail it instead
def test_stuck_tier_fails_loads_and_drops_saves_within_the_bound() -> None:
    tier = StuckCpuTier(CpuTierConfig("cpu", 1 << 20))
    worker, loop = bounded_worker(tier, paged(3))
    try:
        t0 = time.monotonic()
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert time.monotonic() - t0 < BOUND + 1.5
        assert worker.get_block_ids_with_load_errors() == {21, 22, 23, 24}
        assert tier.pool.pinned() == 0  # the cancelled borrow released its pins
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("a", 0, "cpu", CHUNK_KEYS[:1], CHUNK_BLOCKS[:1], True)]))
        deadline = time.monotonic() + BOUND + 1.5
        recving: set[str] = set()
        while not recving and time.monotonic() < deadline:
            recving = worker.get_finished(set())[1] or set()
            time.sleep(0.02)
        assert recving == {"a"}
        assert worker.get_block_ids_with_load_errors() == {21, 22}
        save = SaveSpec("s", 0, CHUNK_KEYS, ((1, 2), (3, 4)), (StorePlan("cpu", CHUNK_KEYS),))
        worker.start_load_kv(KVTierMetadata(saves=[save]))
        t0 = time.monotonic()
        worker.handle_preemptions()  # flushes the step's save: a memory-only save is awaited, bounded
        assert time.monotonic() - t0 < 2 * BOUND + 1.5
        assert worker.get_finished({"s"})[0] == {"s"}  # dropped, so nothing keeps the blocks
    finally:
        worker.close()
        loop.close()


def test_a_failing_release_does_not_reach_the_engine() -> None:
    kv = paged(5)
    tier = BrokenReleaseCpuTier(CpuTierConfig("cpu", 1 << 20))
    worker, loop = bounded_worker(tier, kv)
    try:
        layers = [kv[n] for n in KCC.kv_cache_groups[0].layer_names]
        data = gather(layers, [(1, 2), (3, 4)], KVLayout.KV_FIRST)
        loop.run(tier.put([(k, data[i].contiguous()) for i, k in enumerate(CHUNK_KEYS)]))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert worker.get_block_ids_with_load_errors() == set()
        for n in kv:
            assert torch.equal(kv[n][:, [21, 22, 23, 24]], kv[n][:, [1, 2, 3, 4]])
    finally:
        worker.close()
        loop.close()


@pytest.mark.parametrize("idle", [True, False])
def test_a_step_that_computes_nothing_waits_for_pending_async_loads(idle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine spinning through empty steps holds the GIL: in such a step the worker blocks (bounded) on its
    pending async loads instead of returning at once; a step with work never waits."""
    import concurrent.futures
    import threading

    import kvtier.connector.worker as worker_module

    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 10.0)
    worker, loop = bounded_worker(CpuTier(CpuTierConfig("cpu", 1 << 20)), paged(3))
    try:
        future: concurrent.futures.Future[list[list[torch.Tensor | None]]] = concurrent.futures.Future()
        worker.start_load_kv(KVTierMetadata(idle=idle))
        worker._recving["r"] = ([], future)
        timer = threading.Timer(0.05 if idle else 3.0, future.set_result, ([],))
        timer.start()
        t0 = time.monotonic()
        _, recving = worker.get_finished(set())
        if idle:  # returned as soon as the load finished, well before the (patched) 10 s bound
            assert recving == {"r"} and time.monotonic() - t0 < 5
        else:  # returned at once, the load still running
            assert recving is None and time.monotonic() - t0 < 2.5
        timer.join()
    finally:
        worker.close()
        loop.close()


def test_a_group_of_mixed_layer_specs_disables_kvtier_on_the_worker() -> None:
    """vLLM hands the scheduler the first layer's spec of such a group: the worker must refuse it, not crash."""
    from kvtier.layout import KVCacheConfig, KVCacheGroupSpec, OtherSpec

    mixed = KVCacheConfig((KVCacheGroupSpec(KCC.kv_cache_groups[0].layer_names,
                                            OtherSpec(BS, name="UniformTypeKVCacheSpecs(mixed)")),), NB)
    loop = LoopThread()
    store = TieredStore([CpuTier(CpuTierConfig("cpu", 1 << 20))], None, role=Role.WORKER)
    loop.run(store.start())
    worker = WorkerHalf(mixed, store, loop, chunk_size=C)
    try:
        worker.register_kv_caches(paged(1))
        assert worker.disabled is not None and "different specs" in worker.disabled
    finally:
        worker.close()
        loop.run(store.close())
        loop.close()


def test_a_save_whose_copy_fails_is_reported_not_stored(tmp_path: Path) -> None:
    """A gather that raises (here: blocks past the end of the tensors) costs the save, never the engine."""
    worker, loop = bounded_worker(CpuTier(CpuTierConfig("cpu", 1 << 20)), paged(3))
    try:
        bad = SaveSpec("s", 0, CHUNK_KEYS, ((NB + 5, NB + 6), (3, 4)), (StorePlan("cpu", CHUNK_KEYS),))
        worker.start_load_kv(KVTierMetadata(saves=[bad]))
        worker.wait_for_save()  # no exception
        stats = worker.stats()
        assert stats is not None and stats.data["save_failures"] == 2
        report = worker.report()
        assert report is not None and sorted(row[2] for row in report.failed_saves) == sorted(CHUNK_KEYS)
        assert worker.get_finished({"s"})[0] == {"s"}  # the request's blocks are freed
    finally:
        worker.close()
        loop.close()


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_a_chunk_counts_as_loaded_only_once_its_copy_landed(bad: str) -> None:
    """Counters follow the copy into the engine's blocks: a record the scatter refuses (another dtype, another
    shape) is a load failure with its blocks reported, never a hit; good records count as hits."""
    kv = paged(3)
    tier = CpuTier(CpuTierConfig("cpu", 1 << 20))
    worker, loop = bounded_worker(tier, kv)
    try:
        good = gather(list(kv.values()), [(1, 2), (3, 4)], KVLayout.KV_FIRST)
        wrong = good.float() if bad == "dtype" else good.reshape(2, -1)[:, :good[0].numel() // 2].contiguous()
        loop.run(tier.put([(CHUNK_KEYS[0], good[0]), (CHUNK_KEYS[1], good[1])]))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("r", 0, "cpu", CHUNK_KEYS, CHUNK_BLOCKS)]))
        assert worker.get_block_ids_with_load_errors() == set()
        stats = worker.stats()
        assert stats is not None
        assert {k: stats.data.get(k) for k in ("load_chunks", "hits_cpu", "load_chunks_group0", "load_failures")} \
            == {"load_chunks": 2, "hits_cpu": 2, "load_chunks_group0": 2, "load_failures": None}

        bad_key = bytes([9]) * 32
        loop.run(tier.put([(bad_key, wrong[0])]))
        worker.start_load_kv(KVTierMetadata(loads=[LoadSpec("s", 0, "cpu", (bad_key,), CHUNK_BLOCKS[:1])]))
        assert worker.get_block_ids_with_load_errors() == set(CHUNK_BLOCKS[0])
        stats = worker.stats()
        assert stats is not None
        assert stats.data["load_failures"] == 1 and stats.data["load_scatter_failures"] == 1
        assert not {"load_chunks", "hits_cpu", "load_chunks_group0", "load_bytes"} & set(stats.data)
    finally:
        worker.close()
        loop.close()
