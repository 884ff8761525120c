"""Geometry of an engine's paged KV tensors, torch-free: block ids, layouts, stride orders and shapes.

Everything here computes ids, axes or shapes from plain numbers; the copy modules (:mod:`kvtier.kvcopy`) and
:mod:`kvtier.kvcopy.pages` apply the results to tensors. The scheduler half, which never touches tensors, uses this
module alone.

A group's layers each own one paged tensor in one of these layouts (:class:`KVLayout`):

* ``kv_first``     ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM flash / CPU backends)
* ``blocks_first`` ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
* ``mla``          ``[num_blocks, block_size, head_size]`` (one latent vector per token, no K/V split)
* ``pages``        ``[num_blocks, *page]``: vLLM >= 0.32 (one page per block, in the page's memory order; built
                   by :func:`kvtier.kvcopy.pages.page_view` from the engine's ``[B, H, N, C]`` views and layout)

vLLM >= 0.32 hands each layer a 4-D view ``[B, H, N, C]`` whose physical axis order is the engine's resolved
``KVCacheLayout``, one of :data:`STRIDE_ORDERS` over ``[L, B, H, N, C]``. The attention backend may split each
scheduler block into ``ratio`` kernel blocks of ``N = block_size / ratio`` tokens: scheduler block ``b`` is kernel
blocks ``b * ratio ... b * ratio + ratio - 1`` (:func:`kernel_ids`).

Block id ``NULL_BLOCK`` (0, vLLM's null block) means "no block here": the engine never hands it out, sliding-window
groups hold it for out-of-window blocks, and a scatter leaves it alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from itertools import pairwise
from typing import Protocol

from kvtier.errors import ConnectorError

NULL_BLOCK = 0


class KVLayout(StrEnum):
    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"
    MLA = "mla"
    PAGES = "pages"


class Shaped(Protocol):
    """Anything with a shape (a tensor)."""

    @property
    def shape(self) -> Sequence[int]: ...


def dims(tensor: Shaped | Sequence[int]) -> tuple[int, ...]:
    """The shape of a tensor, or a shape itself, as plain ints."""
    return tuple(int(d) for d in (tensor if isinstance(tensor, Sequence) else tensor.shape))


def detect_layout(tensor: Shaped | Sequence[int]) -> KVLayout:
    """Guess the layout of one layer's paged tensor from its shape (``[2, 2, ...]`` reads as ``kv_first``;
    pass the layout explicitly for a 2-block ``blocks_first`` pool)."""
    shape = dims(tensor)
    if len(shape) == 3:
        return KVLayout.MLA
    if len(shape) != 5:
        raise ValueError(f"unsupported paged KV tensor shape {shape}; expected 3 or 5 dims")
    if shape[0] == 2:
        return KVLayout.KV_FIRST
    if shape[1] == 2:
        return KVLayout.BLOCKS_FIRST
    raise ValueError(f"cannot find the K/V dimension of size 2 in shape {shape}")


def block_axis(layout: KVLayout) -> int:
    """The axis of a layer's paged tensor that indexes blocks."""
    return 1 if layout is KVLayout.KV_FIRST else 0


def block_size_of(tensor: Shaped | Sequence[int], layout: KVLayout) -> int:
    """Tokens per block of a paged tensor (``pages``: not known from the tensor; raises)."""
    if layout is KVLayout.PAGES:
        raise ValueError("a page view does not say its tokens per block; kvtier.kvcopy.pages knows it")
    shape = dims(tensor)
    return shape[1] if layout is KVLayout.MLA else shape[2]


def payload_shape(tensor: Shaped | Sequence[int], layout: KVLayout, num_layers: int,
                  chunk_tokens: int) -> tuple[int, ...]:
    """Shape of one chunk's payload for a group of ``num_layers`` layers shaped like ``tensor`` (not ``pages``,
    whose chunks are counted in blocks: :func:`chunk_payload_shape`)."""
    shape = dims(tensor)
    if layout is KVLayout.MLA:
        return (num_layers, chunk_tokens, shape[2])
    return (num_layers, 2, chunk_tokens, shape[3], shape[4])


def chunk_payload_shape(tensor: Shaped | Sequence[int], layout: KVLayout, num_layers: int,
                        blocks_per_chunk: int) -> tuple[int, ...]:
    """Shape of the payload of one chunk of ``blocks_per_chunk`` blocks, in any layout: ``[L, 2, C, H, D]``,
    ``[L, C, D]`` for MLA, ``[L, blocks, *page]`` for pages."""
    shape = dims(tensor)
    if layout is KVLayout.PAGES:
        return (num_layers, blocks_per_chunk, *shape[1:])
    return payload_shape(shape, layout, num_layers, blocks_per_chunk * block_size_of(shape, layout))


# ---- block ids ------------------------------------------------------------------------------------------------
def kernel_ids(ids: Sequence[int], ratio: int) -> tuple[int, ...]:
    """Scheduler block ids as kernel block ids (``NULL_BLOCK`` stays null, ``ratio`` times)."""
    if ratio == 1:
        return tuple(ids)
    return tuple(NULL_BLOCK if b == NULL_BLOCK else b * ratio + j for b in ids for j in range(ratio))


def non_null(ids: Sequence[int]) -> list[int]:
    """Positions in ``ids`` that hold a real block (not ``NULL_BLOCK``)."""
    return [j for j, b in enumerate(ids) if b != NULL_BLOCK]


def kv_rows(ids: Sequence[int], num_blocks: int) -> tuple[list[int], list[int] | None] | None:
    """For one chunk's blocks ``ids``: the target rows of a ``kv_first`` layer viewed as ``[2 * num_blocks, ...]``
    (K rows, then V rows), and which rows of the chunk's ``[2 * len(ids), ...]`` data go there (None: all);
    ``NULL_BLOCK`` entries are skipped; None when every entry is."""
    kept = non_null(ids)
    if not kept:
        return None
    targets = [ids[j] for j in kept]
    rows = targets + [b + num_blocks for b in targets]
    if len(kept) == len(ids):
        return rows, None
    return rows, kept + [j + len(ids) for j in kept]


def id_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """The non-null entries of ``ids`` as runs of consecutive block ids: (position in ``ids``, first id,
    length); ``NULL_BLOCK`` entries belong to no run."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if b == NULL_BLOCK:
            continue
        if runs and runs[-1][1] + runs[-1][2] == b and runs[-1][0] + runs[-1][2] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def chunk_runs(block_ids: Sequence[Sequence[int]]) -> list[tuple[int, int, int]] | None:
    """Chunks whose blocks continue one run of consecutive ids, as (first chunk, first block id, chunks); None
    when some chunk's own blocks are not consecutive or include ``NULL_BLOCK``."""
    runs: list[tuple[int, int, int]] = []
    for i, ids in enumerate(block_ids):
        if NULL_BLOCK in ids or any(b != ids[0] + j for j, b in enumerate(ids)):
            return None
        if runs and runs[-1][1] + runs[-1][2] * len(ids) == ids[0]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, ids[0], 1))
    return runs


# ---- vLLM >= 0.32 layer views [B, H, N, C] --------------------------------------------------------------------
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
VIEW_FIX = "set VLLM_KV_CACHE_LAYOUT=LBHNC (the CPU backend's) or LBNHC"


def canonical_layout(layout: object) -> str:
    """A layout's canonical name (``KVCacheLayout`` member or name, legacy ``NHD``/``HND`` mapped); unknown names
    are kept (:func:`page_order` refuses them)."""
    name = str(getattr(layout, "name", layout)).upper()
    return LEGACY_NAMES.get(name, name)


@dataclass(frozen=True)
class PageOrder:
    """How one layout orders a layer view: ``view_order`` is the physical order of the view's axes
    ``[B, H, N, C]`` (vLLM's ``layer_view_order``); ``page_axes`` the permutation that makes the view
    ``[B, *page]`` with the page's axes in memory order."""

    name: str
    view_order: tuple[int, ...]
    page_axes: tuple[int, ...]


@cache
def _page_order(name: str) -> PageOrder:
    if name not in STRIDE_ORDERS:
        raise ConnectorError(f"unknown KV-cache layout {name!r}; kvtier knows {', '.join(STRIDE_ORDERS)} "
                             "(set VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)")
    order = tuple(i - 1 for i in STRIDE_ORDERS[name] if i != 0)
    return PageOrder(name, order, (0, *(d for d in order if d != 0)))


def page_order(layout: object) -> PageOrder:
    """The (cached) order of a layout given as a ``KVCacheLayout`` member or its (legacy) name; raises
    ``ConnectorError`` for a layout kvtier does not know."""
    return _page_order(canonical_layout(layout))


def layout_name(layout: object) -> str:
    """Canonical layout name; raises ``ConnectorError`` for a layout kvtier does not know."""
    return page_order(layout).name


def page_ratio(name: str, shape: Sequence[int], stride: Sequence[int], layout: object, block_size: int,
               num_blocks: int = 0) -> int:
    """Kernel blocks per scheduler block of one layer's view ``[B, H, N, C]`` (its ``shape`` and ``stride``).
    Raises ``ConnectorError`` naming the layer, the layout and a setting that works when the view does not
    match the layout, the group's block size or (when given) the engine's block count."""
    order = page_order(layout)
    shape, stride = tuple(int(d) for d in shape), tuple(int(s) for s in stride)
    if len(shape) != 4:
        raise ConnectorError(f"layer {name}: KV view of shape {shape} under layout {order.name}; vLLM's layer "
                             f"views are 4-D [blocks, heads, tokens, content]. This group cannot be cached; "
                             f"{VIEW_FIX}, or exclude the group from kvtier's placement")
    real = [d for d in order.view_order if shape[d] != 1]
    if any(stride[a] < stride[b] for a, b in pairwise(real)) or (shape[3] != 1 and stride[3] != 1):
        raise ConnectorError(f"layer {name}: KV view strides {stride} (shape {shape}) do not follow the engine's "
                             f"layout {order.name} (axes [B, H, N, C] in memory order {order.view_order}); "
                             f"{VIEW_FIX}")
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
    return ratio


def dense_pages(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether each page of a ``[blocks, *page]`` tensor (its ``shape`` and ``stride``) is one dense run of
    memory, so that an index op can move whole pages as rows of ``page_elements``."""
    expect = 1
    for d in range(len(shape) - 1, 0, -1):
        if shape[d] != 1 and stride[d] != expect:
            return False
        expect *= shape[d]
    return True
