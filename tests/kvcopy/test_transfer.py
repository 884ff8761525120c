"""gather / scatter between paged KV tensors and chunk payloads."""

from __future__ import annotations

import pytest
import torch

from kvtier.kvcopy.transfer import gather, gathered_shape, scatter
from kvtier.layout.geometry import NULL_BLOCK, KVLayout, chunk_payload_shape, detect_layout, payload_shape

NUM_BLOCKS, BS, HEADS, HEAD = 24, 4, 2, 8


def _paged(layout: KVLayout, n_layers: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if layout is KVLayout.KV_FIRST:
        shape: tuple[int, ...] = (2, NUM_BLOCKS, BS, HEADS, HEAD)
    elif layout is KVLayout.BLOCKS_FIRST:
        shape = (NUM_BLOCKS, 2, BS, HEADS, HEAD)
    elif layout is KVLayout.PAGES:  # [blocks, *page]: vLLM >= 0.32 views, K and V packed in the last axis
        shape = (NUM_BLOCKS, HEADS, BS, 2 * HEAD)
    else:
        shape = (NUM_BLOCKS, BS, HEAD)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n_layers)]


def _block(t: torch.Tensor, layout: KVLayout, b: int) -> torch.Tensor:
    return t[:, b] if layout is KVLayout.KV_FIRST else t[b]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_then_scatter_into_other_blocks_reproduces(layout: KVLayout, dtype: torch.dtype) -> None:
    src = _paged(layout, 3, dtype, seed=1)
    dst = _paged(layout, 3, dtype, seed=2)
    src_ids = [[3, 7], [1, 9], [12, 2]]  # three chunks of two blocks each
    dst_ids = [[5, 6], [20, 21], [11, 4]]
    payload = gather(src, src_ids, layout)
    assert payload.is_contiguous()
    if layout is KVLayout.PAGES:  # [layers, blocks, *page]
        assert tuple(payload.shape) == (3, 3, 2, HEADS, BS, 2 * HEAD)
    else:
        assert tuple(payload.shape) == (3, *payload_shape(src[0], layout, 3, 2 * BS))
    before = [t.clone() for t in dst]
    scatter(dst, dst_ids, layout, payload)
    for layer in range(3):
        for chunk in range(3):
            for j in range(2):
                assert torch.equal(_block(dst[layer], layout, dst_ids[chunk][j]),
                                   _block(src[layer], layout, src_ids[chunk][j]))
        touched = {b for c in dst_ids for b in c}
        for b in set(range(NUM_BLOCKS)) - touched:
            assert torch.equal(_block(dst[layer], layout, b), _block(before[layer], layout, b))


def test_payload_token_order_is_k_then_v_per_layer() -> None:
    # Token t of the chunk in layer l is K = layer[0, block, slot], V = layer[1, block, slot].
    layers = _paged(KVLayout.KV_FIRST, 2, torch.float32)
    payload = gather(layers, [[4, 2]], KVLayout.KV_FIRST)[0]
    assert torch.equal(payload[1, 0, BS + 1], layers[1][0, 2, 1])
    assert torch.equal(payload[0, 1, 3], layers[0][1, 4, 3])


def test_layouts_agree_on_payload() -> None:
    kv_first = _paged(KVLayout.KV_FIRST, 2, torch.float32)
    blocks_first = [t.transpose(0, 1).contiguous() for t in kv_first]
    ids = [[1, 2], [8, 3]]
    assert torch.equal(gather(kv_first, ids, KVLayout.KV_FIRST), gather(blocks_first, ids, KVLayout.BLOCKS_FIRST))


def test_null_block_is_left_untouched() -> None:
    src = _paged(KVLayout.KV_FIRST, 2, torch.float32, seed=3)
    dst = _paged(KVLayout.KV_FIRST, 2, torch.float32, seed=4)
    null_before = [t[:, NULL_BLOCK].clone() for t in dst]
    payload = gather(src, [[5, 6], [7, 8]], KVLayout.KV_FIRST)
    scatter(dst, [[NULL_BLOCK, 10], [11, 12]], KVLayout.KV_FIRST, payload)
    for layer in range(2):
        assert torch.equal(dst[layer][:, NULL_BLOCK], null_before[layer])
        assert torch.equal(dst[layer][:, 10], src[layer][:, 6])
        assert torch.equal(dst[layer][:, 12], src[layer][:, 8])


def test_many_chunks_and_list_payloads() -> None:
    src = _paged(KVLayout.BLOCKS_FIRST, 2, torch.bfloat16, seed=5)
    ids = [[b] for b in range(1, NUM_BLOCKS)]
    payload = gather(src, ids, KVLayout.BLOCKS_FIRST)
    dst = [torch.zeros_like(t) for t in src]
    scatter(dst, list(reversed(ids)), KVLayout.BLOCKS_FIRST, list(payload))
    for layer in range(2):
        for i, (b,) in enumerate(ids):
            assert torch.equal(dst[layer][NUM_BLOCKS - i - 1], src[layer][b])


def test_empty_and_bad_shapes() -> None:
    layers = _paged(KVLayout.KV_FIRST, 1, torch.float32)
    assert gather(layers, [], KVLayout.KV_FIRST).shape[0] == 0
    scatter(layers, [], KVLayout.KV_FIRST, torch.empty(0))
    with pytest.raises(ValueError):
        gather(layers, [[1, 2], [3]], KVLayout.KV_FIRST)
    with pytest.raises(ValueError):
        scatter(layers, [[1]], KVLayout.KV_FIRST, torch.zeros(1, 1, 2, 2 * BS, HEADS, HEAD))


def test_detect_layout() -> None:
    assert detect_layout(torch.empty(2, 9, 4, 2, 8)) is KVLayout.KV_FIRST
    assert detect_layout(torch.empty(9, 2, 4, 2, 8)) is KVLayout.BLOCKS_FIRST
    assert detect_layout(torch.empty(9, 4, 8)) is KVLayout.MLA
    with pytest.raises(ValueError):
        detect_layout(torch.empty(9, 3, 4, 2, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_roundtrip_on_a_side_stream() -> None:
    src = [t.cuda() for t in _paged(KVLayout.KV_FIRST, 2, torch.bfloat16, seed=6)]
    dst = [torch.zeros_like(t) for t in src]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    payload = gather(src, [[1, 2], [3, 4]], KVLayout.KV_FIRST, stream=stream)
    scatter(dst, [[5, 6], [7, 8]], KVLayout.KV_FIRST, payload.cpu(), stream=stream)
    stream.synchronize()
    assert payload.device.type == "cuda"
    for layer in range(2):
        assert torch.equal(dst[layer][:, [5, 6, 7, 8]], src[layer][:, [1, 2, 3, 4]])


def test_gather_into_another_device_or_buffer() -> None:
    layers = _paged(KVLayout.KV_FIRST, 2, torch.float16)
    ids = [[1, 2], [3, 4]]
    expected = gather(layers, ids, KVLayout.KV_FIRST)
    assert torch.equal(gather(layers, ids, KVLayout.KV_FIRST, device="cpu"), expected)
    buf = torch.empty_like(expected)
    assert gather(layers, ids, KVLayout.KV_FIRST, out=buf) is buf
    assert torch.equal(buf, expected)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_gather_into_a_strided_buffer_stages_each_layer_and_matches_block_by_block_copies(layout: KVLayout) -> None:
    """An ``out`` the blocks cannot be copied straight into (not contiguous) takes each family's staged path."""
    layers = _paged(layout, 3, torch.float32, seed=7)
    ids = [[1, 2], [5, NUM_BLOCKS - 1], [9, 3]]
    shape = gathered_shape(layers, ids, layout)
    assert shape == (3, *chunk_payload_shape(layers[0], layout, 3, 2))
    buf = torch.full((shape[1], shape[0], *shape[2:]), -1.0).transpose(0, 1)  # [n, L, ...] view, not contiguous
    assert not buf.is_contiguous()
    assert gather(layers, ids, layout, out=buf) is buf
    assert torch.equal(buf, _reference_blocks(layers, layout, ids))


def _reference_blocks(layers: list[torch.Tensor], layout: KVLayout, ids: list[list[int]]) -> torch.Tensor:
    """Payloads built block by block with plain indexing (what gather must produce)."""
    chunks = []
    for chunk in ids:
        per_layer = []
        for t in layers:
            if layout is KVLayout.KV_FIRST:
                per_layer.append(torch.cat([t[:, b] for b in chunk], dim=1))
            elif layout is KVLayout.BLOCKS_FIRST:
                per_layer.append(torch.cat([t[b] for b in chunk], dim=1))
            elif layout is KVLayout.PAGES:
                per_layer.append(torch.stack([t[b] for b in chunk]))
            else:
                per_layer.append(torch.cat([t[b] for b in chunk], dim=0))
        chunks.append(torch.stack(per_layer))
    return torch.stack(chunks)


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, denormals included): copies must keep every bit."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("n_chunks", "per_chunk"), [(2, 4), (6, 2), (1, 1), (5, 1)])  # per-chunk / per-column
@pytest.mark.parametrize("head", [HEAD, 3])  # 3 bf16 values per row: no wider view of the bytes exists
@pytest.mark.parametrize("as_list", [False, True])
def test_direct_paths_match_block_by_block_copies(layout: KVLayout, n_chunks: int, per_chunk: int, head: int,
                                                  as_list: bool) -> None:
    blocks = n_chunks * per_chunk + 1
    shape = {KVLayout.KV_FIRST: (2, blocks, BS, HEADS, head), KVLayout.BLOCKS_FIRST: (blocks, 2, BS, HEADS, head),
             KVLayout.MLA: (blocks, BS, head), KVLayout.PAGES: (blocks, HEADS, BS, head)}[layout]
    src = [_random_bits(shape, torch.bfloat16, seed) for seed in range(3)]
    if layout is KVLayout.PAGES and head == 3:  # pages that are not one run of memory (heads outside blocks)
        src = [_random_bits((HEADS, blocks, BS, head), torch.bfloat16, seed).transpose(0, 1) for seed in range(3)]
    order = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(7)).add(1).tolist()
    ids = [order[i * per_chunk:(i + 1) * per_chunk] for i in range(n_chunks)]
    payload = gather(src, ids, layout)
    assert _same_bits(payload, _reference_blocks(src, layout, ids))
    dst = [torch.zeros_like(t) for t in src]
    dst_ids = [list(reversed(c)) for c in reversed(ids)]
    dst_ids[0][0] = NULL_BLOCK  # left alone
    scatter(dst, dst_ids, layout, list(payload.unbind(0)) if as_list else payload)
    expected = [torch.zeros_like(t) for t in src]
    for li in range(3):
        for chunk, targets in zip(payload.unbind(0), dst_ids, strict=True):
            layer = chunk[li]
            for j, b in enumerate(targets):
                if b == NULL_BLOCK:
                    continue
                if layout is KVLayout.KV_FIRST:
                    expected[li][:, b] = layer[:, j * BS:(j + 1) * BS]
                elif layout is KVLayout.BLOCKS_FIRST:
                    expected[li][b] = layer[:, j * BS:(j + 1) * BS]
                elif layout is KVLayout.PAGES:
                    expected[li][b] = layer[j]
                else:
                    expected[li][b] = layer[j * BS:(j + 1) * BS]
    for got, want in zip(dst, expected, strict=True):
        assert _same_bits(got, want)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_pages_landed(dst: list[torch.Tensor], targets: list[list[int]], payload: torch.Tensor,
                         before: list[torch.Tensor] | None = None) -> None:
    """Every page of ``payload`` is in its target block of every layer of ``dst``; every other block is as in
    ``before`` (all zeros without it)."""
    written = {b for c in targets for b in c} - {NULL_BLOCK}
    for li, layer in enumerate(dst):
        for chunk, tids in enumerate(targets):
            for j, b in enumerate(tids):
                if b != NULL_BLOCK:
                    assert _same_bits(layer[b], payload[chunk, li, j])
        untouched = [b for b in range(NUM_BLOCKS) if b not in written]
        if before is None:
            assert all(not layer[b].view(torch.int16).any() for b in untouched)
        else:
            assert all(_same_bits(layer[b], before[li][b]) for b in untouched)


@pytest.mark.parametrize("ids", [[[4, 5], [6, 7], [8, 9]], [[4, 5], [6, 7], [12, 13]], [[2, 3], [9, 10], [20, 21]]])
@pytest.mark.parametrize("strided", [False, True])
def test_pages_in_runs_of_consecutive_blocks_match_block_by_block_copies(ids: list[list[int]], strided: bool) -> None:
    """Chunks whose blocks follow each other are moved as slices (one copy per run and layer)."""
    if strided:  # heads outside blocks: pages are not one run of memory
        src = [_random_bits((HEADS, NUM_BLOCKS, BS, HEAD), torch.bfloat16, s).transpose(0, 1) for s in range(3)]
    else:
        src = [_random_bits((NUM_BLOCKS, HEADS, BS, HEAD), torch.bfloat16, s) for s in range(3)]
    payload = gather(src, ids, KVLayout.PAGES)
    assert _same_bits(payload, _reference_blocks(src, KVLayout.PAGES, ids))
    dst = [torch.zeros_like(t) for t in src]
    targets = [[b + 1 for b in c] for c in ids]
    targets[1][0] = NULL_BLOCK
    targets[2] = [NULL_BLOCK, 1]  # a null entry followed by block 1 (the first block an engine hands out)
    scatter(dst, targets, KVLayout.PAGES, payload)
    _assert_pages_landed(dst, targets, payload)


def test_page_scatter_after_null_entries_writes_the_real_blocks() -> None:
    """Sliding-window loads and blocks the engine already holds come as ``NULL_BLOCK`` before real ids."""
    src = [_random_bits((NUM_BLOCKS, HEADS, BS, HEAD), torch.bfloat16, s) for s in range(2)]
    payload = gather(src, [[5, 6, 7, 8]], KVLayout.PAGES)
    for targets in ([NULL_BLOCK, NULL_BLOCK, 1, 2], [NULL_BLOCK, 1, 2, 3], [NULL_BLOCK, 2, NULL_BLOCK, 3]):
        dst = [torch.zeros_like(t) for t in src]
        scatter(dst, [targets], KVLayout.PAGES, payload)
        for li in range(2):
            for j, b in enumerate(targets):
                if b != NULL_BLOCK:
                    assert _same_bits(dst[li][b], src[li][5 + j]), (targets, j)
            assert not dst[li][0].view(torch.int16).any()


@pytest.mark.parametrize("as_list", [False, True])
def test_scatter_refuses_payloads_of_another_dtype_and_leaves_the_blocks_alone(as_list: bool) -> None:
    dst = _paged(KVLayout.KV_FIRST, 2, torch.bfloat16, seed=2)
    before = [t.clone() for t in dst]
    blocks = [(1, 2)]
    payload = gather(dst, blocks, KVLayout.KV_FIRST).to(torch.float32)
    with pytest.raises(ValueError, match="never converted"):
        scatter(dst, blocks, KVLayout.KV_FIRST, list(payload) if as_list else payload)
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_scatter_from_spaced_slots_writes_each_page_in_any_block_order(dtype: torch.dtype) -> None:
    """Payloads at one distance in one buffer (a pool's consecutive slots, wider than a record) go by block
    position with strided reads; blocks in descending order (vLLM's reused blocks) and a null entry included."""
    src = [_random_bits((NUM_BLOCKS, HEADS, BS, HEAD), dtype, s) for s in range(3)]
    ids = [[2, 3], [9, 10], [20, 21], [5, 6]]
    payload = gather(src, ids, KVLayout.PAGES)
    slot = payload[0].numel() + 64  # slots wider than a record: the payloads are spaced, not stacked
    pool = torch.zeros(len(ids) * slot, dtype=dtype)
    views = [pool[i * slot:i * slot + payload[0].numel()].view(payload[0].shape) for i in range(len(ids))]
    for view, p in zip(views, payload.unbind(0), strict=True):
        view.copy_(p)
    dst = [torch.zeros_like(t) for t in src]
    targets = [[17, 16], [15, 14], [NULL_BLOCK, 12], [8, 1]]
    scatter(dst, targets, KVLayout.PAGES, views)
    _assert_pages_landed(dst, targets, payload)


@pytest.mark.parametrize("targets", [
    [[13, 12], [11, 10], [9, 8], [7, NULL_BLOCK]],  # vLLM's reused blocks: descending; a null entry at the end
    [[2, 4], [6, 8], [10, 12], [14, 16]],  # every other block: the layer's rows in between stay untouched
    [[22, 20], [18, 16], [14, 12], [10, 8]],
    [[5, 6], [7, 8], [9, 10], [11, 12]],  # fresh blocks: ascending
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_scatter_into_evenly_spaced_blocks_writes_each_page_and_nothing_else(
        targets: list[list[int]], dtype: torch.dtype) -> None:
    """Spaced payloads whose blocks sort into one evenly spaced run go by one index op per layer into a strided
    view of the layer: every page lands in its block, no other block changes."""
    from kvtier.kvcopy import paged

    src = [_random_bits((NUM_BLOCKS, HEADS, BS, 2 * HEAD), dtype, s) for s in range(3)]
    payload = gather(src, [[1, 2], [3, 4], [5, 6], [7, 8]], KVLayout.PAGES)
    slot = payload[0].numel() + 2 * HEADS * BS * 2 * HEAD  # slots two pages wider than a record
    pool = torch.zeros(len(targets) * slot, dtype=dtype)
    views = [pool[i * slot:i * slot + payload[0].numel()].view(payload[0].shape) for i in range(len(targets))]
    for view, p in zip(views, payload.unbind(0), strict=True):
        view.copy_(p)
    dst = [_random_bits(tuple(t.shape), dtype, 9 + li) for li, t in enumerate(src)]
    before = [t.clone() for t in dst]
    rows = [t.flatten(1) for t in [t.clone() for t in dst]]
    assert paged._select_into(rows, targets, views[0], slot)  # the path these inputs take
    scatter(dst, targets, KVLayout.PAGES, views)
    for li in range(3):
        assert torch.equal(rows[li].view(torch.uint8), dst[li].flatten(1).view(torch.uint8))
    _assert_pages_landed(dst, targets, payload, before)


def test_page_scatter_to_a_block_past_the_layer_raises_and_writes_no_other_block() -> None:
    """A plan naming a block past the layer fails the scatter (its blocks become load errors, recomputed); no block
    outside the plan is written (a strided view could reach past the layer's rows into other memory)."""
    src = _paged(KVLayout.PAGES, 2, torch.float32, seed=4)
    payload = gather(src, [[1, 2], [3, 4]], KVLayout.PAGES)
    dst = _paged(KVLayout.PAGES, 2, torch.float32, seed=5)
    before = [t.clone() for t in dst]
    with pytest.raises(IndexError, match="outside the layers"):  # checked before any write (a device would assert)
        scatter(dst, [[NUM_BLOCKS - 2, NUM_BLOCKS - 1], [NUM_BLOCKS, NUM_BLOCKS + 1]], KVLayout.PAGES, payload)
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


@pytest.mark.parametrize("gap", [0, 64])
def test_kv_first_records_back_to_back_scatter_with_no_stacking_copy(gap: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records in consecutive pool slots (a memory tier's borrow) are one stacked view: more chunks than blocks per
    chunk take the per-column path without ``torch.stack`` (a second copy of every byte, into fresh memory). With a
    gap between them they are stacked as before. Either way each block gets its chunk's rows."""
    n = 6  # chunks of 2 blocks: more chunks than blocks per chunk
    src = _paged(KVLayout.KV_FIRST, 3, torch.float32, seed=1)
    payload = gather(src, [[2 * i + 1, 2 * i + 2] for i in range(n)], KVLayout.KV_FIRST)
    record = payload[0].numel()
    pool = torch.zeros(n * (record + gap))
    views = []
    for i in range(n):
        start = i * (record + gap)
        pool[start:start + record] = payload[i].reshape(-1)
        views.append(pool[start:start + record].view(payload[0].shape))
    stack = torch.stack
    stacked: list[int] = []

    def counted(tensors: list[torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
        stacked.append(len(tensors))
        return stack(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "stack", counted)
    targets = [[23 - 2 * i, 22 - 2 * i] for i in range(n)]
    dst = [torch.zeros_like(t) for t in src]
    scatter(dst, targets, KVLayout.KV_FIRST, views)
    assert stacked == ([] if gap == 0 else [n])
    for li in range(3):
        for i, ids in enumerate(targets):
            for j, b in enumerate(ids):
                assert torch.equal(dst[li][:, b], payload[i, li][:, j * BS:(j + 1) * BS])
