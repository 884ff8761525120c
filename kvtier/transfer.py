"""Gather chunk payloads out of an engine's paged KV tensors and scatter them back.

A group's layers each own one paged tensor in one of these layouts (``KVLayout``):

* ``kv_first``     ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM flash / CPU backends)
* ``blocks_first`` ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
* ``mla``          ``[num_blocks, block_size, head_size]`` (one latent vector per token, no K/V split)
* ``pages``        ``[num_blocks, *page]``: vLLM >= 0.32 (one page per block, in the page's memory order; built
                   by :func:`kvtier.pages.page_view` from the engine's ``[B, H, N, C]`` views and layout)

A chunk of ``C`` tokens spans ``C / block_size`` blocks. Its payload (the record's shape) is one contiguous
tensor ``[L, 2, C, heads, head]`` (``[L, C, head]`` for MLA, ``[L, blocks, *page]`` for pages) over the group's
``L`` layers. ``gather`` and ``scatter`` move all chunks of one group at once: index ops (or, for pages, slice
copies over runs of consecutive blocks) per layer over every block of every chunk, no per-token Python work.
They run on whatever device the tensors live on; a CUDA stream may be passed to overlap copies with compute.

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
    PAGES = "pages"


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
    """Tokens per block of a paged tensor (``pages``: not known from the tensor; raises)."""
    if layout is KVLayout.PAGES:
        raise ValueError("a page view does not say its tokens per block; kvtier.pages knows it")
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
    """Blocks ``idx`` of one layer as ``[n, 2, C, H, D]`` (``[n, C, D]`` for MLA), a strided view of a copy
    (cross-device gathers stage each layer on the layers' device this way)."""
    if layout is KVLayout.PAGES:
        return t.index_select(0, idx).view(n, bpc, *t.shape[1:])
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


def _block_dim(layout: KVLayout) -> int:
    return 1 if layout is KVLayout.KV_FIRST else 0


# Element types to view the bytes as, widest first (measured fastest: int64 for index_select, 16-byte complex
# for index_copy_; both copy bits unchanged).
GATHER_DTYPES = (torch.int64, torch.int32)
SCATTER_DTYPES = (torch.complex128, torch.int64, torch.int32)


def _wide(layers: Sequence[torch.Tensor], payloads: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same bytes viewed with the widest elements every tensor allows: index kernels copy element by
    element, so 8-byte elements move 4x fewer of them than bf16. Unchanged when any view is impossible."""
    size = layers[0].element_size()
    for wide in dtypes:
        if wide.itemsize <= size:
            break
        try:
            return [t.view(wide) for t in layers], [p.view(wide) for p in payloads]
        except RuntimeError:  # last dim not contiguous or not a multiple of the wider element
            continue
    return list(layers), list(payloads)


def _chunk_rows(p: torch.Tensor, layout: KVLayout, bpc: int) -> torch.Tensor:
    """One chunk's data of one layer (``[2, C, H, D]`` / ``[C, D]``) as the ``bpc`` block rows an index op
    along the layer's block dim reads or writes (a view)."""
    if layout is KVLayout.MLA:
        return p.view(bpc, p.shape[0] // bpc, p.shape[1])
    rows = p.view(2, bpc, p.shape[1] // bpc, p.shape[2], p.shape[3])
    return rows if layout is KVLayout.KV_FIRST else rows.transpose(0, 1)


def _column_rows(p: torch.Tensor, layout: KVLayout, bpc: int, j: int) -> torch.Tensor:
    """Block ``j`` of every chunk of one layer's data (``[n, 2, C, H, D]`` / ``[n, C, D]``) as the ``n`` block
    rows an index op along the layer's block dim reads or writes (a strided view)."""
    if layout is KVLayout.MLA:
        return p.view(p.shape[0], bpc, p.shape[1] // bpc, p.shape[2])[:, j]
    rows = p.view(p.shape[0], 2, bpc, p.shape[2] // bpc, p.shape[3], p.shape[4])[:, :, j]
    return rows.transpose(0, 1) if layout is KVLayout.KV_FIRST else rows


def _gather_direct(layers: Sequence[torch.Tensor], idx: torch.Tensor, layout: KVLayout, out: torch.Tensor,
                   n: int, bpc: int) -> None:
    """Same-device gather: each layer's blocks go straight into their place in ``out`` (one copy per byte),
    one index op per chunk or per block position, whichever is fewer."""
    wide_layers, (wide_out,) = _wide(layers, [out], GATHER_DTYPES)
    dim = _block_dim(layout)
    if n <= bpc and dim == 1 and all(t.is_contiguous() for t in layers):
        # K and V rows of a chunk in one index_select over the layer viewed as [2 * blocks, ...] (memcpy path;
        # measured: 32 MiB chunks from 68-81% to 76-88% of a plain copy), each chunk's index built once
        num_blocks = int(layers[0].shape[1])
        kv_idx = [torch.cat([idx[i * bpc:(i + 1) * bpc], idx[i * bpc:(i + 1) * bpc] + num_blocks]) for i in range(n)]
        for li, t in enumerate(wide_layers):
            flat, dst = t.view(2 * num_blocks, -1), wide_out[:, li].view(n, 2 * bpc, -1)
            for i in range(n):
                torch.index_select(flat, 0, kv_idx[i], out=dst[i])
        return
    for li, t in enumerate(wide_layers):
        data = wide_out[:, li]
        if n <= bpc:
            for i in range(n):
                rows, chunk_idx = _chunk_rows(data[i], layout, bpc), idx[i * bpc:(i + 1) * bpc]
                if dim == 1:  # K and V apart: contiguous source and destination take the memcpy path
                    torch.index_select(t[0], 0, chunk_idx, out=rows[0])
                    torch.index_select(t[1], 0, chunk_idx, out=rows[1])
                else:
                    torch.index_select(t, 0, chunk_idx, out=rows)
        else:
            cols = idx.view(n, bpc)
            for j in range(bpc):
                torch.index_select(t, dim, cols[:, j], out=_column_rows(data, layout, bpc, j))


def _payload_shape(first: torch.Tensor, layout: KVLayout, num_layers: int, bpc: int) -> tuple[int, ...]:
    if layout is KVLayout.PAGES:
        return (num_layers, bpc, *first.shape[1:])
    return payload_shape(first, layout, num_layers, bpc * block_size_of(first, layout))


def page_rows(t: torch.Tensor) -> torch.Tensor:
    """A ``[blocks, *page]`` tensor as ``[blocks, page_elements]`` (a view) when each page is one dense run of
    memory, so an index op moves whole pages (memcpy); else unchanged."""
    expect = 1
    for d in range(t.dim() - 1, 0, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return t
        expect *= t.shape[d]
    return t.flatten(1)


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
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


def _chunk_runs(block_ids: Sequence[Sequence[int]]) -> list[tuple[int, int, int]] | None:
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


def _gather_pages(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], idx: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Same-device gather of page layers into ``out`` (``[n, L, bpc, *page]``) in as few copies as the block
    ids allow (each call costs ~30 us on top of its bytes): one slice copy per layer and run of chunks whose
    blocks are consecutive (an engine allocates a request's blocks mostly in order; measured at 32 chunks of two
    64 KiB pages: 3.7 GB/s, a plain copy's speed, against 1.6 GB/s for an index op per chunk), else one index
    op per chunk or per block position and layer, whichever is fewer."""
    rows = [page_rows(t) for t in layers]
    n, bpc = len(block_ids), len(block_ids[0])
    dest = out.view(n, len(layers), bpc, -1) if all(r.dim() == 2 for r in rows) else out
    runs = _chunk_runs(block_ids)
    if runs is not None and len(runs) <= min(n, bpc):
        for c0, b0, k in runs:
            for li, t in enumerate(rows):
                dest[c0:c0 + k, li].copy_(t[b0:b0 + k * bpc].unflatten(0, (k, bpc)))
        return
    wide_rows, (wide_out,) = _wide(rows, [dest], GATHER_DTYPES)
    for li, t in enumerate(wide_rows):
        if n <= bpc:
            for i in range(n):
                torch.index_select(t, 0, idx[i * bpc:(i + 1) * bpc], out=wide_out[i, li])
        else:
            cols = idx.view(n, bpc)
            for j in range(bpc):
                torch.index_select(t, 0, cols[:, j], out=wide_out[:, li, j])


def gathered_shape(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout
                   ) -> tuple[int, ...]:
    """The shape ``gather`` returns for these chunks (``[n_chunks, *payload_shape]``)."""
    bpc = _check(layers, block_ids, layout)
    return (len(block_ids), *_payload_shape(layers[0], layout, len(layers), bpc))


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
    with _on_stream(stream):
        idx = _block_index(block_ids, first.device)
        if out.device == first.device and out.dtype == first.dtype and out.is_contiguous():
            if layout is KVLayout.PAGES:
                _gather_pages(layers, block_ids, idx, out)
            else:
                _gather_direct(layers, idx, layout, out, n, bpc)
        else:
            for li, t in enumerate(layers):
                out[:, li].copy_(_layer_blocks(t, idx, layout, n, bpc))
    return out


def _kv_copy_index(ids: Sequence[int], num_blocks: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """For one chunk's blocks ``ids``: the target rows of a ``kv_first`` layer viewed as ``[2 * num_blocks,
    ...]`` (K rows, then V rows), and which rows of the chunk's ``[2 * bpc, ...]`` data go there (None: all);
    ``NULL_BLOCK`` entries are skipped; None when every entry is."""
    bpc = len(ids)
    kept = [j for j, b in enumerate(ids) if b != NULL_BLOCK]
    if not kept:
        return None
    targets = [ids[j] for j in kept]
    index = torch.tensor(targets + [b + num_blocks for b in targets], dtype=torch.long, device=device)
    if len(kept) == bpc:
        return index, None
    return index, torch.tensor(kept + [j + bpc for j in kept], dtype=torch.long, device=device)


def _copy_rows(t: torch.Tensor, dim: int, ids: Sequence[int], rows: torch.Tensor) -> None:
    """``t``'s blocks ``ids`` (along ``dim``) = ``rows``, skipping ``NULL_BLOCK`` entries (decided on the host:
    no device sync)."""
    kept = [j for j, b in enumerate(ids) if b != NULL_BLOCK]
    if len(kept) == len(ids):
        t.index_copy_(dim, torch.tensor(list(ids), dtype=torch.long, device=t.device), rows)
    elif kept:
        pos = torch.tensor(kept, dtype=torch.long, device=t.device)
        t.index_copy_(dim, torch.tensor([ids[j] for j in kept], dtype=torch.long, device=t.device),
                      rows.index_select(dim, pos))


def _scatter_chunks(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
                    payloads: Sequence[torch.Tensor], bpc: int) -> None:
    """One index op per chunk and layer, straight from each chunk's payload (no stacking)."""
    dim = _block_dim(layout)
    if dim == 1 and all(t.is_contiguous() for t in layers) and all(p.is_contiguous() for p in payloads):
        _scatter_kv_chunks(layers, block_ids, payloads)
        return
    for ids, payload in zip(block_ids, payloads, strict=True):
        wide_layers, wide_p = _wide(layers, list(payload.unbind(0)), SCATTER_DTYPES)
        for t, p in zip(wide_layers, wide_p, strict=True):
            _copy_rows(t, dim, ids, _chunk_rows(p, layout, bpc))


def _scatter_kv_chunks(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]],
                       payloads: Sequence[torch.Tensor]) -> None:
    """``kv_first`` layers and payloads, all contiguous: one ``index_copy_`` per chunk and layer moves its K and
    V rows together (measured: 32 MiB chunks from 61-64% to 78-85% of a plain copy; fewer, larger calls), the
    index built once per chunk."""
    num_blocks = int(layers[0].shape[1])
    wide_layers, wide_payloads = _wide(layers, payloads, SCATTER_DTYPES)  # one element width for all
    flats = [t.view(2 * num_blocks, -1) for t in wide_layers]
    for ids, payload in zip(block_ids, wide_payloads, strict=True):
        plan = _kv_copy_index(ids, num_blocks, layers[0].device)
        if plan is None:
            continue
        index, pick = plan
        rows = payload.view(len(flats), 2 * len(ids), -1)
        for flat, src in zip(flats, rows.unbind(0), strict=True):
            flat.index_copy_(0, index, src if pick is None else src.index_select(0, pick))


def _scatter_columns(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
                     data: torch.Tensor, bpc: int) -> None:
    """One index op per block position and layer, straight from strided views of ``data``."""
    dim = _block_dim(layout)
    wide_layers, (wide_data,) = _wide(layers, [data], SCATTER_DTYPES)
    for j in range(bpc):
        col = [ids[j] for ids in block_ids]
        for li, t in enumerate(wide_layers):
            _copy_rows(t, dim, col, _column_rows(wide_data[:, li], layout, bpc, j))


def _scatter_pages(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]],
                   chunks: Sequence[torch.Tensor]) -> None:
    """Whole pages from each chunk's ``[L, bpc, *page]`` payload into page layers: for each chunk and layer, one
    slice copy per run of consecutive blocks (``NULL_BLOCK`` entries skipped)."""
    rows = [page_rows(t) for t in layers]
    flat = all(r.dim() == 2 for r in rows)
    for ids, payload in zip(block_ids, chunks, strict=True):
        src = payload.view(len(layers), len(ids), -1) if flat else payload
        runs = _runs(ids)
        for li, t in enumerate(rows):
            for pos, first, length in runs:
                t[first:first + length].copy_(src[li, pos:pos + length])


def _check_dtypes(payloads: torch.Tensor | Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """Refuse payloads of another dtype than the engine's KV: converting them would load other KV than was
    computed (a record of another dtype belongs to another namespace)."""
    found = {payloads.dtype} if isinstance(payloads, torch.Tensor) else {p.dtype for p in payloads}
    if found - {dtype}:
        raise ValueError(f"payloads of dtype {sorted(map(str, found))} cannot be loaded into KV of dtype {dtype}; "
                         "a record is never converted")


def scatter(layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], layout: KVLayout,
            payloads: torch.Tensor | Sequence[torch.Tensor], *, stream: Any = None) -> None:
    """Write chunk payloads into a group's paged tensors at ``block_ids``; ``NULL_BLOCK`` entries are skipped.

    ``payloads`` is ``[n_chunks, *payload_shape]`` or a sequence of per-chunk payloads (any device; they are
    moved to the layers' device) of the layers' dtype: another dtype raises ``ValueError``, never converted.
    Payloads already on the layers' device are copied straight into the blocks: one copy per byte, no temporary.
    """
    bpc = _check(layers, block_ids, layout)
    n = len(block_ids)
    if n == 0 or bpc == 0:
        return
    first = layers[0]
    expected = _payload_shape(first, layout, len(layers), bpc)
    _check_dtypes(payloads, first.dtype)
    with _on_stream(stream):
        if isinstance(payloads, torch.Tensor):
            data = payloads.to(device=first.device, non_blocking=True).contiguous()
            if tuple(data.shape) != (n, *expected):
                raise ValueError(f"payloads have shape {tuple(data.shape)}, expected {(n, *expected)}")
            chunks = list(data.unbind(0))
        else:
            chunks = [p.to(device=first.device, non_blocking=True).contiguous() for p in payloads]
            if len(chunks) != n or any(tuple(p.shape) != expected for p in chunks):
                raise ValueError(f"payloads have shapes {[tuple(p.shape) for p in chunks]}, expected {n} of "
                                 f"{expected}")
            data = None
        if layout is KVLayout.PAGES:
            _scatter_pages(layers, block_ids, chunks)
        elif n <= bpc:
            _scatter_chunks(layers, block_ids, layout, chunks, bpc)
        else:
            _scatter_columns(layers, block_ids, layout, torch.stack(chunks) if data is None else data, bpc)
