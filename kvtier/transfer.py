"""Gather chunk payloads out of an engine's paged KV tensors and scatter them back.

A group's layers each own one paged tensor in one of these layouts (``KVLayout``):

* ``kv_first``     ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM flash / CPU backends)
* ``blocks_first`` ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
* ``mla``          ``[num_blocks, block_size, head_size]`` (one latent vector per token, no K/V split)

A chunk of ``C`` tokens spans ``C / block_size`` blocks. Its payload (the record's shape) is one contiguous
tensor ``[L, 2, C, heads, head]`` (``[L, C, head]`` for MLA) over the group's ``L`` layers. ``gather`` and
``scatter`` move all chunks of one group at once: one ``index_select`` / ``index_copy_`` per layer over every
block of every chunk, no per-token Python work. They run on whatever device the tensors live on; a CUDA stream
may be passed to overlap copies with compute.

Block id ``NULL_BLOCK`` (0, vLLM's null block) in a scatter means "leave this block alone": sliding-window
groups hold it for out-of-window blocks, and plans use it for blocks the engine already has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from enum import StrEnum
from typing import Any

import torch

NULL_BLOCK = 0


class KVLayout(StrEnum):
    KV_FIRST = "kv_first"
    BLOCKS_FIRST = "blocks_first"
    MLA = "mla"


def detect_layout(tensor: torch.Tensor) -> KVLayout:
    """Guess the layout of one layer's paged tensor from its shape (``[2, 2, ...]`` reads as ``kv_first``;
    pass the layout explicitly for a 2-block ``blocks_first`` pool)."""
    if tensor.dim() == 3:
        return KVLayout.MLA
    if tensor.dim() != 5:
        raise ValueError(f"unsupported paged KV tensor shape {tuple(tensor.shape)}; expected 3 or 5 dims")
    first, second = int(tensor.shape[0]), int(tensor.shape[1])
    if first == 2:
        return KVLayout.KV_FIRST
    if second == 2:
        return KVLayout.BLOCKS_FIRST
    raise ValueError(f"cannot find the K/V dimension of size 2 in shape {tuple(tensor.shape)}")


def block_size_of(tensor: torch.Tensor, layout: KVLayout) -> int:
    """Tokens per block of a paged tensor."""
    return int(tensor.shape[1] if layout is KVLayout.MLA else tensor.shape[2])


def payload_shape(tensor: torch.Tensor, layout: KVLayout, num_layers: int, chunk_tokens: int) -> tuple[int, ...]:
    """Shape of one chunk's payload for a group of ``num_layers`` layers shaped like ``tensor``."""
    if layout is KVLayout.MLA:
        return (num_layers, chunk_tokens, int(tensor.shape[2]))
    return (num_layers, 2, chunk_tokens, int(tensor.shape[3]), int(tensor.shape[4]))


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def _block_index(block_ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    flat = [b for chunk in block_ids for b in chunk]
    return torch.tensor(flat, dtype=torch.long, device=device)


def _check(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout) -> int:
    """Validate the inputs; return blocks per chunk."""
    if not layers:
        raise ValueError("a group needs at least one layer tensor")
    per_chunk = {len(c) for c in block_ids}
    if len(per_chunk) > 1:
        raise ValueError("every chunk must span the same number of blocks")
    shape = layers[0].shape
    if any(t.shape != shape for t in layers):
        raise ValueError("all layers of a group must have the same paged shape")
    return per_chunk.pop() if per_chunk else 0


def _layer_blocks(t: torch.Tensor, idx: torch.Tensor, layout: KVLayout, n: int, bpc: int) -> torch.Tensor:
    """Blocks ``idx`` of one layer as ``[n, 2, C, H, D]`` (``[n, C, D]`` for MLA), a strided view of a copy."""
    if layout is KVLayout.MLA:
        sel = t.index_select(0, idx)  # [n*bpc, bs, D]
        return sel.view(n, bpc * sel.shape[1], sel.shape[2])
    if layout is KVLayout.KV_FIRST:
        sel = t.index_select(1, idx)  # [2, n*bpc, bs, H, D]
        bs, h, d = sel.shape[2], sel.shape[3], sel.shape[4]
        return sel.view(2, n, bpc * bs, h, d).transpose(0, 1)
    sel = t.index_select(0, idx)  # [n*bpc, 2, bs, H, D]
    bs, h, d = sel.shape[2], sel.shape[3], sel.shape[4]
    return sel.view(n, bpc, 2, bs, h, d).transpose(1, 2).reshape(n, 2, bpc * bs, h, d)


def gather(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
           *, out: torch.Tensor | None = None, device: torch.device | str | None = None,
           stream: Any = None) -> torch.Tensor:
    """Copy the blocks of every chunk out of a group's paged tensors.

    ``block_ids[i]`` lists chunk ``i``'s blocks in token order. Returns ``[n_chunks, *payload_shape]``
    (contiguous, on ``device``, default the layers' device); ``result[i]`` is chunk ``i``'s payload. Only one
    layer's blocks are staged on the layers' device at a time, so gathering to host memory costs little
    device memory.
    """
    bpc = _check(layers, block_ids, layout)
    n = len(block_ids)
    first = layers[0]
    chunk_tokens = bpc * block_size_of(first, layout)
    shape = (n, *payload_shape(first, layout, len(layers), chunk_tokens))
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=device if device is not None else first.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if n == 0:
        return out
    with _on_stream(stream):
        idx = _block_index(block_ids, first.device)
        for li, t in enumerate(layers):
            out[:, li].copy_(_layer_blocks(t, idx, layout, n, bpc))
    return out


def _to_blocks(src: torch.Tensor, layout: KVLayout, n: int, bpc: int) -> torch.Tensor:
    """One layer's chunk data ``[n, 2, C, H, D]`` rearranged as the paged tensor's block rows."""
    if layout is KVLayout.MLA:
        return src.reshape(n * bpc, src.shape[1] // bpc, src.shape[2])
    c, h, d = src.shape[2], src.shape[3], src.shape[4]
    blocks = src.reshape(n, 2, bpc, c // bpc, h, d)
    if layout is KVLayout.KV_FIRST:
        return blocks.permute(1, 0, 2, 3, 4, 5).reshape(2, n * bpc, c // bpc, h, d)
    return blocks.transpose(1, 2).reshape(n * bpc, 2, c // bpc, h, d)


def scatter(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
            payloads: torch.Tensor | Sequence[torch.Tensor], *, stream: Any = None) -> None:
    """Write chunk payloads into a group's paged tensors at ``block_ids``; ``NULL_BLOCK`` entries are skipped.

    ``payloads`` is ``[n_chunks, *payload_shape]`` or a sequence of per-chunk payloads (any device; they are
    moved to the layers' device).
    """
    bpc = _check(layers, block_ids, layout)
    n = len(block_ids)
    if n == 0 or bpc == 0:
        return
    first = layers[0]
    with _on_stream(stream):
        if isinstance(payloads, torch.Tensor):
            data = payloads.to(device=first.device, dtype=first.dtype, non_blocking=True)
        else:
            data = torch.stack([p.to(device=first.device, dtype=first.dtype, non_blocking=True)
                                for p in payloads])
        expected = (n, *payload_shape(first, layout, len(layers), bpc * block_size_of(first, layout)))
        if tuple(data.shape) != expected:
            raise ValueError(f"payloads have shape {tuple(data.shape)}, expected {expected}")
        idx = _block_index(block_ids, first.device)
        keep = idx != NULL_BLOCK
        all_kept = bool(keep.all())
        if not all_kept:
            idx = idx[keep]
        dim = 1 if layout is KVLayout.KV_FIRST else 0
        for li, t in enumerate(layers):
            rows = _to_blocks(data[:, li], layout, n, bpc)
            if not all_kept:
                rows = rows[:, keep] if dim == 1 else rows[keep]
            t.index_copy_(dim, idx, rows)
