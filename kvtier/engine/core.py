"""The reference engine: model + paged KV cache + scheduler + runner, with an optional connector pair.

    engine = Engine(EngineArgs(...), connector=KVTierPair(cfg))   # or a connector class, or None
    engine.add_request("r0", prompt_token_ids, max_tokens=8)
    while engine.has_unfinished():
        finished = engine.step()
    engine.close()

A connector is built twice, once per role, from ``(vllm_config, role, kv_cache_config)``: pass a connector
class (any :class:`KVConnectorBase`), a callable with that signature, or nothing and a ``KVTransferConfig``
naming the connector (built through ``kvtier.connector.factory.create_connector``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.connector.base import KVConnectorBase, KVConnectorRole, KVConnectorStats
from kvtier.engine.kv_cache import KVCacheManager, allocate_kv_caches, build_kv_cache_config
from kvtier.engine.model import ModelConfig, TinyTransformer
from kvtier.engine.runner import ModelRunner
from kvtier.engine.scheduler import EngineRequest, RequestStatus, Scheduler, SchedulerConfig
from kvtier.engine.types import CacheConfig, EngineConfig, KVTransferConfig
from kvtier.layout import KVCacheConfig, SlidingWindowSpec

logger = logging.getLogger(__name__)

ConnectorBuilder = Callable[[Any, KVConnectorRole, KVCacheConfig], KVConnectorBase]


@dataclass(frozen=True)
class EngineArgs:
    """Engine shape: model, paged cache, scheduler limits."""

    model: ModelConfig = field(default_factory=ModelConfig)
    block_size: int = 16
    num_blocks: int = 256
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    release_swa_blocks: bool = False
    kv_load_failure_policy: str = "recompute"
    max_idle_seconds: float = 60.0  # time without progress before drain() gives up
    idle_sleep: float = 0.0005  # pause after a step with nothing to compute (lets background I/O run)
    torch_threads: int | None = 1  # intra-op threads while stepping (tiny matrices: more threads only spin)


@dataclass(frozen=True)
class RequestSpec:
    """A request to submit: id, prompt and how many tokens to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 8


class KVTierPair:
    """Builds both TieredConnector halves of one process over one TieredStore (and its I/O loop), opened on the
    first half built, for the engine's KV-cache config (kvtier.store.assembly, as the connector opens its own).

    Use as the engine's ``connector``; the engine closes it after shutting the halves down.
    """

    def __init__(self, cfg: Any) -> None:
        from kvtier.connector.tiered import hmac_key
        from kvtier.tiers.runtime import LoopThread

        self.cfg = cfg
        self._hmac_key = hmac_key(cfg)  # a missing signing key fails here, before any engine is built
        self.loop = LoopThread("kvtier-engine")
        self._store: Any = None

    @property
    def store(self) -> Any:
        """The shared TieredStore (opened by the first half built)."""
        if self._store is None:
            raise RuntimeError("KVTierPair: no connector half was built yet")
        return self._store

    def _open(self, kv_cache_config: KVCacheConfig) -> Any:
        from kvtier.store.tiered import TieredStore

        if self._store is None:
            store = TieredStore.from_config(self.cfg, hmac_key=self._hmac_key, kcc=kv_cache_config)
            try:
                self.loop.run(store.start())  # a tier that fails to start: the started ones are closed
            except BaseException:
                self.loop.close()
                raise
            self._store = store
        return self._store

    def __call__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> KVConnectorBase:
        from kvtier.connector.tiered import TieredConnector

        store = self._open(kv_cache_config)
        return TieredConnector.from_config(self.cfg, role, kv_cache_config, store=store, loop=self.loop,
                                           vllm_config=vllm_config)

    def close(self) -> None:
        """Close the store, then the loop."""
        try:
            if self._store is not None:
                self.loop.run(self._store.close())
        finally:
            self.loop.close()


def factory_connector(vllm_config: Any, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> KVConnectorBase:
    """Build the connector named by ``vllm_config.kv_transfer_config`` through kvtier's factory."""
    from kvtier.connector.factory import create_connector

    conn: KVConnectorBase = create_connector(vllm_config, role, kv_cache_config)
    return conn


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads, restoring the caller's setting after."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Engine:
    """Single-process reference engine (scheduler and worker side by side, as in vLLM's in-process mode)."""

    def __init__(self, args: EngineArgs | None = None, connector: ConnectorBuilder | None = None,
                 kv_transfer_config: KVTransferConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.args = args = args or EngineArgs()
        self.model = TinyTransformer(args.model)
        self.kv_cache_config = build_kv_cache_config(args.model, args.block_size, args.num_blocks)
        windows = [g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
                   for g in self.kv_cache_config.kv_cache_groups]
        self.kv = KVCacheManager(self.kv_cache_config, windows, args.release_swa_blocks)
        self.kv_caches = allocate_kv_caches(args.model, self.kv_cache_config)
        if connector is None and kv_transfer_config is not None and kv_transfer_config.kv_connector:
            connector = factory_connector
        if kv_transfer_config is None and connector is not None:
            kv_transfer_config = KVTransferConfig(kv_connector=getattr(connector, "__name__", None),
                                                  kv_role="kv_both", kv_load_failure_policy="recompute")
        self.vllm_config = EngineConfig(kv_transfer_config=kv_transfer_config,
                                        cache_config=CacheConfig(block_size=args.block_size),
                                        model_config=args.model)
        self._connector_builder = connector
        self.scheduler_connector: KVConnectorBase | None = None
        self.worker_connector: KVConnectorBase | None = None
        if connector is not None:
            self.scheduler_connector = connector(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
            self.worker_connector = connector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        sched_cfg = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, args.kv_load_failure_policy)
        self.scheduler = Scheduler(self.kv, sched_cfg, self.scheduler_connector, clock)
        self.runner = ModelRunner(self.model, self.kv, self.kv_caches, self.worker_connector)
        self.stats = KVConnectorStats()
        self.num_steps = 0
        self.last_scheduled = 0

    def add_request(self, spec: RequestSpec) -> EngineRequest:
        """Queue a request; it must fit the model length and the block pool."""
        total = len(spec.prompt_token_ids) + spec.max_tokens
        if not spec.prompt_token_ids or spec.max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        if total > self.args.model.max_model_len:
            raise ValueError(f"request {spec.request_id}: {total} tokens exceed max_model_len "
                             f"{self.args.model.max_model_len}")
        if self.kv.blocks_needed(total) > self.args.num_blocks - 1:
            raise ValueError(f"request {spec.request_id}: {total} tokens do not fit the block pool")
        req = EngineRequest(request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
                            max_tokens=spec.max_tokens)
        self.scheduler.add_request(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineRequest]:
        """One schedule + execute + update; the requests that finished in it."""
        out = self.scheduler.schedule()
        with _torch_threads(self.args.torch_threads):
            result = self.runner.execute(out, self.scheduler.requests)
        kco = result.kv_connector_output
        if kco is not None and isinstance(kco.kv_connector_stats, KVConnectorStats):
            # run totals: the numbers (rows are this step's)
            self.stats.aggregate(KVConnectorStats(kco.kv_connector_stats.reduce()))
        self.num_steps += 1
        self.last_scheduled = sum(out.num_scheduled_tokens.values())
        return self.scheduler.update_from_output(out, result)

    def run(self, specs: Iterable[RequestSpec], on_step: Callable[[Engine], None] | None = None
            ) -> dict[str, EngineRequest]:
        """Submit requests and step until everything finished and every delayed free came back."""
        for spec in specs:
            self.add_request(spec)
        return {r.request_id: r for r in self.drain(on_step)}

    def drain(self, on_step: Callable[[Engine], None] | None = None) -> list[EngineRequest]:
        """Step until idle (calling ``on_step`` after each step); the finished requests in finishing order."""
        finished: list[EngineRequest] = []
        last, since = self._progress(), time.monotonic()
        while self.has_unfinished():
            finished.extend(self.step())
            if on_step is not None:
                on_step(self)
            now = self._progress()
            if now != last:
                last, since = now, time.monotonic()
                continue
            if time.monotonic() - since > self.args.max_idle_seconds:
                raise RuntimeError(f"engine made no progress in {self.args.max_idle_seconds}s: {self.describe()}")
            time.sleep(self.args.idle_sleep)
        return finished

    def _progress(self) -> tuple[int, ...]:
        reqs = self.scheduler.requests.values()
        return (len(self.scheduler.requests), sum(r.num_computed_tokens for r in reqs),
                sum(r.status is RequestStatus.RUNNING for r in reqs), len(self.scheduler.delayed_free),
                self.num_steps if any(r.status is RequestStatus.RUNNING for r in reqs) else 0)

    def describe(self) -> str:
        s = self.scheduler
        return (f"{len(s.waiting)} waiting, {len(s.running)} running, {len(s.delayed_free)} awaiting saves, "
                f"{self.kv.pool.num_free} free blocks")

    def leaked_blocks(self) -> int:
        """Blocks still allocated (0 once every request is done)."""
        return self.kv.pool.num_blocks - 1 - self.kv.pool.num_free

    def close(self) -> None:
        """Shut both connector halves down; re-raise the first failure after trying both."""
        error: BaseException | None = None
        for conn in (self.worker_connector, self.scheduler_connector):
            if conn is None:
                continue
            try:
                conn.shutdown()
            except Exception as exc:
                logger.warning("connector shutdown failed: %s", exc)
                error = error or exc
        closer = getattr(self._connector_builder, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception as exc:
                logger.warning("closing the connector builder failed: %s", exc)
                error = error or exc
        if error is not None:
            raise error
