"""The engine's KV tensors as the worker half moves them: per KV-cache group its registered layers (viewed the way
kvtier reads them, kvtier.connector.worker.registration), their layout and kernel blocks per scheduler block, and this
tensor-parallel rank's key namespaces. The load path (kvtier.connector.worker.loads) scatters into them, the save path
(kvtier.connector.worker.saves) gathers from them.

Lifecycle: ``EngineKV(kcc, ...)`` -> ``register(kv_caches)`` (raises ``ConnectorError`` / ``ValueError`` for
tensors kvtier cannot read) -> ``kernel`` / ``key`` / ``plan`` / ``scatter`` / ``gather`` per step; ``clear()``
when kvtier is disabled.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvtier.connector.keying import Identity, namespaces, rank_key
from kvtier.connector.worker.registration import derive_config, group_tensors
from kvtier.control.directory import StorePlan
from kvtier.kvcopy.transfer import gather, gathered_shape, scatter
from kvtier.layout import GroupKind, KVCacheConfig
from kvtier.layout.geometry import KVLayout, kernel_ids
from kvtier.records.keys import DIGEST_BYTES, Key
from kvtier.tiers.memory.recycle import Recycler, size_class

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class EngineKV:
    """The registered KV tensors of every group, and the keys this rank stores their chunks under."""

    def __init__(self, kcc: KVCacheConfig | None, *, identity: Identity | None = None, chunk_size: int = 256,
                 layout: KVLayout | None = None) -> None:
        self.kcc = kcc
        self.identity = identity
        self.chunk_size = chunk_size
        self._layout_hint = layout
        self._rank_spaces: list[bytes] | None = None
        self._space_of: dict[bytes, bytes] = {}  # rank 0's namespace digest -> this rank's, of every group
        self.layers: list[list[torch.Tensor]] = []
        self.layouts: list[KVLayout] = []
        self._ratios: list[int] = []  # kernel blocks per scheduler block, per group
        self._chunk_nbytes: dict[int, int] = {}  # payload bytes of one chunk, per group (computed on first use)

    @property
    def rank(self) -> str:
        """This worker's tensor-parallel rank, as the worker report names it."""
        return str(self.identity.tp_rank if self.identity is not None else 0)

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Map every registered layer to its group (groups keep their layers in config order)."""
        if self.kcc is None:
            logger.warning("no kv_cache_config given: treating all %d layers as one full-attention group",
                           len(kv_caches))
            self.kcc = derive_config(kv_caches)
        groups = [group_tensors(gid, group, kv_caches, self.kcc.kv_layout, self._layout_hint, self.kcc.num_blocks)
                  for gid, group in enumerate(self.kcc.kv_cache_groups)]
        self.layers = [g.layers for g in groups]
        self.layouts = [g.layout for g in groups]
        self._ratios = [g.ratio for g in groups]
        if self.identity is not None and self.identity.tp_rank != 0:
            self._rank_spaces = namespaces(self.identity, self.kcc, self.chunk_size)
            rank0 = namespaces(self.identity, self.kcc, self.chunk_size, rank=0)
            self._space_of = dict(zip(rank0, self._rank_spaces, strict=True))

    def clear(self) -> None:
        """Hold no tensors any more (kvtier is disabled for this engine)."""
        self.layers, self.layouts, self._ratios = [], [], []

    def kernel(self, group: int, block_ids: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The scheduler's block ids of each chunk as ids of the group's tensors (kernel blocks)."""
        ratio = self._ratios[group]
        return [kernel_ids(ids, ratio) for ids in block_ids]

    def key(self, group: int, key: Key) -> Key:
        """The key this rank stores a chunk under (rank 0's key: the scheduler's)."""
        if self._rank_spaces is None:
            return key
        return rank_key(key, self._rank_spaces[group])

    def plan(self, group: int, plan: StorePlan) -> StorePlan:
        """A store plan under this rank's keys: the chunks it writes are ``group``'s (mapped as their payloads are);
        its victims and the chunks it demotes may be any group's sharing the tier, each mapped by its own
        namespace (one this rank does not know, another engine's, is left as it is: this rank holds nothing
        under it)."""
        if self._rank_spaces is None:
            return plan
        store = tuple(self.key(group, k) if plan.source is None else self._mine(k) for k in plan.store)
        return StorePlan(plan.tier, store, tuple(self._mine(k) for k in plan.evicted), plan.source)

    def _mine(self, key: Key) -> Key:
        """``key`` (rank 0's, any group's) under this rank's namespace of the same group."""
        space = self._space_of.get(key[:DIGEST_BYTES])
        return key if space is None else rank_key(key, space)

    def is_state_group(self, group: int) -> bool:
        """Whether ``group`` holds recurrent state (one block per stored chunk) rather than KV."""
        return self.kcc is not None and self.kcc.kv_cache_groups[group].kind is GroupKind.MAMBA

    def chunk_bytes(self, group: int) -> int:
        """Payload bytes of one chunk of ``group`` (0 for a group this worker holds no tensors of)."""
        known = self._chunk_nbytes.get(group)
        if known is not None:
            return known
        if self.kcc is None or group >= len(self.layers) or not self.layers[group]:
            return 0
        layers = self.layers[group]
        per_chunk = self.kcc.kv_cache_groups[group].blocks_per_chunk(self.chunk_size)
        shape = gathered_shape(layers, self.kernel(group, [tuple(range(1, per_chunk + 1))]), self.layouts[group])
        self._chunk_nbytes[group] = math.prod(shape) * layers[0].element_size()
        return self._chunk_nbytes[group]

    def scatter(self, group: int, blocks: Sequence[Sequence[int]], payloads: Sequence[torch.Tensor]) -> None:
        """Copy one payload per chunk into the chunk's blocks of every layer of ``group``."""
        scatter(self.layers[group], self.kernel(group, blocks), self.layouts[group], payloads)

    def gather(self, group: int, blocks: Sequence[Sequence[int]], buffers: Recycler) -> torch.Tensor:
        """The chunks' blocks of ``group``, one payload per chunk, copied into a recycled host buffer."""
        layers = self.layers[group]
        ids = self.kernel(group, blocks)
        shape = gathered_shape(layers, ids, self.layouts[group])
        nbytes = math.prod(shape) * layers[0].element_size()
        buffer = buffers.take(size_class(nbytes))[:nbytes]
        return gather(layers, ids, self.layouts[group], out=buffer.view(layers[0].dtype).view(shape))

    def sync_devices(self) -> None:
        """Wait for the copies queued on the layers' CUDA devices (they may still read borrowed host views)."""
        devices = {t.device for layers in self.layers for t in layers if t.is_cuda}
        if devices:
            import torch

            for device in devices:
                torch.cuda.current_stream(device).synchronize()
