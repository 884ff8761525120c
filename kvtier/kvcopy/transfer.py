"""Gather chunk payloads out of an engine's paged KV tensors and scatter them back.

A group's layers each own one paged tensor in one of :class:`kvtier.layout.geometry.KVLayout`'s layouts. A chunk's
payload (the record's shape, :func:`kvtier.layout.geometry.chunk_payload_shape`) is one contiguous tensor over the
group's ``L`` layers. ``gather`` and ``scatter`` check their inputs and move all chunks of one group at once with
the copies of the layout's family (:data:`FAMILIES`: :mod:`kvtier.kvcopy.blocked`, :mod:`kvtier.kvcopy.paged`).
They run on whatever device the tensors live on; a CUDA stream may be passed to overlap copies with compute.

Block id ``NULL_BLOCK`` (0, vLLM's null block) in a scatter means "leave this block alone": sliding-window
groups hold it for out-of-window blocks, and plans use it for blocks the engine already has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvtier.kvcopy import blocked, paged
from kvtier.kvcopy.common import index, spacing
from kvtier.layout.geometry import (
    NULL_BLOCK,
    KVLayout,
    block_size_of,
    chunk_payload_shape,
    detect_layout,
    payload_shape,
)

__all__ = ["FAMILIES", "NULL_BLOCK", "KVLayout", "block_size_of", "detect_layout", "gather", "gathered_shape",
           "payload_shape", "scatter"]


class CopyFamily(Protocol):
    """The copies of one family of layouts (a module of :mod:`kvtier.kvcopy`)."""

    def layer_blocks(self, t: torch.Tensor, idx: torch.Tensor, layout: KVLayout, n: int,
                     bpc: int) -> torch.Tensor: ...

    def gather_into(self, layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], idx: torch.Tensor,
                    layout: KVLayout, out: torch.Tensor) -> None: ...

    def scatter_into(self, layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
                     chunks: Sequence[torch.Tensor], data: torch.Tensor | None) -> None: ...


FAMILIES: dict[KVLayout, CopyFamily] = {
    KVLayout.KV_FIRST: blocked,
    KVLayout.BLOCKS_FIRST: blocked,
    KVLayout.MLA: blocked,
    KVLayout.PAGES: paged,
}


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def _check(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]]) -> int:
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


def _check_dtypes(payloads: torch.Tensor | Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """Refuse payloads of another dtype than the engine's KV: converting them would load other KV than was
    computed (a record of another dtype belongs to another namespace)."""
    found = {payloads.dtype} if isinstance(payloads, torch.Tensor) else {p.dtype for p in payloads}
    if found - {dtype}:
        raise ValueError(f"payloads of dtype {sorted(map(str, found))} cannot be loaded into KV of dtype {dtype}; "
                         "a record is never converted")


def gathered_shape(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout
                   ) -> tuple[int, ...]:
    """The shape ``gather`` returns for these chunks (``[n_chunks, *payload_shape]``)."""
    bpc = _check(layers, block_ids)
    return (len(block_ids), *chunk_payload_shape(layers[0], layout, len(layers), bpc))


def gather(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
           *, out: torch.Tensor | None = None, device: torch.device | str | None = None,
           stream: Any = None) -> torch.Tensor:
    """Copy the blocks of every chunk out of a group's paged tensors.

    ``block_ids[i]`` lists chunk ``i``'s blocks in token order. Returns ``[n_chunks, *payload_shape]``
    (contiguous, on ``device``, default the layers' device); ``result[i]`` is chunk ``i``'s payload. On the
    layers' device the blocks are copied straight into the result; to another device only one layer's blocks
    are staged on the layers' device at a time, so gathering to host memory costs little device memory.
    """
    shape = gathered_shape(layers, block_ids, layout)
    n, bpc = len(block_ids), len(block_ids[0]) if block_ids else 0
    first = layers[0]
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=device if device is not None else first.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if n == 0 or bpc == 0:
        return out
    family = FAMILIES[layout]
    with _on_stream(stream):
        idx = index([b for chunk in block_ids for b in chunk], first.device)
        if out.device == first.device and out.dtype == first.dtype and out.is_contiguous():
            family.gather_into(layers, block_ids, idx, layout, out)
        else:
            for li, t in enumerate(layers):
                out[:, li].copy_(family.layer_blocks(t, idx, layout, n, bpc))
    return out


def _back_to_back(payloads: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The payloads as one stacked view when they lie back to back in one storage, each contiguous and of one
    shape and dtype (records of one put in consecutive pool slots, or one read into evenly spaced slots, whose
    slots are exactly a record long); else None."""
    if len(payloads) < 2:
        return None
    first = payloads[0]
    if any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device or not p.is_contiguous()
           for p in payloads):
        return None
    if spacing(payloads) != first.numel():
        return None
    return first.as_strided((len(payloads), *first.shape), (first.numel(), *first.stride()), first.storage_offset())


def _on_device(payloads: torch.Tensor | Sequence[torch.Tensor], device: torch.device, n: int,
               expected: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The payloads on ``device``, contiguous, one per chunk (and stacked, if they came so); raises
    ``ValueError`` when their shapes are not ``n`` of ``expected``."""
    if not isinstance(payloads, torch.Tensor) and (stacked := _back_to_back(payloads)) is not None:
        payloads = stacked  # one transfer, and no stacking copy (kv_first with more chunks than blocks per chunk)
    if isinstance(payloads, torch.Tensor):
        data = payloads.to(device=device, non_blocking=True).contiguous()
        if tuple(data.shape) != (n, *expected):
            raise ValueError(f"payloads have shape {tuple(data.shape)}, expected {(n, *expected)}")
        return list(data.unbind(0)), data
    chunks = [p.to(device=device, non_blocking=True).contiguous() for p in payloads]
    if len(chunks) != n or any(tuple(p.shape) != expected for p in chunks):
        raise ValueError(f"payloads have shapes {[tuple(p.shape) for p in chunks]}, expected {n} of {expected}")
    return chunks, None


def scatter(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
            payloads: torch.Tensor | Sequence[torch.Tensor], *, stream: Any = None) -> None:
    """Write chunk payloads into a group's paged tensors at ``block_ids``; ``NULL_BLOCK`` entries are skipped.

    ``payloads`` is ``[n_chunks, *payload_shape]`` or a sequence of per-chunk payloads (any device; they are
    moved to the layers' device) of the layers' dtype: another dtype raises ``ValueError``, never converted.
    Payloads already on the layers' device are copied straight into the blocks: one copy per byte, no temporary.
    """
    bpc = _check(layers, block_ids)
    n = len(block_ids)
    if n == 0 or bpc == 0:
        return
    first = layers[0]
    expected = chunk_payload_shape(first, layout, len(layers), bpc)
    _check_dtypes(payloads, first.dtype)
    with _on_stream(stream):
        chunks, data = _on_device(payloads, first.device, n, expected)
        FAMILIES[layout].scatter_into(layers, block_ids, layout, chunks, data)
