"""Layout geometry from plain numbers: block ids, kernel ids, stride orders and page views (no tensors)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConnectorError
from kvtier.layout.geometry import (
    NULL_BLOCK,
    STRIDE_ORDERS,
    KVLayout,
    block_size_of,
    canonical_layout,
    chunk_payload_shape,
    chunk_runs,
    dense_pages,
    detect_layout,
    id_runs,
    kernel_ids,
    kv_rows,
    layout_name,
    page_order,
    page_ratio,
)


def test_layouts_and_payload_shapes_from_shapes_alone() -> None:
    assert detect_layout((2, 9, 4, 2, 8)) is KVLayout.KV_FIRST
    assert detect_layout((9, 2, 4, 2, 8)) is KVLayout.BLOCKS_FIRST
    assert detect_layout((9, 4, 8)) is KVLayout.MLA
    assert block_size_of((9, 2, 4, 2, 8), KVLayout.BLOCKS_FIRST) == 4
    assert chunk_payload_shape((2, 9, 4, 2, 8), KVLayout.KV_FIRST, 3, 2) == (3, 2, 8, 2, 8)
    assert chunk_payload_shape((9, 4, 8), KVLayout.MLA, 3, 2) == (3, 8, 8)
    assert chunk_payload_shape((9, 2, 4, 16), KVLayout.PAGES, 3, 2) == (3, 2, 2, 4, 16)
    with pytest.raises(ValueError, match="tokens per block"):
        block_size_of((9, 2, 4, 16), KVLayout.PAGES)


def test_kernel_ids_split_each_block_and_keep_the_null_block_null() -> None:
    assert kernel_ids((3, 4), 1) == (3, 4)
    assert kernel_ids((3, NULL_BLOCK, 5), 2) == (6, 7, NULL_BLOCK, NULL_BLOCK, 10, 11)


def test_runs_of_consecutive_blocks() -> None:
    assert id_runs([4, 5, NULL_BLOCK, 7, 8, 10]) == [(0, 4, 2), (3, 7, 2), (5, 10, 1)]
    assert id_runs([NULL_BLOCK, 1, 2]) == [(1, 1, 2)]
    assert chunk_runs([[4, 5], [6, 7], [12, 13]]) == [(0, 4, 2), (2, 12, 1)]
    assert chunk_runs([[4, 6]]) is None and chunk_runs([[NULL_BLOCK, 1]]) is None


def test_kv_rows_address_k_then_v_and_skip_null_blocks() -> None:
    assert kv_rows([3, 4], 10) == ([3, 4, 13, 14], None)
    assert kv_rows([NULL_BLOCK, 4], 10) == ([4, 14], [1, 3])
    assert kv_rows([NULL_BLOCK, NULL_BLOCK], 10) is None


def test_page_orders_follow_vllms_stride_orders() -> None:
    assert page_order("LBHNC").view_order == (0, 1, 2, 3) and page_order("LBHNC").page_axes == (0, 1, 2, 3)
    assert page_order("LBNHC").view_order == (0, 2, 1, 3) and page_order("LBNHC").page_axes == (0, 2, 1, 3)
    assert page_order("BHLNC").view_order == (0, 1, 2, 3)
    assert page_order("HND") is page_order("LBHNC")  # resolved once per layout, legacy names included
    assert canonical_layout("nhd") == "LBNHC" and layout_name("LBNHC") == "LBNHC"
    assert canonical_layout("XYZ") == "XYZ"  # kept, refused where a view is read
    with pytest.raises(ConnectorError, match="unknown KV-cache layout 'XYZ'"):
        page_order("XYZ")
    assert set(STRIDE_ORDERS) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}


def _strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` whose axes lie in memory in ``order`` (outermost first)."""
    strides, step = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis], step = step, step * shape[axis]
    return tuple(strides)


def test_page_ratio_checks_a_view_against_its_layout_and_block_size() -> None:
    shape = (16, 2, 8, 64)  # [B, H, N, C]: 16 kernel blocks of 8 tokens
    lbhnc = _strides(shape, (0, 1, 2, 3))
    assert page_ratio("l", shape, lbhnc, "LBHNC", 16, num_blocks=8) == 2
    assert page_ratio("l", shape, lbhnc, "LBHNC", 8) == 1
    with pytest.raises(ConnectorError, match="do not follow the engine's layout LBNHC"):
        page_ratio("l", shape, lbhnc, "LBNHC", 8)
    assert page_ratio("l", shape, _strides(shape, (0, 2, 1, 3)), "LBNHC", 8) == 1
    with pytest.raises(ConnectorError, match="4-D"):
        page_ratio("l", (16, 2, 8, 2, 32), (1,) * 5, "LBHNC", 8)
    with pytest.raises(ConnectorError, match="do not divide the group's block size 12"):
        page_ratio("l", shape, lbhnc, "LBHNC", 12)
    with pytest.raises(ConnectorError, match="cannot hold"):
        page_ratio("l", shape, lbhnc, "LBHNC", 16, num_blocks=9)


def test_dense_pages() -> None:
    assert dense_pages((16, 2, 8, 64), _strides((16, 2, 8, 64), (0, 1, 2, 3)))
    assert not dense_pages((16, 2, 8, 64), _strides((16, 2, 8, 64), (1, 0, 2, 3)))  # heads outside blocks
    assert dense_pages((16, 1, 8, 64), (1024, 7, 64, 1))  # a size-1 axis's stride does not matter
