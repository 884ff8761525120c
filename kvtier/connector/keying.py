"""Chunk keys per KV-cache group: the namespace of each group and the per-request extra bytes.

The scheduler half computes keys for tensor-parallel rank 0 and ships them in plans; a worker of rank ``r``
swaps the namespace half of each key for its own (``rank_key``), so every rank stores its own shard under
its own key while the directory tracks one key per chunk.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.connector.settings import EngineSettings
from kvtier.fingerprint import fingerprint
from kvtier.keys import DIGEST_BYTES, Key, Namespace, chunk_keys
from kvtier.layout import UNSERVED, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvtier.manifest import manifest_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    """Who computed the KV: model, revision, tenant, tensor-parallel shard, and the fingerprint of the model's
    config, dtypes and weights (kvtier.fingerprint; empty when the engine does not describe its model)."""

    model: str
    revision: str = "main"
    tenant: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    fingerprint: str | None = ""  # None: the weights could not be fingerprinted (nothing may be served)


def identity_from(cfg: KvtierConfig, engine: EngineSettings | None = None, tp_rank: int | None = None, *,
                  fingerprinted: bool = True) -> Identity:
    """The identity from kvtier's namespace section; the engine's model name when the section leaves it
    at "default"; the tensor-parallel size from the engine's parallel config; with ``fingerprinted``, the
    fingerprint of the engine's model under ``namespace.weights`` (None when it cannot be taken)."""
    engine = engine or EngineSettings()
    model = cfg.namespace.model
    if model == "default" and engine.model:
        model = engine.model
    size = max(1, engine.tp_size)
    rank = tp_rank if tp_rank is not None else engine.rank % size
    digest = model_fingerprint(engine, cfg.namespace.weights) if fingerprinted else ""
    return Identity(model, cfg.namespace.revision, cfg.namespace.tenant, rank, size, digest)


def model_fingerprint(engine: EngineSettings, mode: str) -> str | None:
    """The fingerprint of the engine's model (kvtier.fingerprint): "" when the engine does not describe one, None
    (with a warning) when its weights cannot be found or read."""
    try:
        facts = engine.model_facts()
        if facts is None:
            return ""
        digest = fingerprint(facts, mode)
    except Exception as exc:  # a missing, unreadable or odd checkpoint or config: no cache rather than a wrong one
        logger.warning("kvtier cannot tie its records to the weights of %s (namespace.weights=%s): %s",
                       engine.model, mode, exc)
        return None
    logger.info("kvtier records are tied to %s (namespace.weights=%s, fingerprint %s)", facts.model, mode, digest)
    return digest


def _known(digest: str | None) -> str:
    """A fingerprint for the namespace; one that matches nothing ever written when it could not be taken (this
    process then only misses: its loads fail and are recomputed)."""
    return digest if digest is not None else f"unknown-{uuid.uuid4().hex}"


def group_namespace(ident: Identity, group: KVCacheGroupSpec, chunk_size: int, *,
                    rank: int | None = None, kv_layout: str | None = None, kv_packing: str | None = None) -> bytes:
    """16-byte namespace digest of one group (for ``rank``, default the identity's rank). ``kv_layout`` and
    ``kv_packing`` (vLLM's resolved KV-cache layout and device type, when the engine has them) are part of it:
    records hold pages as they lie in that engine's memory."""
    return group_space(ident, group, chunk_size, rank=rank, kv_layout=kv_layout, kv_packing=kv_packing).digest()


def group_space(ident: Identity, group: KVCacheGroupSpec, chunk_size: int, *,
                rank: int | None = None, kv_layout: str | None = None, kv_packing: str | None = None) -> Namespace:
    """The ``Namespace`` of one group, whose digest ``group_namespace`` returns."""
    spec = group.kv_cache_spec
    described = spec.describe()
    if kv_layout is not None:
        described = {**described, "kv_layout": kv_layout}
    if kv_packing is not None:
        described = {**described, "kv_packing": kv_packing}
    ns = Namespace(
        model=ident.model, revision=ident.revision, fingerprint=_known(ident.fingerprint),
        kv_dtype=spec.dtype if isinstance(spec, FullAttentionSpec) else "",
        group=described, layer_names=tuple(group.layer_names),
        tp_rank=ident.tp_rank if rank is None else rank, tp_size=ident.tp_size,
        chunk_size=chunk_size, tenant=ident.tenant,
    )
    return ns


def namespaces(ident: Identity, kcc: KVCacheConfig, chunk_size: int, *, rank: int | None = None) -> list[bytes]:
    """Namespace digest of every group of ``kcc``, in group order."""
    return [group_namespace(ident, g, chunk_size, rank=rank, kv_layout=kcc.kv_layout, kv_packing=kcc.kv_packing)
            for g in kcc.kv_cache_groups]


def manifests(ident: Identity, kcc: KVCacheConfig, chunk_size: int, *,
              rank: int | None = None) -> dict[bytes, dict[str, Any]]:
    """Namespace digest -> manifest (kvtier.manifest) of every served group of ``kcc``: what ``Tier.describe``
    takes."""
    out: dict[bytes, dict[str, Any]] = {}
    for g in kcc.kv_cache_groups:
        if g.kind in UNSERVED:
            continue
        ns = group_space(ident, g, chunk_size, rank=rank, kv_layout=kcc.kv_layout, kv_packing=kcc.kv_packing)
        digest = ns.digest()
        out[digest] = manifest_of(ns, digest)
    return out


def request_extra(request: Any) -> bytes:
    """Bytes that set a request's KV apart beyond its tokens: cache salt, LoRA adapter and every multimodal
    input (identifier and placeholder position): placeholder tokens alone do not identify an image."""
    parts: list[str] = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', None) or lora}")
    parts.extend(_mm_part(feature) for feature in getattr(request, "mm_features", None) or ())
    return "\x00".join(parts).encode()


def _mm_part(feature: Any) -> str:
    """One multimodal feature as text: its identifier (vLLM: ``identifier``, older ``mm_hash``) and the
    offset/length of its placeholder tokens."""
    ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
    pos = getattr(feature, "mm_position", None)
    return f"mm={ident}@{getattr(pos, 'offset', None)}+{getattr(pos, 'length', None)}"


def has_prompt_embeds(request: Any) -> bool:
    """Whether the request carries prompt embeddings: its KV is not identified by its token ids."""
    return getattr(request, "prompt_embeds", None) is not None


def request_keys(spaces: Sequence[bytes], token_ids: Sequence[int], chunk_size: int,
                 extra: bytes) -> list[list[Key]]:
    """Keys of the full chunks of ``token_ids`` for every group."""
    return [chunk_keys(ns, token_ids, chunk_size, extra=extra) for ns in spaces]


def rank_key(key: Key, namespace: bytes) -> Key:
    """The same chunk under another namespace digest (another tensor-parallel rank)."""
    return namespace + key[DIGEST_BYTES:]
