"""Copies of the ``pages`` layout (vLLM >= 0.32): layers are ``[blocks, *page]`` page views
(:func:`kvtier.kvcopy.pages.page_view`), a chunk's payload is ``[L, blocks, *page]``.

Whole pages move: slice copies over runs of consecutive blocks where the block ids allow (an engine allocates a
request's blocks mostly in order), else index ops; a page that is one dense run of memory moves as one row of
bytes. ``NULL_BLOCK`` targets are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.kvcopy.common import GATHER_DTYPES, SCATTER_DTYPES, index, spacing, wide
from kvtier.layout.geometry import NULL_BLOCK, KVLayout, chunk_runs, dense_pages, id_runs, non_null


def page_rows(t: torch.Tensor) -> torch.Tensor:
    """A ``[blocks, *page]`` tensor as ``[blocks, page_elements]`` (a view) when each page is one dense run of
    memory, so an index op moves whole pages (memcpy); else unchanged."""
    return t.flatten(1) if dense_pages(tuple(t.shape), tuple(t.stride())) else t


def layer_blocks(t: torch.Tensor, idx: torch.Tensor, layout: KVLayout, n: int, bpc: int) -> torch.Tensor:
    """Blocks ``idx`` of one page layer as ``[n, bpc, *page]`` (a copy; cross-device gathers stage each layer on
    the layers' device this way)."""
    return t.index_select(0, idx).view(n, bpc, *t.shape[1:])


def gather_into(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], idx: torch.Tensor,
                layout: KVLayout, out: torch.Tensor) -> None:
    """Same-device gather of page layers into ``out`` (``[n, L, bpc, *page]``) in as few copies as the block
    ids allow (each call costs ~30 us on top of its bytes): one slice copy per layer and run of chunks whose
    blocks are consecutive (measured at 32 chunks of two 64 KiB pages: 3.7 GB/s, a plain copy's speed, against
    1.6 GB/s for an index op per chunk), else one index op per chunk or per block position and layer, whichever
    is fewer."""
    rows = [page_rows(t) for t in layers]
    n, bpc = len(block_ids), len(block_ids[0])
    dest = out.view(n, len(layers), bpc, -1) if all(r.dim() == 2 for r in rows) else out
    runs = chunk_runs(block_ids)
    if runs is not None and len(runs) <= min(n, bpc):
        for c0, b0, k in runs:
            for li, t in enumerate(rows):
                dest[c0:c0 + k, li].copy_(t[b0:b0 + k * bpc].unflatten(0, (k, bpc)))
        return
    wide_rows, (wide_out,) = wide(rows, [dest], GATHER_DTYPES)
    for li, t in enumerate(wide_rows):
        if n <= bpc:
            for i in range(n):
                torch.index_select(t, 0, idx[i * bpc:(i + 1) * bpc], out=wide_out[i, li])
        else:
            cols = idx.view(n, bpc)
            for j in range(bpc):
                torch.index_select(t, 0, cols[:, j], out=wide_out[:, li, j])


def _even_runs(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]] | None:
    """(target block, source row) pairs sorted by target and cut into runs of evenly spaced targets; None when a
    target repeats."""
    runs: list[list[tuple[int, int]]] = []
    for target, row in sorted(pairs):
        if runs:
            run = runs[-1]
            gap = target - run[-1][0]
            if gap == 0:
                return None
            if len(run) == 1 or gap == run[1][0] - run[0][0]:
                run.append((target, row))
                continue
        runs.append([(target, row)])
    return runs


def _select_into(rows: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], first: torch.Tensor,
                 step: int) -> bool:
    """Payloads ``step`` elements apart from ``first`` on, ``step`` a whole number of pages: the blocks of each
    layer, sorted, cut into runs of evenly spaced ids, each run written by one ``index_select`` whose output is a
    strided view of the layer (per page one slice copy, a memcpy: index kernels copy element by element) and whose
    input views every chunk's pages of that layer as rows. False (nothing written) when a block repeats, when
    there would be more than one run per 8 pages, or when the storage does not hold every page."""
    page, bpc = rows[0].shape[1], len(block_ids[0])
    if step % page or any(r.stride(1) != 1 for r in rows):
        return False
    per = step // page
    pairs = [(b, i * per + j) for i, ids in enumerate(block_ids) for j, b in enumerate(ids) if b != NULL_BLOCK]
    runs = _even_runs(pairs)
    if runs is None or not runs or len(runs) > max(1, len(pairs) // 8):
        return False
    if runs[0][0][0] < 0 or runs[-1][-1][0] >= rows[0].shape[0]:  # let the checked copies raise IndexError
        return False
    base, count = first.storage_offset(), (len(block_ids) - 1) * per + bpc
    try:
        sources = [first.as_strided((count, page), (page, 1), base + li * bpc * page) for li in range(len(rows))]
    except RuntimeError:
        return False
    plan = [(run[0][0], run[1][0] - run[0][0] if len(run) > 1 else 1, index([r for _, r in run], first.device))
            for run in runs]
    for t, src in zip(rows, sources, strict=True):
        for lo, gap, idx in plan:
            out = t.as_strided((len(idx), page), (gap * t.stride(0), 1), t.storage_offset() + lo * t.stride(0))
            (wide_out,), (wide_src,) = wide([out], [src], GATHER_DTYPES)
            torch.index_select(wide_src, 0, idx, out=wide_out)
    return True


def _scatter_columns(rows: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], first: torch.Tensor,
                     step: int) -> bool:
    """Payloads ``step`` elements apart from ``first`` on: one ``index_copy_`` per layer and block position,
    reading block ``j`` of every chunk as one strided view (any block order; ``NULL_BLOCK`` skipped). False when
    the storage does not hold them all (nothing written then)."""
    n, bpc, nl = len(block_ids), len(block_ids[0]), len(rows)
    page, base = first.numel() // (nl * bpc), first.storage_offset()
    try:
        first.as_strided((n, nl * bpc * page), (step, 1), base)
    except RuntimeError:
        return False
    device = rows[0].device
    for j in range(bpc):
        col = [ids[j] for ids in block_ids]
        kept = non_null(col)
        if not kept:
            continue
        targets, pick = index([col[i] for i in kept], device), None if len(kept) == n else index(kept, device)
        for li, t in enumerate(rows):
            src = first.as_strided((n, page), (step, 1), base + (li * bpc + j) * page)
            (wide_t,), (wide_src,) = wide([t], [src if pick is None else src.index_select(0, pick)], SCATTER_DTYPES)
            wide_t.index_copy_(0, targets, wide_src)
    return True


def scatter_into(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
                 chunks: Sequence[torch.Tensor], data: torch.Tensor | None) -> None:
    """Whole pages from each chunk's ``[L, bpc, *page]`` payload (``chunks``, on the layers' device; ``data``
    unused) into page layers. Payloads at one distance in memory (records in consecutive pool slots, one stacked
    tensor): where the blocks sort into few evenly spaced runs (vLLM hands out fresh blocks ascending, reused
    ones descending), one ``index_select`` per layer and run into a strided view of the layer, a memcpy per page
    (``kvtier bench copy``: 32 chunks of two 64 KiB pages x 8 layers, see benchmarks/results/copy.json); else
    one ``index_copy_`` per layer and block position. Otherwise one slice copy per chunk, layer and run of
    consecutive blocks, all in one ``torch._foreach_copy_`` (a C++ loop)."""
    rows = [page_rows(t) for t in layers]
    _check_ids(block_ids, rows[0].shape[0])
    if all(r.dim() == 2 for r in rows):
        step = spacing(chunks)
        if step is not None and (_select_into(rows, block_ids, chunks[0], step)
                                 or _scatter_columns(rows, block_ids, chunks[0], step)):
            return
    _copy_all(_chunk_pairs(rows, block_ids, chunks, range(len(chunks))))


def _check_ids(block_ids: Sequence[Sequence[int]], num_blocks: int) -> None:
    """Raise IndexError (before any write) for a block id outside the layers: an index kernel on a device would
    fail with an assert that takes the device context down instead."""
    ids = [b for chunk in block_ids for b in chunk]
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        raise IndexError(f"block ids {min(ids)}..{max(ids)} outside the layers' {num_blocks} blocks")


def _chunk_pairs(rows: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], chunks: Sequence[torch.Tensor],
                 which: range) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) per chunk in ``which``, layer and run of consecutive blocks (``NULL_BLOCK``
    skipped)."""
    flat = all(r.dim() == 2 for r in rows)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in which:
        ids = block_ids[i]
        src = chunks[i].view(len(rows), len(ids), -1) if flat else chunks[i]
        for pos, first, length in id_runs(ids):
            pairs.extend((t[first:first + length], src[li, pos:pos + length]) for li, t in enumerate(rows))
    return pairs


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every (destination, source) copy: one ``torch._foreach_copy_`` when all are on one device."""
    if not pairs:
        return
    device = pairs[0][0].device
    if all(d.device == device and s.device == device for d, s in pairs):
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    else:
        for dst, src in pairs:
            dst.copy_(src)
