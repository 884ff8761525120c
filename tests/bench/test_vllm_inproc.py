"""The breakdown of a hit's time to first token (kvtier.bench.vllm_inproc.PhaseTimer): its phases add up to the
request's time and each is the part of the timeline it names, whatever overlaps on the I/O loop."""

from __future__ import annotations

import pytest

from kvtier.bench.vllm_inproc import PhaseTimer, overlap, union


def test_union_merges_overlapping_spans_in_order() -> None:
    assert union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 6.0)]
    assert union([]) == []


def test_overlap_counts_time_covered_by_both() -> None:
    assert overlap([(0.0, 4.0)], [(1.0, 2.0), (3.0, 6.0)]) == pytest.approx(2.0)
    assert overlap([(0.0, 1.0)], [(2.0, 3.0)]) == 0.0


def _timer(spans: dict[str, list[tuple[float, float]]]) -> PhaseTimer:
    timer = PhaseTimer()
    timer.spans = spans
    timer.nbytes = 1 << 20
    return timer


def test_asynchronous_hit_splits_into_phases_that_add_up() -> None:
    """A request from 0 to 100 ms: a lookup, an asynchronous read on the I/O loop (10-40 ms) while the engine
    steps and waits in ``get_finished`` (30-40 ms), the copy (50-55 ms) in a later step's hook, then the suffix's
    forward pass."""
    ms = 1e-3
    timer = _timer({
        "lookup": [(1 * ms, 3 * ms), (96 * ms, 97 * ms)],
        "medium": [(10 * ms, 40 * ms)],
        "forward": [(8 * ms, 12 * ms), (29 * ms, 41 * ms), (49 * ms, 56 * ms), (60 * ms, 90 * ms)],
        "sample": [(90 * ms, 92 * ms)],
        "worker": [(9 * ms, 11 * ms), (30 * ms, 40 * ms), (50 * ms, 55 * ms), (61 * ms, 62 * ms)],
        "copy": [(50 * ms, 55 * ms)],
    })
    got = timer.breakdown(0.0, 100 * ms)
    assert got["lookup"] == pytest.approx(3 * ms)
    assert got["medium_wait"] == pytest.approx(11 * ms)  # 10-11 in start_load_kv, 30-40 in get_finished
    assert got["copy"] == pytest.approx(5 * ms)
    assert got["handoff"] == pytest.approx((18 - 5 - 11) * ms)
    assert got["compute"] == pytest.approx((55 - 18) * ms)  # 53 ms of forward and sampling, 18 of it hooks
    assert got["engine"] == pytest.approx((100 - 3 - 55) * ms)
    assert sum(got[k] for k in ("lookup", "medium_wait", "copy", "handoff", "compute", "engine")) == pytest.approx(
        100 * ms)
    assert got["medium_s"] == pytest.approx(30 * ms)
    assert (got["steps"], got["steps_loading"], got["bytes"]) == (4, 3, 1 << 20)


def test_spans_outside_the_request_are_left_out() -> None:
    """The previous request's steps and a background read after the first token count nothing."""
    timer = _timer({"forward": [(-5.0, -4.0), (0.2, 0.6)], "medium": [(0.9, 2.0)], "worker": [(0.95, 1.5)]})
    got = timer.breakdown(0.0, 1.0)
    assert got["compute"] == pytest.approx(0.4 - 0.05)
    assert got["medium_s"] == pytest.approx(0.1)
    assert got["medium_wait"] == pytest.approx(0.05)
    assert got["steps"] == 1
