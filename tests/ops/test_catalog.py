"""The catalog over real tiers: records written by DiskTier and RedisTier (standalone and cluster), counted per
namespace with their manifests, selected for a purge by model, namespace and age, and deleted."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis_helpers import Make, fresh_prefix, started_tiers

from kvtier.bench.redis_servers import RedisClusterServers, RedisServer
from kvtier.config import DiskTierConfig, RedisTierConfig, load_config
from kvtier.ops.catalog import open_sources
from kvtier.records.codec import HEADER_SIZE
from kvtier.tiers.catalog import InProcess, Selection, plan, summarize
from kvtier.tiers.disk.catalog import DiskSource
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.manifest import NO_MANIFEST, describe, redis_name
from kvtier.tiers.redis.catalog import RedisSource
from kvtier.tiers.redis.tier import RedisTier

NS_A, NS_B = b"A" * 16, b"B" * 16
HOUR = 3600.0


def key(ns: bytes, i: int) -> bytes:
    return ns + i.to_bytes(16, "big")


def manifest(ns: bytes, model: str, **kw: Any) -> dict[str, Any]:
    """A manifest in the shape the disk tier writes."""
    return {"kvtier_manifest": 1, "namespace": ns.hex(), "model": model, "revision": "main", "tenant": "",
            "kv_dtype": "bfloat16", "chunk_size": 256, "tp_rank": 0, "tp_size": 1, "fingerprint": "f",
            "format_version": 1, "group": {"kind": "full_attention"}, "layers": 32, "created": 1.7e9,
            "kvtier_version": "0.1.0", **kw}


async def fill_disk(root: Path, ns: bytes, count: int, elements: int = 64, start: int = 0) -> None:
    """``count`` float16 records of ``elements`` each, written by a real DiskTier under ``root``."""
    tier = DiskTier(DiskTierConfig(name="disk", capacity=1 << 26, path=str(root)))
    await tier.start()
    assert all(await tier.put([(key(ns, start + i), torch.arange(elements, dtype=torch.float16))
                               for i in range(count)]))
    await tier.close()


def write_manifest(root: Path, ns: bytes, model: str) -> None:
    (root / ns.hex() / "manifest.json").write_text(json.dumps(manifest(ns, model)))


def age(root: Path, ns: bytes, seconds: float) -> None:
    """Set every record file of ``ns`` to ``seconds`` old."""
    t = time.time() - seconds
    for f in (root / ns.hex()).rglob("*.kvt"):
        os.utime(f, (t, t))


async def test_disk_counts_bytes_ages_and_manifests(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    await fill_disk(root, NS_A, 3)
    await fill_disk(root, NS_B, 2, elements=128)
    write_manifest(root, NS_A, "meta-llama/Llama-3.1-8B")
    age(root, NS_A, 2 * HOUR)
    os.utime(next((root / NS_A.hex()).rglob("*.kvt")), (time.time() - 5 * HOUR,) * 2)
    (root / ".kvtier-ledger").write_text("{}")  # shared-quota files are not records
    (root / ".kvtier-lock").write_text("")
    summary = summarize(DiskSource(DiskTierConfig(name="disk", capacity=1, path=str(root))))
    assert summary.status == "ok" and summary.records == 5
    a, b = summary.namespaces
    assert (a.namespace, a.records, a.bytes) == (NS_A.hex(), 3, 3 * (HEADER_SIZE + 128))
    assert (b.namespace, b.records, b.bytes) == (NS_B.hex(), 2, 2 * (HEADER_SIZE + 256))
    assert a.oldest is not None and a.newest is not None
    assert abs(time.time() - a.oldest - 5 * HOUR) < 60 and abs(time.time() - a.newest - 2 * HOUR) < 60
    assert a.manifest is not None and a.manifest["model"] == "meta-llama/Llama-3.1-8B"
    assert a.description.startswith("meta-llama/Llama-3.1-8B rev main, bfloat16, chunk 256, tp 0/1, "
                                    "FullAttention 32 layers, written ")
    assert b.manifest is None and b.description == NO_MANIFEST


async def test_disk_rank_directories_are_listed_apart(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    await fill_disk(root, NS_A, 1)
    await fill_disk(root / "tp1-of-2", NS_B, 2)
    (root / "notes").mkdir()  # neither a namespace nor a rank directory: ignored
    summary = summarize(DiskSource(DiskTierConfig(name="disk", capacity=1, path=str(root))))
    assert [(n.where, n.namespace, n.records) for n in summary.namespaces] == \
        [("", NS_A.hex(), 1), ("tp1-of-2", NS_B.hex(), 2)]


def test_missing_disk_directory_is_empty_not_an_error(tmp_path: Path) -> None:
    summary = summarize(DiskSource(DiskTierConfig(name="disk", capacity=1, path=str(tmp_path / "none"))))
    assert (summary.status, summary.records, summary.namespaces) == ("ok", 0, [])


def test_unreadable_manifest_is_said(tmp_path: Path) -> None:
    (tmp_path / NS_A.hex()).mkdir()
    (tmp_path / NS_A.hex() / "manifest.json").write_text("{not json")
    [n] = summarize(DiskSource(DiskTierConfig(name="disk", capacity=1, path=str(tmp_path)))).namespaces
    assert n.records == 0 and n.description.startswith("unknown (manifest not JSON")
    (tmp_path / NS_A.hex() / "manifest.json").write_text('{"kvtier_manifest": 1}')  # fields missing
    [n] = summarize(DiskSource(DiskTierConfig(name="disk", capacity=1, path=str(tmp_path)))).namespaces
    assert n.description == "unknown (manifest not a version-1 kvtier manifest)"


async def two_models(root: Path) -> Path:
    """Two namespaces on disk under ``root``: A (model-a, 3 records, 2 h old), B (model-b, 4 records, 10 days old)."""
    await fill_disk(root, NS_A, 3)
    await fill_disk(root, NS_B, 4)
    write_manifest(root, NS_A, "model-a")
    write_manifest(root, NS_B, "model-b")
    age(root, NS_A, 2 * HOUR)
    age(root, NS_B, 10 * 86400)
    return root


async def test_purge_plan_by_model_namespace_and_age(tmp_path: Path) -> None:
    root = await two_models(tmp_path / "disk")
    source = DiskSource(DiskTierConfig(name="disk", capacity=1, path=str(root)))
    assert {r.namespace for r in plan(source, Selection(model="model-a"))} == {NS_A.hex()}
    assert len(plan(source, Selection(model="model-a"))) == 3
    assert plan(source, Selection(model="nobody")) == []
    assert len(plan(source, Selection(namespace=NS_B.hex()))) == 4
    assert {r.namespace for r in plan(source, Selection(older_than=7 * 86400))} == {NS_B.hex()}
    assert plan(source, Selection(model="model-a", older_than=7 * 86400)) == []
    doomed = plan(source, Selection(model="model-b"))
    assert source.delete(doomed) == (4, 4 * (HEADER_SIZE + 128))
    assert source.delete(doomed) == (0, 0)  # already gone: not counted twice
    assert [(n.namespace, n.records) for n in summarize(source).namespaces] == [(NS_A.hex(), 3), (NS_B.hex(), 0)]
    assert (root / NS_B.hex() / "manifest.json").exists()  # the description stays with its directory


def test_memory_tiers_are_in_process_only() -> None:
    cfg = load_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]}, env={})
    [source] = open_sources(cfg)
    assert isinstance(source, InProcess)
    summary = summarize(source)
    assert summary.status == "in-process" and summary.error == "in-process only, not inspectable offline"


def test_describe_in_plain_words() -> None:
    text = describe(manifest(NS_A, "m", tp_rank=1, tp_size=2, tenant="acme"))
    assert text.startswith("m rev main, tenant acme, bfloat16, chunk 256, tp 1/2, FullAttention 32 layers, written ")
    assert text.endswith("by kvtier 0.1.0")
    assert describe(None) == NO_MANIFEST
    assert describe({"error": "not JSON"}) == "unknown (manifest not JSON)"


# -- Redis --------------------------------------------------------------------------------------------------

@pytest.fixture
async def make_redis(redis_server: RedisServer) -> AsyncIterator[Make]:
    async with started_tiers(redis_server.url) as make:
        yield make


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


async def test_redis_records_manifests_ages_and_purge(make_redis: Make, redis_server: RedisServer) -> None:
    prefix = fresh_prefix("c")
    tier = await make_redis(key_prefix=prefix, ttl=HOUR)
    big = torch.zeros(3 << 20, dtype=torch.float16)  # 6 MiB: stored as a head and parts
    small = [(key(NS_A, i), torch.arange(64, dtype=torch.float16)) for i in range(3)]
    assert await tier.put([*small, (key(NS_B, 0), big)]) == [True] * 4
    tier.describe({NS_A: manifest(NS_A, "model-a")})
    raw = redis.Redis(host="127.0.0.1", port=redis_server.port)
    wait_for(lambda: raw.exists(redis_name(prefix, NS_A.hex())) == 1)
    source = RedisSource(tier.section, env={})
    try:
        summary = summarize(source)
        a, b = summary.namespaces
        assert (a.namespace, a.records, a.bytes) == (NS_A.hex(), 3, 3 * tier.stored_size(128))
        assert (b.namespace, b.records, b.bytes) == (NS_B.hex(), 1, tier.stored_size(big.nbytes))
        assert a.manifest is not None and a.manifest["model"] == "model-a" and b.manifest is None
        assert a.oldest is not None and abs(a.oldest - time.time()) < 60  # estimated from the TTL left
        doomed = plan(source, Selection(model="model-a"))
        assert len(doomed) == 3 and source.delete(doomed) == (3, 3 * tier.stored_size(128))
        [whole] = plan(source, Selection(namespace=NS_B.hex()))
        assert source.delete([whole]) == (1, tier.stored_size(big.nbytes))
        assert raw.keys(f"{prefix}:*") == [redis_name(prefix, NS_A.hex())]  # manifest stays
        assert raw.keys(f"{{{prefix}:*") == []  # the big record's parts went with its head
    finally:
        source.close()


async def test_redis_without_ttl_has_no_age(make_redis: Make, redis_server: RedisServer) -> None:
    prefix = fresh_prefix("c")
    tier = await make_redis(key_prefix=prefix)
    await tier.put([(key(NS_A, 1), torch.ones(8))])
    source = RedisSource(tier.section, env={})
    try:
        [n] = summarize(source).namespaces
        assert (n.records, n.oldest, n.newest) == (1, None, None)
        assert plan(source, Selection(older_than=1.0)) == []  # unknown age never matches
        [(record, data)] = source.read(key(NS_A, 1))
        assert record.header is not None and record.header.shape == (8,) and len(data) == tier.stored_size(32)
    finally:
        source.close()


async def test_redis_cluster_scans_every_node(make_redis: Make, redis_cluster: RedisClusterServers) -> None:
    prefix = fresh_prefix("c")
    tier = await make_redis(redis_cluster.url, key_prefix=prefix)
    assert all(await tier.put([(key(NS_A, i), torch.ones(16)) for i in range(40)]))
    source = RedisSource(tier.section, env={})
    try:
        assert len(source.nodes()) == 3
        [n] = summarize(source).namespaces
        assert (n.records, n.bytes) == (40, 40 * tier.stored_size(64))
        assert len({r.ref for r in source.records()}) == 3  # spread over the masters
        [(_, data)] = source.read(key(NS_A, 7))
        assert len(data) == tier.stored_size(64)
        assert source.delete(plan(source, Selection())) == (40, 40 * tier.stored_size(64))
        assert summarize(source).records == 0
    finally:
        source.close()


def test_unreachable_redis_is_reported() -> None:
    section = RedisTierConfig(name="redis", capacity=1, url="redis://127.0.0.1:1/0", connect_timeout=0.5)
    summary = summarize(RedisSource(section, env={}))
    assert summary.status == "unreachable" and summary.error is not None and "127.0.0.1:1" in summary.error


async def test_describe_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    tier = RedisTier(RedisTierConfig(name="redis", capacity=1, url="redis://127.0.0.1:1/0", connect_timeout=0.2))
    from kvtier.tiers.redis.catalog import publish

    thread = publish(tier.name, tier.endpoint, tier.section, {NS_A: manifest(NS_A, "m")})
    assert thread is not None
    thread.join(10)
    assert "could not write namespace manifests" in caplog.text
