"""Paged KV cache of the reference engine: one block pool, one block table per request and KV-cache group.

Group 0 holds the full-attention layers, then (when the model has them) a group of the sliding-window layers and
a ``GroupKind.MAMBA`` group of the recurrent layers. Block 0 is the null block: never handed out, never written
by the engine; a sliding-window group may put it in place of blocks that fell out of the window
(``release_swa_blocks``).

A recurrent group's table follows vLLM's Mamba "align" mode: slot ``p`` holds the state after exactly
``(p + 1) * block_size`` tokens; a step computing up to ``seq_len`` tokens runs its state in slot
``(seq_len - 1) // block_size``. Only two slots hold real blocks, the running one and the one of the previous
step's state (the runner copies that state into a new running slot; a connector may still read it): every
other slot is the null block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from kvtier.engine.model import ModelConfig
from kvtier.layout import (
    FullAttentionSpec,
    GroupKind,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    dtype_name,
)
from kvtier.layout.geometry import NULL_BLOCK


def build_kv_cache_config(model: ModelConfig, block_size: int, num_blocks: int) -> KVCacheConfig:
    """The engine's layout: group 0 full attention, then sliding window and recurrent groups (if any)."""
    if model.max_model_len % block_size:
        raise ValueError("max_model_len must be a multiple of block_size")
    dtype = dtype_name(model.dtype)
    swa = set(model.sliding_layers())
    full = tuple(model.layer_name(i) for i in range(model.num_layers)
                 if i not in swa and not model.is_recurrent(i))
    if not full:
        raise ValueError("the model needs at least one full-attention layer")
    groups = [KVCacheGroupSpec(full, FullAttentionSpec(block_size, model.num_kv_heads, model.head_size, dtype))]
    if swa:
        assert model.sliding_window is not None
        names = tuple(model.layer_name(i) for i in sorted(swa))
        groups.append(KVCacheGroupSpec(names, SlidingWindowSpec(block_size, model.num_kv_heads, model.head_size,
                                                                dtype, sliding_window=model.sliding_window)))
    if model.recurrent_layers:
        layout = model.state_layout()
        names = tuple(model.layer_name(i) for i in sorted(model.recurrent_layers))
        groups.append(KVCacheGroupSpec(names, MambaSpec(block_size, layout.shapes, layout.dtypes)))
    return KVCacheConfig(tuple(groups), num_blocks)


def allocate_kv_caches(model: ModelConfig, config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """One zeroed tensor per layer name: ``[2, num_blocks, block_size, kv_heads, head_size]`` for attention,
    ``uint8 [num_blocks, row_bytes]`` for a recurrent layer's states (kvtier.engine.recurrent)."""
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    shape = (2, config.num_blocks, block_size, model.num_kv_heads, model.head_size)
    layout = model.state_layout()
    return {model.layer_name(i): layout.allocate(config.num_blocks) if model.is_recurrent(i)
            else torch.zeros(shape, dtype=model.torch_dtype) for i in range(model.num_layers)}


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
        states = [g for g, group in enumerate(config.kv_cache_groups) if group.kind is GroupKind.MAMBA]
        if len(states) > 1:
            raise ValueError("the reference engine holds at most one recurrent (Mamba) group")
        self.state_group: int | None = states[0] if states else None

    @property
    def num_groups(self) -> int:
        return len(self.config.kv_cache_groups)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens may hold at once over every group."""
        per_group = -(-num_tokens // self.block_size)
        return sum(min(2, per_group) if g == self.state_group else per_group for g in range(self.num_groups))

    def state_slot(self, seq_len: int) -> int:
        """Slot of a recurrent group's table holding the state after ``seq_len`` tokens (the running slot of a
        step that ends there)."""
        return (seq_len - 1) // self.block_size

    def state_block(self, req_id: str, seq_len: int) -> int:
        """Block of the request's recurrent group holding the state after ``seq_len`` tokens."""
        if self.state_group is None:
            raise ValueError("the model has no recurrent layers")
        return self.tables[req_id][self.state_group][self.state_slot(seq_len)]

    def blocks_of(self, req_id: str) -> tuple[list[int], ...]:
        """Copies of the request's block ids, one list per group (empty lists for an unknown request)."""
        tables = self.tables.get(req_id)
        if tables is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple(list(t) for t in tables)

    def allocate_slots(self, req_id: str, num_computed: int, num_tokens: int,
                       num_external: int = 0) -> tuple[list[int], ...] | None:
        """Give the request blocks for every position a query of ``[num_computed, num_tokens)`` can see, and a
        recurrent group the blocks of the state at ``num_computed + num_external`` (``num_external``: tokens a
        connector loads) and of the running state at ``num_tokens``; the newly placed block ids per group (for a
        recurrent group the slots its table grew by, null ones included), or None if the pool is short (only
        blocks no query can see any more are released then)."""
        tables = self.tables.setdefault(req_id, [[] for _ in range(self.num_groups)])
        self._release_out_of_window(tables, num_computed)
        need = -(-num_tokens // self.block_size)
        keep = self._state_slots(num_computed + num_external, num_tokens)
        if self.state_group is not None:
            self._release_states(tables[self.state_group], keep)
        wanted = [sorted(keep) if g == self.state_group else range(self._first_needed(g, num_computed), need)
                  for g in range(self.num_groups)]
        slots = [[b for b in want if b >= len(table) or table[b] == NULL_BLOCK]
                 for want, table in zip(wanted, tables, strict=True)]
        ids = self.pool.allocate(sum(len(s) for s in slots))
        if ids is None:
            return None
        new: list[list[int]] = []
        for g, (table, positions) in enumerate(zip(tables, slots, strict=True)):
            placed = ids[:len(positions)]
            ids = ids[len(positions):]
            old_len = len(table)
            table.extend([NULL_BLOCK] * max(0, need - len(table)))
            for b, block in zip(positions, placed, strict=True):
                table[b] = block
            # a recurrent table grows by null slots and its running block (vLLM's positional new block ids)
            new.append(table[old_len:] if g == self.state_group else placed)
        return tuple(new)

    def _state_slots(self, computed: int, num_tokens: int) -> set[int]:
        """Slots of a recurrent group holding real blocks for a step from ``computed`` to ``num_tokens`` tokens:
        the state it starts from (none from 0) and its running state."""
        keep = {self.state_slot(num_tokens)}
        if computed > 0:
            keep.add(self.state_slot(computed))
        return keep

    def _release_states(self, table: list[int], keep: set[int]) -> None:
        """Put the null block in every slot of a recurrent table but ``keep`` (states no step reads any more)."""
        for b, block in enumerate(table):
            if block != NULL_BLOCK and b not in keep:
                self.pool.free([block])
                table[b] = NULL_BLOCK

    def _first_needed(self, group: int, num_computed: int) -> int:
        """First block a query at ``num_computed`` or later can see (0 unless out-of-window blocks are released)."""
        window = self.windows[group]
        if window is None or not self.release_swa_blocks:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def holds_blocks(self, req_id: str) -> bool:
        """Whether the request holds any block (the null block aside)."""
        return any(b != NULL_BLOCK for table in self.tables.get(req_id, []) for b in table)

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
