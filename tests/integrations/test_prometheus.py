"""kvtier.integrations.prometheus: the one table of metric names, read from snapshots, and the exporter that serves a
TieredStore's metrics on a port without vLLM (scraped over HTTP here)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import load_config
from kvtier.integrations.prometheus import BY_NAME, METRICS, samples, serve_store, totals
from kvtier.records.keys import Namespace, chunk_keys
from kvtier.store.tiered import TieredStore

CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 8)
NBYTES = 2 * 2 * CHUNK * 2 * 8 * 4


def test_names_follow_prometheus_conventions() -> None:
    for m in METRICS:
        assert re.fullmatch(r"kvtier_[a-z_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert not m.name.endswith("_total") or "_seconds" not in m.name or m.name.endswith("_seconds_total")
    assert len(BY_NAME) == len(METRICS)


def test_snapshot_keys_map_to_labelled_samples_and_unknown_keys_are_left_out() -> None:
    data = {"loaded:disk_a:1": 3, "loaded_tokens:disk_a:1": 96, "tier_disk_a_get_hits": 2, "tier_disk_a_hits": 1,
            "tier_redis_server_errors": 4, "directory_evictions_cpu": 5, "directory_lookups": 9,
            "gauge:used_bytes:cpu:0": 100, "samples:load_seconds": [0.1, 0.2], "load_chunks": 3,
            "tier_x_reads_cached": 7, "tier_redis_breaker_state": 2, "no_such_key": 1}
    got = {(name, tuple(sorted(labels.items()))): value for name, labels, value in samples(data)}
    assert got == {
        ("kvtier_hit_chunks_total", (("group", "1"), ("tier", "disk_a"))): 3,
        ("kvtier_hit_tokens_total", (("group", "1"), ("tier", "disk_a"))): 96,
        ("kvtier_tier_read_hits_total", (("tier", "disk_a"),)): 2,
        ("kvtier_lookup_hit_chunks_total", (("tier", "disk_a"),)): 1,
        ("kvtier_tier_errors_total", (("kind", "server"), ("tier", "redis"))): 4,
        ("kvtier_evictions_total", (("tier", "cpu"),)): 5,
        ("kvtier_lookup_chunks_total", (("tier", "local"),)): 9,
        ("kvtier_used_bytes", (("rank", "0"), ("tier", "cpu"))): 100,
        ("kvtier_load_seconds", ()): [0.1, 0.2],
    }
    summed = totals({"directory_evictions_cpu": 2, "tier_cpu_evictions": 1})  # two owners, one series
    assert summed["kvtier_evictions_total"] == {(("tier", "cpu"),): 3.0}


async def test_a_store_serves_its_metrics_on_a_port(tmp_path: Path) -> None:
    cfg = load_config({"chunk_size": CHUNK, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity": 2 * NBYTES, "slot_bytes": NBYTES},
        {"name": "disk", "kind": "disk", "capacity": 16 * (NBYTES + 4096), "path": str(tmp_path)}]}, env={})
    store = TieredStore.from_config(cfg)
    await store.start()
    server = serve_store(store, 0)
    try:
        keys = chunk_keys(Namespace("test").digest(), list(range(4 * CHUNK)), CHUNK)
        assert await store.put([(k, torch.full(SHAPE, float(i))) for i, k in enumerate(keys)]) == 2  # cpu took 2
        assert (await store.lookup(keys)).hits == 4
        await store.get(keys)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value
                  for family in text_string_to_metric_families(text) for s in family.samples}
        assert values[("kvtier_stored_chunks_total", (("tier", "cpu"),))] >= 2
        assert values[("kvtier_stored_chunks_total", (("tier", "disk"),))] >= 2  # cpu holds 2: the rest below
        assert values[("kvtier_capacity_bytes", (("rank", "0"), ("tier", "cpu")))] == 2 * NBYTES
        assert values[("kvtier_used_bytes", (("rank", "0"), ("tier", "disk")))] > 0
        assert values[("kvtier_lookup_hit_chunks_total", (("tier", "local"),))] >= 4
        assert values[("kvtier_evictions_total", (("tier", "cpu"),))] >= 2
    finally:
        server.shutdown()
        await store.close()
