"""vLLM's paged KV views since its KV-layout rework (vLLM 0.32 and 0.33, RFC #42082), read into kvtier's
``pages`` layout.

vLLM allocates one buffer and hands each layer a 4-D view ``[B, H, N, C]``: B blocks, H head slots, N tokens
(states) per block, C the content of one head and token (K and V packed; the latent vector for MLA). The
physical order of those axes is the engine's resolved ``KVCacheLayout`` (``KVCacheConfig.kv_cache_layout``), one
of the stride orders in :data:`STRIDE_ORDERS` over ``[L, B, H, N, C]``. The attention backend may split each of
the scheduler's blocks into ``ratio`` kernel blocks: the view then has ``ratio`` times as many blocks of
``N = block_size / ratio`` tokens, and scheduler block ``b`` is kernel blocks ``b * ratio ... b * ratio + ratio -
1``.

kvtier reads that description, never the shapes alone: :func:`page_view` checks the view against the layout and
the group's block size and returns it as ``[kernel_blocks, *page]`` with the page's axes in memory order, so
that a page stored densely (every layout whose layer axis is outside the block axis, or whose block axis is
outermost) moves as one run of bytes. A record holds ``[L, blocks, *page]`` in that order, so the layout is
part of every key's namespace (``kvtier.connector.keying``): records written under another layout are never
read as this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

from kvtier.errors import ConnectorError
from kvtier.transfer import NULL_BLOCK

if TYPE_CHECKING:
    import torch

# vLLM's ``KVCacheLayout`` members: physical order of the logical axes [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
STRIDE_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LEGACY_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's older layout names, still accepted by its config


def canonical_layout(layout: object) -> str:
    """A layout's canonical name (``KVCacheLayout`` member or name, legacy ``NHD``/``HND`` mapped); unknown names
    are kept (``page_view`` refuses them)."""
    name = str(getattr(layout, "name", layout)).upper()
    return LEGACY_NAMES.get(name, name)


def layout_name(layout: object) -> str:
    """Canonical layout name from a ``KVCacheLayout`` member or its (legacy) name; raises ``ConnectorError``
    for a layout kvtier does not know."""
    name = canonical_layout(layout)
    if name not in STRIDE_ORDERS:
        raise ConnectorError(f"unknown KV-cache layout {layout!r}; kvtier knows {', '.join(STRIDE_ORDERS)} "
                             "(set VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)")
    return name


def view_order(layout: str) -> tuple[int, ...]:
    """Physical order of a layer view's axes ``[B, H, N, C]`` (vLLM's ``layer_view_order``)."""
    return tuple(i - 1 for i in STRIDE_ORDERS[layout_name(layout)] if i != 0)


def page_axes(layout: str) -> tuple[int, ...]:
    """The permutation that makes a layer view ``[B, *page]``, the page's axes in memory order."""
    return (0, *(d for d in view_order(layout) if d != 0))


def page_view(name: str, tensor: torch.Tensor, layout: str, block_size: int,
              num_blocks: int = 0) -> tuple[torch.Tensor, int]:
    """``tensor`` (one layer's ``[B, H, N, C]`` view) as ``[kernel_blocks, *page]`` and the number of kernel
    blocks per scheduler block. Raises ``ConnectorError`` naming the layer, the layout and a setting that works
    when the view does not match the layout, the group's block size or (when given) the engine's block count."""
    layout = layout_name(layout)
    shape, stride = tuple(int(d) for d in tensor.shape), tuple(int(s) for s in tensor.stride())
    fix = "set VLLM_KV_CACHE_LAYOUT=LBHNC (the CPU backend's) or LBNHC"
    if len(shape) != 4:
        raise ConnectorError(f"layer {name}: KV view of shape {shape} under layout {layout}; vLLM's layer views "
                             f"are 4-D [blocks, heads, tokens, content]. This group cannot be cached; {fix}, or "
                             "exclude the group from kvtier's placement")
    order = view_order(layout)
    real = [d for d in order if shape[d] != 1]
    if any(stride[a] < stride[b] for a, b in pairwise(real)) or (shape[3] != 1 and stride[3] != 1):
        raise ConnectorError(f"layer {name}: KV view strides {stride} (shape {shape}) do not follow the engine's "
                             f"layout {layout} (axes [B, H, N, C] in memory order {order}); {fix}")
    tokens = shape[2]
    if tokens <= 0 or block_size % tokens:
        raise ConnectorError(f"layer {name}: KV view blocks hold {tokens} token states, which do not divide the "
                             f"group's block size {block_size} (compressed or pooled states are not supported); "
                             "this group cannot be cached")
    ratio = block_size // tokens
    if num_blocks and shape[0] < num_blocks * ratio:
        raise ConnectorError(f"layer {name}: KV view of {shape[0]} blocks of {tokens} token states cannot hold "
                             f"{num_blocks} blocks of {block_size} tokens (states that stand for several tokens "
                             "are not supported); this group cannot be cached")
    return tensor.permute(*page_axes(layout)), ratio


def kernel_ids(ids: Sequence[int], ratio: int) -> tuple[int, ...]:
    """Scheduler block ids as kernel block ids (``NULL_BLOCK`` stays null, ``ratio`` times)."""
    if ratio == 1:
        return tuple(ids)
    return tuple(NULL_BLOCK if b == NULL_BLOCK else b * ratio + j for b in ids for j in range(ratio))
