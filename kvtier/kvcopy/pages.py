"""vLLM's paged KV views since its KV-layout rework (vLLM 0.32 and 0.33, RFC #42082), read into kvtier's
``pages`` layout.

vLLM allocates one buffer and hands each layer a 4-D view ``[B, H, N, C]``: B blocks, H head slots, N tokens
(states) per block, C the content of one head and token (K and V packed; the latent vector for MLA). The
physical order of those axes is the engine's resolved ``KVCacheLayout`` (``KVCacheConfig.kv_layout``, resolved
once per start by :func:`kvtier.layout.from_vllm`), one of the stride orders in
:data:`kvtier.layout.geometry.STRIDE_ORDERS`. The attention backend may split each of the scheduler's blocks into
``ratio`` kernel blocks (:func:`kvtier.layout.geometry.kernel_ids`).

kvtier reads that description, never the shapes alone: :func:`page_view` checks the view against the layout and
the group's block size (:func:`kvtier.layout.geometry.page_ratio`) and returns it as ``[kernel_blocks, *page]`` with the
page's axes in memory order, so that a page stored densely (every layout whose layer axis is outside the block
axis, or whose block axis is outermost) moves as one run of bytes (:mod:`kvtier.kvcopy.paged` copies them). A
record holds ``[L, blocks, *page]`` in that order, so the layout is part of every key's namespace
(``kvtier.connector.keying``): records written under another layout are never read as this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.layout.geometry import page_order, page_ratio

if TYPE_CHECKING:
    import torch


def page_view(name: str, tensor: torch.Tensor, layout: str, block_size: int,
              num_blocks: int = 0) -> tuple[torch.Tensor, int]:
    """``tensor`` (one layer's ``[B, H, N, C]`` view) as ``[kernel_blocks, *page]`` and the number of kernel
    blocks per scheduler block. Raises ``ConnectorError`` naming the layer, the layout and a setting that works
    when the view does not match the layout, the group's block size or (when given) the engine's block count."""
    ratio = page_ratio(name, tuple(tensor.shape), tuple(tensor.stride()), layout, block_size, num_blocks)
    return tensor.permute(*page_order(layout).page_axes), ratio
