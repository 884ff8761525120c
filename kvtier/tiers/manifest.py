"""The manifest of a namespace directory: what the records under ``<root>/<namespace hex>/`` hold, in plain JSON.

A disk tier writes ``manifest.json`` once, when a namespace is first described or written, so that ``kvtier
stats`` / ``inspect`` / ``purge`` (and a person with ``cat``) can name a directory's model, revision and layout
without the engine. In Redis a manifest is the value of ``{key_prefix}:manifest:{namespace hex}``, SET by the Redis
tier when the connector describes its namespaces (kvtier.tiers.redis.catalog.publish). Shape (version 1)::

    {"kvtier_manifest": 1, "namespace": "<32 hex>", "model": str, "revision": str, "tenant": str,
     "kv_dtype": str, "chunk_size": int, "tp_rank": int, "tp_size": int, "fingerprint": str,
     "format_version": int, "group": {...}, "layers": int, "created": float, "kvtier_version": str}
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from kvtier.records.keys import DIGEST_BYTES, Namespace

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "namespace": str, "model": str, "revision": str, "tenant": str, "kv_dtype": str, "chunk_size": int,
    "tp_rank": int, "tp_size": int, "fingerprint": str, "format_version": int, "group": dict, "layers": int,
    "created": (int, float), "kvtier_version": str,
}


def manifest_of(ns: Namespace, digest: bytes) -> dict[str, Any]:
    """The manifest of namespace ``ns`` whose digest is ``digest`` (``ns.digest()``, passed to avoid hashing)."""
    from kvtier import __version__

    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a namespace digest has {DIGEST_BYTES} bytes, got {len(digest)}")
    return {
        "kvtier_manifest": MANIFEST_VERSION, "namespace": digest.hex(), "model": ns.model, "revision": ns.revision,
        "tenant": ns.tenant, "kv_dtype": ns.kv_dtype, "chunk_size": ns.chunk_size, "tp_rank": ns.tp_rank,
        "tp_size": ns.tp_size, "fingerprint": ns.fingerprint, "format_version": ns.format_version,
        "group": dict(ns.group), "layers": len(ns.layer_names), "created": time.time(),
        "kvtier_version": __version__,
    }


def is_valid(manifest: Any) -> bool:
    """Whether ``manifest`` has the version-1 shape (every field present with its type)."""
    if not isinstance(manifest, dict) or manifest.get("kvtier_manifest") != MANIFEST_VERSION:
        return False
    for name, kind in _FIELDS.items():
        value = manifest.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return False
    return True


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest in ``directory``; None when it is absent, unreadable or not a version-1 manifest."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            manifest = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    return manifest if is_valid(manifest) else None


def same_namespace(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two manifests describe the same namespace (everything but ``created`` and ``kvtier_version``)."""
    skip = {"created", "kvtier_version"}
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def describe_plainly(manifest: Mapping[str, Any]) -> str:
    """One line for people, e.g. ``llama-tiny rev main, float16, chunk 256, tp 0/1, FullAttention 8 layers``."""
    group = manifest.get("group") or {}
    kind = str(group.get("kind", "")) if isinstance(group, Mapping) else ""
    kind_words = "".join(part.capitalize() for part in kind.split("_")) or "unknown group"
    parts = [f"{manifest.get('model', '?')} rev {manifest.get('revision', '?')}"]
    if manifest.get("tenant"):
        parts.append(f"tenant {manifest['tenant']}")
    if manifest.get("kv_dtype"):
        parts.append(str(manifest["kv_dtype"]))
    parts.append(f"chunk {manifest.get('chunk_size', '?')}")
    parts.append(f"tp {manifest.get('tp_rank', '?')}/{manifest.get('tp_size', '?')}")
    parts.append(f"{kind_words} {manifest.get('layers', '?')} layers")
    return ", ".join(parts)


# -- the readers of ``kvtier stats``, ``inspect`` and ``purge``: a missing manifest told from an unreadable one

NO_MANIFEST = "unknown (no manifest)"
MAX_MANIFEST_BYTES = 1 << 16
Manifest = dict[str, Any]


def parse(raw: bytes | str | None) -> Manifest | None:
    """The manifest in ``raw`` (JSON), or ``{"error": ...}`` when it is not one; None when ``raw`` is None."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return {"error": f"not JSON ({exc})"}
    if not is_valid(value):
        return {"error": "not a version-1 kvtier manifest"}
    return dict(value)


def read_disk(namespace_dir: str) -> Manifest | None:
    """``manifest.json`` of a namespace directory (None when absent)."""
    try:
        with open(os.path.join(namespace_dir, MANIFEST_NAME), "rb") as f:
            return parse(f.read(MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return {"error": f"unreadable ({exc.strerror or exc})"}


def redis_name(key_prefix: str, namespace_hex: str) -> bytes:
    """Redis key of a namespace's manifest: ``{key_prefix}:manifest:{namespace hex}``."""
    return f"{key_prefix}:manifest:{namespace_hex}".encode()


def describe(manifest: Mapping[str, Any] | None) -> str:
    """The manifest in plain words (``kvtier.tiers.manifest.describe_plainly``) and when and by what it was written,
    e.g. ``llama rev main, bfloat16, chunk 256, tp 0/1, FullAttention 32 layers, written 2025-01-31 12:00 by
    kvtier 0.4.0``; says so when there is none or it is unreadable."""
    if manifest is None:
        return NO_MANIFEST
    if "error" in manifest:
        return f"unknown (manifest {manifest['error']})"
    written = []
    if isinstance(manifest.get("created"), int | float):
        written.append(time.strftime("%Y-%m-%d %H:%M", time.localtime(manifest["created"])))
    if manifest.get("kvtier_version"):
        written.append(f"by kvtier {manifest['kvtier_version']}")
    return describe_plainly(manifest) + (", written " + " ".join(written) if written else "")
