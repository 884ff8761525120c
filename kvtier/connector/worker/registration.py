"""Which registered KV tensors belong to which KV-cache group, and how kvtier reads them (worker side).

vLLM >= 0.32 (the config names the engine's KV-cache layout): each layer's ``[B, H, N, C]`` view becomes a
``[kernel_blocks, *page]`` page view (:mod:`kvtier.kvcopy.pages`); earlier engines: 5-D or 3-D paged tensors in one of
:class:`kvtier.layout.geometry.KVLayout`'s layouts, checked against the group's spec. Anything kvtier cannot read
raises ``ConnectorError`` (the worker then disables kvtier for the engine, or fails in strict mode).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.errors import ConnectorError
from kvtier.kvcopy.pages import page_view
from kvtier.layout import (
    UNSERVED,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    OtherSpec,
    dtype_name,
)
from kvtier.layout.geometry import KVLayout, block_size_of, detect_layout

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class GroupTensors:
    """One group's tensors as kvtier reads them; ``ratio``: kernel blocks per scheduler block."""

    layers: list[torch.Tensor]
    layout: KVLayout
    ratio: int = 1


def derive_config(kv_caches: Mapping[str, torch.Tensor]) -> KVCacheConfig:
    """One full-attention (or MLA) group over every registered layer, from the tensors' shapes."""
    first = next(iter(kv_caches.values()))
    layout = detect_layout(first)
    block = block_size_of(first, layout)
    dtype = dtype_name(first.dtype)
    if layout is KVLayout.MLA:
        spec: FullAttentionSpec = MLAAttentionSpec(block, 1, int(first.shape[2]), dtype)
    else:
        spec = FullAttentionSpec(block, int(first.shape[3]), int(first.shape[4]), dtype)
    blocks = int(first.shape[1] if layout is KVLayout.KV_FIRST else first.shape[0])
    return KVCacheConfig((KVCacheGroupSpec(tuple(kv_caches), spec),), blocks)


def check_shape(name: str, tensor: torch.Tensor, layout: KVLayout, group: KVCacheGroupSpec) -> None:
    """Refuse a paged tensor whose block size / heads / head size disagree with its group's spec (another
    layout, e.g. heads before tokens, would otherwise be read as garbage)."""
    spec = group.kv_cache_spec
    if not isinstance(spec, FullAttentionSpec):
        return
    if layout is KVLayout.MLA:
        found: tuple[int, ...] = (int(tensor.shape[1]), int(tensor.shape[2]))
        wanted: tuple[int, ...] = (spec.block_size, spec.head_size)
    else:
        found = tuple(int(d) for d in tensor.shape[2:])
        wanted = (spec.block_size, spec.num_kv_heads, spec.head_size)
    if found != wanted:
        raise ConnectorError(f"layer {name}: paged KV shape {tuple(tensor.shape)} read as {layout} gives "
                             f"(block, heads, head) {found}, but the KV-cache config says {wanted}; kvtier "
                             "supports [2, blocks, block, heads, head], [blocks, 2, block, heads, head] and MLA "
                             "[blocks, block, head]")


def check_packing(name: str, view: torch.Tensor, spec: object) -> None:
    """Refuse a layer view ``[B, H, N, C]`` whose head slots or content bytes are not those of its group's spec
    (part of every key's namespace): its pages would be stored under a description they do not follow."""
    if not isinstance(spec, FullAttentionSpec) or view.dim() != 4:
        return
    slots, content = int(view.shape[1]), int(view.shape[3]) * view.element_size()
    if (spec.head_slots is not None and slots != spec.head_slots) or \
            (spec.content_bytes is not None and content != spec.content_bytes):
        raise ConnectorError(f"layer {name}: KV view {tuple(view.shape)} has {slots} head slots of {content} bytes "
                             f"per token, but the KV-cache spec says {spec.head_slots} of {spec.content_bytes}; "
                             "this group cannot be cached")


def state_view(name: str, tensor: torch.Tensor, spec: MambaSpec) -> torch.Tensor:
    """A recurrent layer's registered tensor (dim 0: blocks; vLLM's CPU build: int8 ``[blocks, 1, 1, bytes]``
    with pages padded to the attention page) as ``[blocks, state_bytes]`` bytes: one page per block holding the
    layer's states (conv, SSM, ...) as the engine lays them out; padding is never read."""
    import torch

    need = spec.state_bytes_per_layer()
    if not isinstance(tensor, torch.Tensor):  # e.g. vLLM <= 0.31's list of conv and SSM tensors per layer
        raise ConnectorError(f"layer {name}: its recurrent state is registered as {type(tensor).__name__}, not "
                             "one tensor of blocks; this group cannot be cached")
    try:  # a view, never a copy: loads write through it into the engine's blocks
        rows = tensor.view(int(tensor.shape[0]), -1).view(torch.uint8)
    except RuntimeError as exc:
        raise ConnectorError(f"layer {name}: kvtier cannot view its recurrent-state tensor {tuple(tensor.shape)} "
                             f"as bytes per block ({exc}); this group cannot be cached") from exc
    if rows.shape[1] < need:
        raise ConnectorError(f"layer {name}: its recurrent-state tensor holds {rows.shape[1]} bytes per block, its "
                             f"spec says {need}; this group cannot be cached")
    return rows[:, :need]


def group_tensors(gid: int, group: KVCacheGroupSpec, kv_caches: Mapping[str, torch.Tensor],
                  kv_layout: str | None, layout_hint: KVLayout | None = None, num_blocks: int = 0) -> GroupTensors:
    """Group ``gid``'s registered tensors, checked and viewed the way kvtier moves them."""
    layers = [kv_caches[n] for n in group.layer_names if n in kv_caches]
    missing = [n for n in group.layer_names if n not in kv_caches]
    if missing and group.kind not in UNSERVED:  # a layer kvtier cannot restore would compute on stale KV
        raise ConnectorError(f"KV-cache group {gid} ({group.kind}): layer(s) {', '.join(missing[:3])} have no "
                             "registered KV tensor; this group cannot be cached")
    spec = group.kv_cache_spec
    if isinstance(spec, OtherSpec) and spec.name.endswith("(mixed)"):
        # vLLM gives the scheduler the first layer's spec for such a group: it would plan work here
        raise ConnectorError(f"KV-cache group {gid} holds layers with different specs ({spec.name}); kvtier "
                             "stores a group's layers in one record and cannot cache it")
    if isinstance(spec, MambaSpec):
        return GroupTensors([state_view(n, t, spec) for n, t in zip(group.layer_names, layers, strict=False)],
                            KVLayout.PAGES)
    if group.kind in UNSERVED:  # never loaded or saved (the scheduler plans no work for such groups)
        logger.warning("KV-cache group %d (%s) is not cached by kvtier; requests of this model will not hit",
                       gid, group.kind)
        return GroupTensors([], KVLayout.KV_FIRST)
    if kv_layout is not None:  # vLLM >= 0.32: [B, H, N, C] views in the engine's layout
        for name, tensor in zip(group.layer_names, layers, strict=False):
            check_packing(name, tensor, spec)
        views = [page_view(n, t, kv_layout, spec.block_size, num_blocks)
                 for n, t in zip(group.layer_names, layers, strict=False)]
        if len({(tuple(v.shape), r) for v, r in views}) > 1:
            raise ConnectorError(f"KV-cache group {gid}: its layers' KV views differ in shape "
                                 f"({sorted({tuple(v.shape) for v, _ in views})}); kvtier stores a group's layers "
                                 "in one record and cannot cache this group")
        return GroupTensors([v for v, _ in views], KVLayout.PAGES, views[0][1] if views else 1)
    layout = layout_hint or (detect_layout(layers[0]) if layers else KVLayout.KV_FIRST)
    for name, tensor in zip(group.layer_names, layers, strict=False):
        check_shape(name, tensor, layout, group)
    return GroupTensors(layers, layout)
