"""kvtier in vLLM 0.33's own observability: its metrics through ``build_prom_metrics`` into vLLM's registry, and
its KV events (``BlockStored`` / ``BlockRemoved``) through the real Scheduler's ``take_events`` to the publisher.

The engine is test_vllm_scheduler's: vLLM's real Scheduler, kvtier's two halves, a fake forward pass."""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvtier.integrations.vllm import KVTierConnector
from tests.integration.test_vllm_scheduler import PREFIX, Engine


class Capture:
    """Stands in for vLLM's ZMQ publisher: keeps every batch the scheduler publishes."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def _engine(kit: Any, make_vllm_config: Any, kvtier_config_file: Any, tiers: str, events: bool) -> Engine:
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file(tiers=tiers), serve_without_prefix_caching=True),
                           prefix_caching=False)
    if events:
        cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return Engine(cfg, kit.planned_kv_cache_config(hybrid=False), kit)


def test_evicted_chunks_are_published_stored_then_removed_with_vllms_block_hashes(
        kit: Any, make_vllm_config: Any, kvtier_config_file: Any, tmp_path: Any) -> None:
    """A cpu tier of 2 chunks: r1's 2 chunks enter it, then r2's 2 chunks evict them (write-back demotes them to
    disk). Each event carries the request's own block hashes, its group, medium and tier, in order."""
    tiers = ("[{name: cpu, kind: cpu, capacity: 32KiB}, "  # 2 chunks of 16 tokens x 4 layers x K/V x 2 x 32 fp16
             "{name: disk, kind: disk, capacity: 16MiB, path: %s}]" % (tmp_path / "kv"))
    engine = _engine(kit, make_vllm_config, kvtier_config_file, tiers, events=True)
    capture = Capture()
    engine.scheduler.kv_event_publisher = capture
    try:
        first = add_hashed(engine, "r1", PREFIX[:32])
        list(engine.run())
        second = add_hashed(engine, "r2", PREFIX[32:])
        list(engine.run())
        mine = [e for e in capture.events if (getattr(e, "ownership", None) or "").startswith("kvtier:")]
        seen = [(type(e).__name__, e.medium, e.ownership, tuple(e.block_hashes)) for e in mine]
        for h in first:  # stored in cpu, then removed from it, then stored on disk
            stored = seen.index(("BlockStored", "CPU", "kvtier:cpu", (h,)))
            removed = seen.index(("BlockRemoved", "CPU", "kvtier:cpu", (h,)))
            assert stored < removed < seen.index(("BlockStored", "STORAGE", "kvtier:disk", (h,)))
        for h in second:  # still in cpu
            assert ("BlockStored", "CPU", "kvtier:cpu", (h,)) in seen
            assert ("BlockRemoved", "CPU", "kvtier:cpu", (h,)) not in seen
        assert len(seen) == 3 * len(first) + len(second)
        event = next(e for e in mine if isinstance(e, BlockStored) and tuple(e.block_hashes) == (first[1],))
        assert event.parent_block_hash == first[0] and event.block_size == 16 and event.group_idx == 0
        assert event.token_ids == PREFIX[16:32]
        assert all(isinstance(e, (BlockStored, BlockRemoved)) for e in mine)
    finally:
        engine.close()


def add_hashed(engine: Engine, req_id: str, prompt: list[int]) -> list[Any]:
    """Add a request with vLLM's block hasher (as vLLM's engine core does when a connector is set); its block
    hashes are what vLLM's own KV events name."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request(req_id, prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(16, sha256))
    engine.scheduler.add_request(request)
    return list(request.block_hashes)


def test_metrics_reach_vllms_registry_labelled_by_tier_and_group(kit: Any, make_vllm_config: Any,
                                                                  kvtier_config_file: Any) -> None:
    """A hit from cpu shows in kvtier_hit_tokens_total{tier="cpu",group="0"}, equal to the tokens the engine did
    not compute; stores, bytes and the tier's level are there too."""
    engine = _engine(kit, make_vllm_config, kvtier_config_file, "[{name: cpu, kind: cpu, capacity: 4MiB}]",
                     events=False)
    registry = prometheus_client.CollectorRegistry()
    types = {Counter: _bound(Counter, registry), Gauge: _bound(Gauge, registry), Histogram: _bound(Histogram, registry)}
    prom = KVTierConnector.build_prom_metrics(engine.scheduler.connector._vllm_config, types, ["engine"], {0: ["0"]})
    try:
        engine.add("r1", PREFIX)
        list(engine.run())
        engine.add("r2", [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6])
        steps = list(engine.run())
        for stats in engine.stats:
            prom.observe(stats.data, 0)
        computed = sum(s.num_scheduled_tokens.get("r2", 0) for s in steps)
        assert computed == 8
        value = registry.get_sample_value
        assert value("kvtier_hit_tokens_total", {"engine": "0", "tier": "cpu", "group": "0"}) == 64
        assert value("kvtier_hit_chunks_total", {"engine": "0", "tier": "cpu", "group": "0"}) == 4
        assert value("kvtier_stored_chunks_total", {"engine": "0", "tier": "cpu"}) == 4
        assert value("kvtier_used_bytes", {"engine": "0", "tier": "cpu", "rank": "0"}) > 0
        assert value("kvtier_store_seconds_count", {"engine": "0"}) >= 1
    finally:
        engine.close()


def _bound(cls: Any, registry: Any) -> Any:
    """A metric class that registers into ``registry`` (vLLM passes its own classes the same way)."""

    def make(*args: Any, **kw: Any) -> Any:
        kw.pop("multiprocess_mode", None)
        return cls(*args, registry=registry, **kw)

    return make
