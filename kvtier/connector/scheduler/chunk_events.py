"""What the scheduler knew about each saved chunk, so that the directory's chunk events (kvtier.control.events) can be
published in an engine's terms: the engine's block hashes the chunk covers (vLLM's ``request.block_hashes``),
the hash before them, the chunk's token ids, its KV-cache group and block size.

Kept only while events are on (vLLM: ``--kv-events-config '{"enable_kv_cache_events": true}'``), per chunk
from its save plan until it has left every tier: 4 bytes per token plus the block hashes. An engine without
block hashes (kvtier's reference engine) gets kvtier's own chunk hash as the one block hash, with the chunk
size as block size. A chunk a plan wrote that the catalogue never saw (adopted at start) is published with
kvtier's hash too.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.connector.scheduler.request_state import tokens_of
from kvtier.control.directory import Directory
from kvtier.control.events import EventKind, EventLog
from kvtier.layout import KVCacheConfig
from kvtier.records.keys import DIGEST_BYTES, Key


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk as an engine names it."""

    group: int
    block_hashes: tuple[Any, ...]
    parent_hash: Any
    token_ids: array
    block_size: int


@dataclass(frozen=True)
class PublishedEvent:
    """A chunk event with the chunk's description: ``kind`` in ``tier``."""

    kind: EventKind
    tier: str
    info: ChunkInfo


def chunk_info(request: Any, group: int, index: int, chunk_size: int, block_size: int, key: Key,
               tokens: Sequence[int]) -> ChunkInfo:
    """Chunk ``index`` of ``request`` in ``group``: the engine's block hashes when the request has them (one per
    ``block_size`` tokens), else kvtier's chunk hash."""
    ids = array("i", tokens[index * chunk_size:(index + 1) * chunk_size])
    hashes = getattr(request, "block_hashes", None)
    per_chunk = chunk_size // block_size if block_size else 0
    if hashes and per_chunk and len(hashes) >= (index + 1) * per_chunk:
        start = index * per_chunk
        return ChunkInfo(group, tuple(hashes[start:start + per_chunk]), hashes[start - 1] if start else None, ids,
                         block_size)
    return ChunkInfo(group, (key[DIGEST_BYTES:],), None, ids, chunk_size)


class ChunkEvents:
    """The directory's event log joined with each chunk's description."""

    def __init__(self, directory: Directory, kcc: KVCacheConfig, chunk_size: int) -> None:
        self._directory = directory
        self._block_sizes = [g.kv_cache_spec.block_size for g in kcc.kv_cache_groups]
        self._chunk_size = chunk_size
        self._log = EventLog()
        directory.events = self._log
        self._info: dict[Key, ChunkInfo] = {}

    def note(self, request: Any, group: int, keys: Sequence[Key], indices: Sequence[int]) -> None:
        """Chunks ``indices`` of ``request`` in ``group`` are about to be written (each kept until it has left
        every tier)."""
        for i in indices:
            if keys[i] not in self._info:
                self._info[keys[i]] = self.describe(request, group, i, keys[i])

    def describe(self, request: Any, group: int, index: int, key: Key) -> ChunkInfo:
        """Chunk ``index`` of ``request`` in ``group`` as the engine names it (a chunk held to be saved later keeps
        this, then ``remember`` it when its save is planned)."""
        return chunk_info(request, group, index, self._chunk_size, self._block_sizes[group], key, tokens_of(request))

    def remember(self, key: Key, info: ChunkInfo) -> None:
        """A chunk described earlier is about to be written."""
        self._info.setdefault(key, info)

    def take(self) -> list[PublishedEvent]:
        """The events since the last call, with each chunk's description."""
        out: list[PublishedEvent] = []
        for event in self._log.take():
            for key in event.keys:
                info = self._info.get(key) or ChunkInfo(-1, (key[DIGEST_BYTES:],), None, array("i"), 0)
                out.append(PublishedEvent(event.kind, event.tier, info))
                # gone from every local tier: nothing more will be said of it (a Redis server evicts unseen)
                if (event.kind is EventKind.REMOVED or self._directory.is_shared(event.tier)) and not self._held(key):
                    self._info.pop(key, None)
        return out

    def _held(self, key: Key) -> bool:
        return any(self._directory.holds(tier, key) for tier in self._directory.tier_names
                   if not self._directory.is_shared(tier))

    def __len__(self) -> int:
        return len(self._info)
