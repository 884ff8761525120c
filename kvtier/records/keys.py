"""Chunking and deterministic chained chunk keys.

A key is 32 bytes: the 16-byte namespace digest followed by the 16-byte chained hash of the chunk:
``h0 = H(namespace)``, ``h_i = H(h_{i-1} || tokens of chunk i as little-endian int32 || extra)`` with H =
blake2b-128. Nothing depends on PYTHONHASHSEED, so keys match across processes, hosts and restarts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KEY_BYTES = 32
DIGEST_BYTES = 16
FORMAT_VERSION = 1

Key = bytes


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two chunks with the same tokens hold different KV."""

    model: str
    revision: str = "main"
    kv_dtype: str = ""
    group: Mapping[str, Any] = field(default_factory=dict)
    layer_names: tuple[str, ...] = ()
    tp_rank: int = 0
    tp_size: int = 1
    chunk_size: int = 256
    tenant: str = ""
    format_version: int = FORMAT_VERSION
    fingerprint: str = ""  # what computes the KV: config, dtypes, quantization, weights (kvtier.records.fingerprint)

    def canonical(self) -> bytes:
        body = {
            "model": self.model, "revision": self.revision, "fingerprint": self.fingerprint, "kv_dtype": self.kv_dtype,
            "group": dict(self.group), "layers": list(self.layer_names), "tp": [self.tp_rank, self.tp_size],
            "chunk": self.chunk_size, "tenant": self.tenant, "v": self.format_version,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.blake2b(self.canonical(), digest_size=DIGEST_BYTES).digest()


def chunk_keys(namespace: bytes, token_ids: Sequence[int] | np.ndarray, chunk_size: int,
               extra: bytes = b"", include_partial: bool = False) -> list[Key]:
    """Keys of the full chunks of ``token_ids`` (and the trailing partial one if ``include_partial``).

    ``namespace`` is a 16-byte namespace digest. ``extra`` (LoRA name, multimodal hashes, cache salt) goes into
    every chunk's hash.
    """
    if len(namespace) != DIGEST_BYTES:
        raise ValueError("namespace must be a 16-byte digest (Namespace.digest())")
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    tokens = np.asarray(token_ids, dtype="<i4")
    n_full = len(tokens) // chunk_size
    ends = [(i + 1) * chunk_size for i in range(n_full)]
    if include_partial and len(tokens) % chunk_size:
        ends.append(len(tokens))
    raw = tokens.tobytes()
    prev = hashlib.blake2b(namespace, digest_size=DIGEST_BYTES).digest()
    keys: list[Key] = []
    start = 0
    blake = hashlib.blake2b
    for end in ends:
        h = blake(prev, digest_size=DIGEST_BYTES)
        h.update(raw[start * 4:end * 4])
        if extra:
            h.update(extra)
        prev = h.digest()
        keys.append(namespace + prev)
        start = end
    return keys


def key_namespace(key: Key) -> bytes:
    return key[:DIGEST_BYTES]


def key_hex(key: Key) -> str:
    return key.hex()
