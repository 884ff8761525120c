"""Chunk keys per KV-cache group: the namespace of each group and the per-request extra bytes.

The scheduler half computes keys for tensor-parallel rank 0 and ships them in plans; a worker of rank ``r``
swaps the namespace half of each key for its own (``rank_key``), so every rank stores its own shard under
its own key while the directory tracks one key per chunk.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvtier.config import KvtierConfig
from kvtier.connector.settings import EngineSettings
from kvtier.layout import UNSERVED, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvtier.records.fingerprint import FingerprintError, fingerprint, local_weights, weights_id
from kvtier.records.keys import DIGEST_BYTES, Key, Namespace, chunk_keys
from kvtier.tiers.manifest import manifest_of

logger = logging.getLogger(__name__)

# starts every non-empty request extra: not UTF-8, so never the text extras of kvtier before it (salt=, lora=, mm=)
EXTRA_FORMAT = b"\xffx2"
ADAPTER_CONFIG = "adapter_config.json"
Media: TypeAlias = tuple[str | None, int | None, int | None]  # a multimodal input: identifier, offset, length
Packable: TypeAlias = "str | int | Sequence[Packable] | None"


@dataclass(frozen=True)
class Identity:
    """Who computed the KV: model, revision, tenant, tensor-parallel shard, and the fingerprint of the model's
    config, dtypes and weights (kvtier.records.fingerprint; empty when the engine does not describe its model)."""

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
    """The fingerprint of the engine's model (kvtier.records.fingerprint): "" when the engine does not describe one,
    None (with a warning) when its weights cannot be found or read."""
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
    """Namespace digest -> manifest (kvtier.tiers.manifest) of every served group of ``kcc``: what ``Tier.describe``
    takes."""
    out: dict[bytes, dict[str, Any]] = {}
    for g in kcc.kv_cache_groups:
        if g.kind in UNSERVED:
            continue
        ns = group_space(ident, g, chunk_size, rank=rank, kv_layout=kcc.kv_layout, kv_packing=kcc.kv_packing)
        digest = ns.digest()
        out[digest] = manifest_of(ns, digest)
    return out


def request_extra(request: Any, keying: RequestKeying | None = None) -> bytes:
    """Bytes that set a request's KV apart beyond its tokens (``RequestKeying.extra``; without ``keying``, LoRA
    adapters are identified under the default ``namespace.weights`` mode and nothing is kept between calls)."""
    return (keying or RequestKeying()).extra(request)


class RequestKeying:
    """What sets a request's KV apart beyond its tokens, for one scheduler: its cache salt, its LoRA adapter and
    every multimodal input (identifier and placeholder position: placeholder tokens alone do not identify an
    image), encoded by ``encode_extra``.

    An adapter is identified as the base weights are under ``weights`` (``namespace.weights``,
    kvtier.records.fingerprint): ``off``: its name and path (the operator vouches for it); otherwise the identity of its
    weight files and its ``adapter_config.json`` (hub commit, stat or content), not its name: two adapters of one name
    with other files never share KV, one adapter's files share it under any name, in any process. The identity is taken
    once per (name, path) in this process, so under ``content`` the files are read once; a restart takes it again. Each
    later request re-reads the files' sizes and mtimes (a few ``stat`` calls): files replaced while this process
    runs are caught, and as the engine may still serve the adapter it loaded before (vLLM keeps loaded adapters),
    each request of that adapter gets keys of its own from then on until a restart (a warning says so). An
    adapter kvtier cannot read gets a random identity for this process (a warning once): it shares KV with
    nothing outside this process. ``base_model_name`` does not count: the base model is in the namespace.
    """

    def __init__(self, weights: str = "auto") -> None:
        self.weights = weights
        self._adapters: dict[tuple[str, str], _Adapter] = {}

    def extra(self, request: Any) -> bytes:
        """The extra bytes of ``request`` (b"" for a plain one: its keys are those of its tokens alone)."""
        salt = getattr(request, "cache_salt", None)
        lora = getattr(request, "lora_request", None)
        media = [_media(feature) for feature in getattr(request, "mm_features", None) or ()]
        return encode_extra(str(salt) if salt else None, None if lora is None else self.adapter(lora), media)

    def adapter(self, lora: Any) -> tuple[str, ...]:
        """The identity of a LoRA adapter (vLLM's ``LoRARequest``: ``lora_name``, ``lora_path``, older
        ``lora_local_path``)."""
        name = str(getattr(lora, "lora_name", None) or "")
        path = str(getattr(lora, "lora_path", None) or getattr(lora, "lora_local_path", None) or "")
        layout = ("moe-3d",) if getattr(lora, "is_3d_lora_weight", False) is True else ()  # how its files are read
        if self.weights == "off":
            return ("named", name, path, *layout)
        known = self._adapters.get((name, path))
        if known is None:
            known = self._adapters[(name, path)] = self._take(name, path)
        elif known.local is not None and not known.replaced and _changed(known.local, known.signature):
            known.replaced = True
            logger.warning("LoRA adapter %r changed at %s while this process runs: its requests share no KV from "
                           "now on; restart the engine to cache it again", name, known.local)
        if known.replaced:
            return ("replaced", uuid.uuid4().hex)
        return (*known.identity, *layout)

    def _take(self, name: str, path: str) -> _Adapter:
        """The identity of the adapter's files now, and their stat to check later requests against."""
        try:
            local = local_weights(os.path.expanduser(path)) if path else None
            if local is None:
                raise FingerprintError(f"no local copy of {path!r}")
            signature = adapter_files_id(local, "stat")  # first: files written meanwhile then count as replaced
            identity = ("files", adapter_files_id(local, self.weights))
        except Exception as exc:  # a missing, unreadable or odd adapter: KV of its own, never another's
            logger.warning("kvtier cannot tie the KV of LoRA adapter %r (%s) to its files (namespace.weights=%s): "
                           "%s; its requests share no KV beyond this process", name, path, self.weights, exc)
            return _Adapter(("unknown", uuid.uuid4().hex))
        logger.info("kvtier keys LoRA adapter %r (%s) by %s", name, local, identity[1])
        return _Adapter(identity, local, signature)


@dataclass
class _Adapter:
    """One adapter as this process first saw it; ``local`` None when its files could not be read."""

    identity: tuple[str, ...]
    local: str | None = None
    signature: str = ""  # its files' stat when the identity was taken
    replaced: bool = False


def _changed(local: str, signature: str) -> bool:
    """Whether the adapter's files at ``local`` no longer have the stat ``signature`` (or cannot be read: the
    engine may hold either version)."""
    try:
        return adapter_files_id(local, "stat") != signature
    except Exception:
        return True


def adapter_files_id(local: str, mode: str) -> str:
    """The identity of the adapter at ``local`` under ``mode`` (kvtier.records.fingerprint.weights_id): its weight files
    and, beside them, its ``adapter_config.json`` (rank, alpha, target modules), unless a hub commit covers both.
    Raises ``FingerprintError`` or ``OSError``."""
    files = weights_id(local, None, mode)
    config = os.path.join(local, ADAPTER_CONFIG)
    if files.startswith("hub:") or not os.path.isfile(config):
        return files
    return f"{files}+{weights_id(config, None, mode)}"


def encode_extra(salt: str | None, adapter: Sequence[str] | None, media: Sequence[Media]) -> bytes:
    """The extra bytes of a request: b"" without salt, adapter or multimodal input (the keys of plain requests
    are those of their tokens alone), else ``EXTRA_FORMAT`` and the three as one typed, length-prefixed value
    (``_pack``), so no two distinct combinations encode alike, whatever their strings hold."""
    if salt is None and adapter is None and not media:
        return b""
    return EXTRA_FORMAT + _pack([salt, None if adapter is None else list(adapter), [list(m) for m in media]])


def _pack(value: Packable) -> bytes:
    """A type tag, a length (8 bytes, little-endian) and the body: each value's bytes end where its length says,
    so a sequence of them splits back one way only. Strings as UTF-8 (lone surrogates kept, as JSON can send
    them), integers as decimal text, lists by their item count."""
    if value is None:
        return b"N"
    if isinstance(value, str):
        body = value.encode("utf-8", "surrogatepass")
        return b"S" + len(body).to_bytes(8, "little") + body
    if isinstance(value, int):
        body = str(int(value)).encode()
        return b"I" + len(body).to_bytes(8, "little") + body
    return b"L" + len(value).to_bytes(8, "little") + b"".join(_pack(item) for item in value)


def _media(feature: Any) -> Media:
    """One multimodal feature: its identifier (vLLM: ``identifier``, older ``mm_hash``) and the offset and length
    of its placeholder tokens."""
    ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
    pos = getattr(feature, "mm_position", None)
    offset, length = getattr(pos, "offset", None), getattr(pos, "length", None)
    return (None if ident is None else str(ident), None if offset is None else int(offset),
            None if length is None else int(length))


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
