"""Namespace manifests: what model, revision and layout a namespace's records hold, in a small JSON document.

The shape and the disk file are ``kvtier.tiers.manifest``'s (``<tier root>/<namespace hex>/manifest.json``, written
by the disk tier). In Redis a manifest is the value of ``{key_prefix}:manifest:{namespace hex}``, SET by the
Redis tier when the connector describes its namespaces (:func:`publish`). Readers here tell a missing manifest
from an unreadable one, and :func:`describe` says which.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.tiers.manifest import MANIFEST_NAME, describe_plainly, is_valid

if TYPE_CHECKING:
    from kvtier.tiers.redis.tier import RedisTier

log = logging.getLogger(__name__)

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


def publish(tier: RedisTier, manifests: Mapping[bytes, Mapping[str, Any]]) -> threading.Thread | None:
    """SET each namespace's manifest key in the background (its own short-lived sync client, so it works from
    any thread, before or after ``start``); failures are logged once, never raised. Returns the thread."""
    items = {redis_name(tier.section.key_prefix, ns.hex()): json.dumps(dict(m), sort_keys=True).encode()
             for ns, m in manifests.items()}
    if not items:
        return None
    thread = threading.Thread(target=_publish, args=(tier, items), name="kvtier-redis-manifest", daemon=True)
    thread.start()
    return thread


def _publish(tier: RedisTier, items: Mapping[bytes, bytes]) -> None:
    from kvtier.tiers.redis.catalog import connect

    try:
        client = connect(tier.endpoint, tier.section)
        try:
            for name, value in items.items():
                client.set(name, value)
        finally:
            client.close()
    except Exception as exc:  # a description is best effort: never the engine's problem
        log.warning("redis tier %r: could not write namespace manifests (%s: %s)", tier.name,
                    type(exc).__name__, exc)
