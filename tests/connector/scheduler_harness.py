"""The scheduler-half tests' harness: a started store shared with a scheduler-role connector, the groups and
tokens the tests use, and a helper scheduling a new request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, PolicyConfig, WritePolicy
from kvtier.connector.base import KVConnectorRole
from kvtier.connector.keying import identity_from, namespaces, request_keys
from kvtier.connector.plans import KVTierMetadata
from kvtier.connector.tiered import TieredConnector
from kvtier.engine.types import NewRequestData, Request, SchedulerOutput
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from kvtier.records.keys import Key
from kvtier.store.tiered import TieredStore
from kvtier.tiers.runtime import LoopThread

C = 8  # chunk size; block size 4 -> two blocks per chunk
SCHED = KVConnectorRole.SCHEDULER
FULL = KVCacheGroupSpec(("f0", "f1"), FullAttentionSpec(4, 1, 4, "float32"))
SWA = KVCacheGroupSpec(("s0",), SlidingWindowSpec(4, 1, 4, "float32", sliding_window=8))
MAMBA = KVCacheGroupSpec(("m0",), MambaSpec(4, ((4,),), ("float32",)))


def make_cfg(tmp: Path, write: WritePolicy = WritePolicy.WRITE_THROUGH) -> KvtierConfig:
    return KvtierConfig(chunk_size=C, tiers=(CpuTierConfig("cpu", 1 << 20), DiskTierConfig("disk", 1 << 22, path=str(tmp))),
                        policy=PolicyConfig(eviction="lru", write=write))


class Harness:
    """A started store shared with a scheduler-role connector, and helpers to place chunks."""

    def __init__(self, cfg: KvtierConfig, kcc: KVCacheConfig) -> None:
        self.cfg, self.kcc = cfg, kcc
        self.loop = LoopThread()
        self.store = TieredStore.from_config(self.cfg)
        self.loop.run(self.store.start())
        self.conn = TieredConnector.from_config(self.cfg, SCHED, kcc, store=self.store, loop=self.loop)
        self.spaces = namespaces(identity_from(self.cfg, None, tp_rank=0), kcc, C)

    def keys(self, tokens: list[int]) -> list[list[Key]]:
        return request_keys(self.spaces, tokens, C, b"")

    def place(self, tokens: list[int], group: int, chunks: list[int], tier: str = "cpu") -> None:
        keys = self.keys(tokens)[group]
        self.loop.run(self.store.put([(keys[i], torch.zeros(4)) for i in chunks], tiers=[tier]))

    def close(self) -> None:
        self.conn.shutdown()
        self.loop.run(self.store.close())
        self.loop.close()


Build = Callable[..., Harness]
TOKENS = list(range(100, 133))  # 33 tokens: 4 full chunks, a hit may cover all 4 (one token left)


def schedule_new(conn: TieredConnector, req: Request, blocks: tuple[list[int], ...], computed: int,
                 scheduled: int) -> KVTierMetadata:
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(req.request_id, req.prompt_token_ids, blocks, computed)],
                          num_scheduled_tokens={req.request_id: scheduled})
    return conn.build_connector_meta(out)
