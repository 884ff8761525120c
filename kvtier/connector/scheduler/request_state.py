"""What the scheduler half keeps per request: its chunk keys, block ids, saved chunks, and the hit last found."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.records.keys import Key


@dataclass
class Hit:
    """The hit a lookup found: chunks, the engine's own tokens, where each chunk of each group is."""

    chunks: int
    local_tokens: int
    locations: list[list[str | None]]
    is_async: bool


@dataclass
class ReqState:
    """One request as the scheduler half tracks it."""

    source: Any  # the engine's request (its token list grows with outputs) or its NewRequestData
    extra: bytes
    keys: list[list[Key]]
    block_ids: list[list[int]] = field(default_factory=list)
    saved_chunks: int = 0
    unfilled: list[range] = field(default_factory=list)  # per group: chunks a load left unwritten (never saved)
    opaque: bool = False  # prompt embeds: token ids do not identify the KV, so no hits and no saves
    counted: bool = False  # its keys joined the reuse counts (once per request)
    save_class: int | None = None  # its class for the save admission, from its first lookup
    reach: int = 0  # chunks its first lookup found in the engine's cache or in the admission's ghosts
    refreshed: bool = False  # kvtier's copies of the engine's own hit were refreshed (once per request)
    loaded: int = 0  # chunks of its hit (the engine's own and those kvtier loaded)
    admitted: bool | None = None  # whether the save admission takes its chunks (decided at its first save)
    in_shared: set[tuple[str, Key]] = field(default_factory=set)  # (shared tier, key) its hit found there


def tokens_of(source: Any) -> Sequence[int]:
    """Every token whose KV the engine may compute: prompt and outputs when the request object has them."""
    tokens = getattr(source, "all_token_ids", None)
    return tokens if tokens is not None else (source.prompt_token_ids or ())
