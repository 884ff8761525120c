"""Shared helpers of the worker-half tests: a tiny two-layer model's KV tensors, configs with real cpu and disk
tiers, an ``Engine`` driving both halves like vLLM, and a worker bound to one tier with short waits.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces, request_keys
from kvtier.connector.tiered import TieredConnector
from kvtier.connector.worker.half import WorkerHalf
from kvtier.engine.types import KVCacheBlocks, KVConnectorOutput, NewRequestData, Request, SchedulerOutput
from kvtier.layout import simple_config
from kvtier.records.keys import Key
from kvtier.store.assembly import Role
from kvtier.store.tiered import TieredStore
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.runtime import LoopThread

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
        self.kv = kv

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
