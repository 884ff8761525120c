"""Recurrent state on the scheduler side: which blocks hold the states (Mamba / linear attention, vLLM's
``mamba_cache_mode="align"``) a step writes at chunk boundaries, as the engine offers them.

A state group's block table cannot be followed by position: the engine nulls and reuses its slots as the running
state moves on, so only the engine knows which block holds the state at a boundary. vLLM (>= 0.32) hands the
exact blocks to the connector in the step whose forward writes them
(``scheduler_output.kv_connector_block_state.boundary_state_offloads``); kvtier's reference engine does the same.
The state at boundary ``b`` (a multiple of ``chunk_size``) is stored as chunk ``b // chunk_size - 1`` of its group,
under that chunk's key: the key chains every token before ``b``, which is what the state depends on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.layout import GroupKind, KVCacheConfig
from kvtier.layout.geometry import NULL_BLOCK

# (group id, block id, boundary tokens) of one offered state
Offer = tuple[int, int, int]


def boundary_offers(scheduler_output: Any) -> dict[str, list[Offer]]:
    """The states this step writes, per request (empty for engines that offer none)."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    return dict(getattr(block_state, "boundary_state_offloads", None) or {})


def state_chunks(offers: Sequence[Offer], kcc: KVCacheConfig, chunk_size: int
                 ) -> dict[int, list[tuple[int, tuple[int, ...]]]]:
    """Per state group, ``(chunk index, (block id,))`` of each offered state at a chunk boundary; offers of other
    groups, of the null block or between chunk boundaries are left out."""
    groups = kcc.kv_cache_groups
    out: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for group, block, boundary in offers:
        if not 0 <= group < len(groups) or groups[group].kind is not GroupKind.MAMBA:
            continue
        if block == NULL_BLOCK or boundary <= 0 or boundary % chunk_size:
            continue
        out.setdefault(group, []).append((boundary // chunk_size - 1, (int(block),)))
    return out
