"""Batched copies between a memory pool's byte buffer and tensors: bookkeeping first, then every copy at once.

A batch is a list of pieces ``(pool offset, tensor, offset in the tensor's bytes, bytes)``. ``copy_pieces`` merges
consecutive pieces that follow each other on both sides (records of one batch in consecutive slots, payloads that
are slices of one gathered tensor) into one copy, and only then makes tensor views: per-record views were most of
the per-record cost at small records. The copies then run in one ``torch._foreach_copy_`` (a C++ loop) when every
tensor is on one device, else one ``copy_`` each (host-device pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Piece = tuple[int, torch.Tensor, int, int]  # pool byte offset, contiguous tensor, byte offset in it, byte count


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` view (the tensor itself when it already is one)."""
    if tensor.dtype == torch.uint8 and tensor.dim() == 1:
        return tensor
    return tensor.view(-1).view(torch.uint8)


def _side(tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` bytes of memory from byte ``start`` of ``tensor`` on, as ``uint8``; None when they run past the
    end of its storage (a merge with memory that merely happens to follow)."""
    flat = flat_bytes(tensor)
    size = flat.numel()
    if start == 0 and nbytes == size:
        return flat
    if start + nbytes <= size:
        return flat[start:start + nbytes]
    try:
        return flat.as_strided((nbytes,), (1,), flat.storage_offset() + start)
    except RuntimeError:
        return None


def copy_pieces(pool: torch.Tensor, pieces: Sequence[Piece], into_pool: bool) -> int:
    """Copy every piece between ``pool`` (flat ``uint8``) and its tensor, in order: into the pool when
    ``into_pool``, out of it otherwise. Returns the number of copies the pieces were merged into."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    i = 0
    while i < len(pieces):
        offset, tensor, start, nbytes = pieces[i]
        end, device, j = tensor.data_ptr() + start + nbytes, tensor.device, i + 1
        while j < len(pieces):
            o, t, s, n = pieces[j]
            if o != offset + nbytes or t.data_ptr() + s != end or t.device != device:
                break
            nbytes, end, j = nbytes + n, end + n, j + 1
        side = _side(tensor, start, nbytes)
        if side is None:  # not one storage after all: the pieces one by one
            for o, t, s, n in pieces[i:j]:
                pairs.append(_pair(pool[o:o + n], flat_bytes(t)[s:s + n], into_pool))
        else:
            pairs.append(_pair(pool[offset:offset + nbytes], side, into_pool))
        i = j
    if not pairs:
        return 0
    first = pairs[0][0].device
    if len(pairs) > 1 and all(d.device == first and s.device == first for d, s in pairs):
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    else:
        for dst, src in pairs:
            dst.copy_(src)
    return len(pairs)


def _pair(pool_side: torch.Tensor, tensor_side: torch.Tensor, into_pool: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, source)."""
    return (pool_side, tensor_side) if into_pool else (tensor_side, pool_side)
