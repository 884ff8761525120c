"""Namespace manifests: the shape, the atomic round trip, plain words, and the disk tier writing and skipping them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtier import __version__
from kvtier.connector.keying import Identity, manifests, namespaces
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvtier.records.keys import Namespace
from kvtier.tiers.disk.files import write_manifest
from kvtier.tiers.manifest import MANIFEST_NAME, describe_plainly, manifest_of, read_manifest

NS = Namespace(model="llama-tiny", kv_dtype="float16", group={"kind": "full_attention", "block_size": 16},
               layer_names=tuple(f"l{i}" for i in range(8)), chunk_size=256, fingerprint="abc")
FIELDS = {"kvtier_manifest", "namespace", "model", "revision", "tenant", "kv_dtype", "chunk_size", "tp_rank",
          "tp_size", "fingerprint", "format_version", "group", "layers", "created", "kvtier_version"}


def test_manifest_shape() -> None:
    m = manifest_of(NS, NS.digest())
    assert set(m) == FIELDS
    assert m["kvtier_manifest"] == 1 and m["namespace"] == NS.digest().hex() and m["layers"] == 8
    assert (m["model"], m["revision"], m["kv_dtype"], m["chunk_size"], m["tp_rank"], m["tp_size"]) == \
        ("llama-tiny", "main", "float16", 256, 0, 1)
    assert m["group"] == {"kind": "full_attention", "block_size": 16} and m["kvtier_version"] == __version__
    assert describe_plainly(m) == "llama-tiny rev main, float16, chunk 256, tp 0/1, FullAttention 8 layers"


def test_round_trip_is_atomic_and_invalid_reads_as_none(tmp_path: Path) -> None:
    m = manifest_of(NS, NS.digest())
    assert read_manifest(str(tmp_path)) is None
    write_manifest(str(tmp_path), m)
    assert read_manifest(str(tmp_path)) == m
    assert os.listdir(tmp_path) == [MANIFEST_NAME]  # no temp file left
    assert oct((tmp_path / MANIFEST_NAME).stat().st_mode & 0o777) == "0o600"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**m, "layers": "eight"}))
    assert read_manifest(str(tmp_path)) is None
    (tmp_path / MANIFEST_NAME).write_text("{")
    assert read_manifest(str(tmp_path)) is None


def test_keying_manifests_match_the_namespaces_the_connector_keys_with() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float16")
    kcc = KVCacheConfig((KVCacheGroupSpec(("a", "b"), spec),), num_blocks=8)
    ident = Identity("tiny", fingerprint="f")
    described = manifests(ident, kcc, 32)
    assert list(described) == namespaces(ident, kcc, 32)
    [m] = described.values()
    assert m["model"] == "tiny" and m["layers"] == 2 and m["chunk_size"] == 32 and m["kv_dtype"] == "float16"


async def test_the_disk_tier_writes_a_manifest_once_and_its_scan_skips_it(tmp_path: Path) -> None:
    import torch

    from kvtier.config import DiskTierConfig
    from kvtier.tiers.disk.tier import DiskTier

    digest = NS.digest()
    tier = DiskTier(DiskTierConfig(name="d", capacity=1 << 20, path=str(tmp_path)))
    await tier.describe({digest: manifest_of(NS, digest)})
    await tier.start()
    path = tmp_path / digest.hex() / MANIFEST_NAME
    first = path.stat().st_mtime_ns
    await tier.put([(digest + bytes(16), torch.ones(4))])
    await tier.close()
    again = DiskTier(DiskTierConfig(name="d", capacity=1 << 20, path=str(tmp_path)))
    await again.describe({digest: manifest_of(NS, digest)})
    await again.start()
    assert path.stat().st_mtime_ns == first  # not rewritten
    assert [e.key for e in again.entries()] == [digest + bytes(16)] and again.stats().corrupt == 0
    assert path.exists() and (tmp_path / ".kvtier-ledger").exists() and (tmp_path / ".kvtier-lock").exists()
    await again.close()
