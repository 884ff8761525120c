"""Paged KV cache of the reference engine: one block pool, one block table per request and KV-cache group.

Group 0 holds the full-attention layers, group 1 (when the model has a window) the sliding-window layers.
Block 0 is the null block: never handed out, never written by the engine; a sliding-window group may put it in
place of blocks that fell out of the window (``release_swa_blocks``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from kvtier.engine.model import ModelConfig
from kvtier.geometry import NULL_BLOCK
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec, dtype_name


def build_kv_cache_config(model: ModelConfig, block_size: int, num_blocks: int) -> KVCacheConfig:
    """The engine's layout: group 0 full attention, group 1 sliding window (if the model has one)."""
    if model.max_model_len % block_size:
        raise ValueError("max_model_len must be a multiple of block_size")
    dtype = dtype_name(model.dtype)
    swa = set(model.sliding_layers())
    full = tuple(model.layer_name(i) for i in range(model.num_layers) if i not in swa)
    if not full:
        raise ValueError("the model needs at least one full-attention layer")
    groups = [KVCacheGroupSpec(full, FullAttentionSpec(block_size, model.num_kv_heads, model.head_size, dtype))]
    if swa:
        assert model.sliding_window is not None
        names = tuple(model.layer_name(i) for i in sorted(swa))
        groups.append(KVCacheGroupSpec(names, SlidingWindowSpec(block_size, model.num_kv_heads, model.head_size,
                                                                dtype, sliding_window=model.sliding_window)))
    return KVCacheConfig(tuple(groups), num_blocks)


def allocate_kv_caches(model: ModelConfig, config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, kv_heads, head_size]`` tensor per layer name."""
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    shape = (2, config.num_blocks, block_size, model.num_kv_heads, model.head_size)
    return {model.layer_name(i): torch.zeros(shape, dtype=model.torch_dtype) for i in range(model.num_layers)}


class BlockPool:
    """Free list of block ids ``1 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids, or None when fewer are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        for block in ids:
            if block == NULL_BLOCK:
                continue
            if block not in self._used:
                raise RuntimeError(f"block {block} freed twice")
            self._used.remove(block)
            self._free.append(block)


class KVCacheManager:
    """Block tables per request and group over one shared pool."""

    def __init__(self, config: KVCacheConfig, windows: list[int | None], release_swa_blocks: bool = False) -> None:
        self.config = config
        self.block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
        self.windows = windows
        self.release_swa_blocks = release_swa_blocks
        self.pool = BlockPool(config.num_blocks)
        self.tables: dict[str, list[list[int]]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.config.kv_cache_groups)

    def blocks_of(self, req_id: str) -> tuple[list[int], ...]:
        """Copies of the request's block ids, one list per group (empty lists for an unknown request)."""
        tables = self.tables.get(req_id)
        if tables is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple(list(t) for t in tables)

    def allocate_slots(self, req_id: str, num_computed: int, num_tokens: int) -> tuple[list[int], ...] | None:
        """Give the request blocks for every position a query of ``[num_computed, num_tokens)`` can see;
        the newly placed block ids per group, or None if the pool is short (nothing changes then)."""
        tables = self.tables.setdefault(req_id, [[] for _ in range(self.num_groups)])
        self._release_out_of_window(tables, num_computed)
        need = -(-num_tokens // self.block_size)
        slots = [[b for b in range(self._first_needed(g, num_computed), need)
                  if b >= len(table) or table[b] == NULL_BLOCK] for g, table in enumerate(tables)]
        ids = self.pool.allocate(sum(len(s) for s in slots))
        if ids is None:
            return None
        new: list[list[int]] = []
        for table, positions in zip(tables, slots, strict=True):
            placed = ids[:len(positions)]
            ids = ids[len(positions):]
            table.extend([NULL_BLOCK] * max(0, need - len(table)))
            for b, block in zip(positions, placed, strict=True):
                table[b] = block
            new.append(placed)
        return tuple(new)

    def _first_needed(self, group: int, num_computed: int) -> int:
        """First block a query at ``num_computed`` or later can see (0 unless out-of-window blocks are released)."""
        window = self.windows[group]
        if window is None or not self.release_swa_blocks:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def free(self, req_id: str) -> None:
        """Return every block of the request to the pool."""
        for table in self.tables.pop(req_id, []):
            self.pool.free(table)

    def _release_out_of_window(self, tables: list[list[int]], num_computed: int) -> None:
        """Put the null block in place of sliding-window blocks no future query can see."""
        for g, table in enumerate(tables):
            for b in range(min(self._first_needed(g, num_computed), len(table))):
                if table[b] != NULL_BLOCK:
                    self.pool.free([table[b]])
                    table[b] = NULL_BLOCK

    def slot_table(self, req_ids: list[str], max_len: int) -> list[torch.Tensor]:
        """Per group, ``[N, max_len]`` slot index of every key position (null block past the table)."""
        cols = max_len // self.block_size
        pos = torch.arange(max_len)
        out = []
        for g in range(self.num_groups):
            table = torch.zeros(len(req_ids), cols, dtype=torch.long)
            for r, req_id in enumerate(req_ids):
                ids = self.tables[req_id][g][:cols]
                table[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            out.append(table[:, pos // self.block_size] * self.block_size + pos % self.block_size)
        return out
