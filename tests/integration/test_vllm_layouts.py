"""kvtier's page views over the KV views vLLM 0.33's own planner and allocator build, in every layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.errors import ConnectorError
from kvtier.kvcopy.paged import page_rows
from kvtier.kvcopy.pages import page_view
from kvtier.kvcopy.transfer import gather, scatter
from kvtier.layout.geometry import NULL_BLOCK, STRIDE_ORDERS, KVLayout, kernel_ids

DENSE = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}  # a block's page of one layer is one run of memory


def views(kit: Any, layout: str, kernel: int | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    kcc = kit.planned_kv_cache_config(hybrid=False, layout=layout)
    return kcc, kit.kv_views(kcc, kernel)


@pytest.mark.parametrize("layout", sorted(STRIDE_ORDERS))
def test_pages_follow_the_layout_and_dense_pages_move_whole(layout: str, kit: Any) -> None:
    _, kv = views(kit, layout)
    for name, view in kv.items():
        pages, ratio = page_view(name, view, layout, kit.BLOCK_SIZE)
        assert ratio == 1 and pages.shape[0] == view.shape[0]
        # page axes in memory order: H and N swap places in the *NHC layouts
        assert tuple(pages.shape[1:]) == ((view.shape[2], view.shape[1], view.shape[3]) if "NHC" in layout
                                          else tuple(view.shape[1:]))
        rows = page_rows(pages)
        assert rows.dim() == (2 if layout in DENSE else 4)
        if rows.dim() == 2:  # a row is exactly the block's bytes of this layer
            assert rows.data_ptr() == view.data_ptr() and rows.stride() == (view.stride(0), 1)


@pytest.mark.parametrize(("layout", "kernel"), [("LBHNC", None), ("LBNHC", 8), ("LHBNC", None), ("BHLNC", None)])
def test_gather_then_scatter_moves_exactly_the_chunks_blocks(layout: str, kernel: int | None, kit: Any) -> None:
    kcc, src = views(kit, layout, kernel)
    dst = kit.kv_views(kcc, kernel)
    torch.manual_seed(0)
    for view in src.values():
        view.copy_(torch.randn(view.shape, dtype=view.dtype))
    names = list(src)
    ratio = kit.BLOCK_SIZE // kernel if kernel else 1
    src_pages = [page_view(n, src[n], layout, kit.BLOCK_SIZE)[0] for n in names]
    dst_pages = [page_view(n, dst[n], layout, kit.BLOCK_SIZE)[0] for n in names]
    chunks = [(1, 2), (3, 4), (9, 10)]
    payload = gather(src_pages, [kernel_ids(c, ratio) for c in chunks], KVLayout.PAGES)
    assert payload.is_contiguous() and payload.shape[:3] == (3, len(names), 2 * ratio)
    targets = [(5, NULL_BLOCK), (6, 7), (11, 12)]  # the null block is left alone
    scatter(dst_pages, [kernel_ids(t, ratio) for t in targets], KVLayout.PAGES, payload)
    moved = {5: 1, 6: 3, 7: 4, 11: 9, 12: 10}
    for name in names:
        for block in range(kcc.num_blocks):
            for k in range(ratio):
                got = dst[name][block * ratio + k]
                if block in moved:
                    assert torch.equal(got, src[name][moved[block] * ratio + k]), (name, block, k)
                else:
                    assert not got.any(), (name, block, k)


def test_views_that_do_not_match_the_description_are_refused_with_the_layout_and_a_fix(kit: Any) -> None:
    _, kv = views(kit, "LBNHC")
    name, view = next(iter(kv.items()))
    with pytest.raises(ConnectorError, match=r"do not follow the engine's layout LBHNC.*VLLM_KV_CACHE_LAYOUT"):
        page_view(name, view, "LBHNC", kit.BLOCK_SIZE)
    with pytest.raises(ConnectorError, match=r"4-D .*VLLM_KV_CACHE_LAYOUT"):
        page_view(name, torch.zeros(2, 8, 16, 2, 32), "LBHNC", kit.BLOCK_SIZE)
    with pytest.raises(ConnectorError, match="do not divide the group's block size 24"):
        page_view(name, view, "LBNHC", 24)
    kcc = kit.planned_kv_cache_config(hybrid=False, layout="LBNHC")
    with pytest.raises(ConnectorError, match="cannot hold"):  # 16-token blocks read as 4 kernel blocks of 4
        page_view(name, view, "LBNHC", 4 * kit.BLOCK_SIZE, num_blocks=kcc.num_blocks)
    with pytest.raises(ConnectorError, match="unknown KV-cache layout 'XYZ'"):
        page_view(name, view, "XYZ", kit.BLOCK_SIZE)
    assert page_view(name, view, "NHD", kit.BLOCK_SIZE)[1] == 1  # vLLM's legacy name for LBNHC
