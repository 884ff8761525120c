"""``kvtier bench vllm-contention`` without vLLM: which steps count as the batch decoding alone, while loads are
read, or copying them in; what a round reports; the summary's ratios and hit check; the token comparison between
modes; and the settings it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.bench.vllm_contention import (
    alone_steps,
    copy_steps,
    delay,
    in_flight_steps,
    round_sample,
    same_tokens,
    settings_problem,
    summarize,
)


def _step(s: float, tokens: int, running: int, remote: int = 0, pending: int = 0, copied: int = 0,
          hook_s: float = 0.0) -> dict[str, Any]:
    return {"s": s, "tokens": tokens, "running": running, "remote": remote, "pending": pending, "copied": copied,
            "hook_s": hook_s}


STEPS = [_step(0.5, 256, 4), _step(0.010, 4, 4), _step(0.011, 4, 4),  # prefill of the batch, then decode
         _step(0.030, 4, 4, remote=2, pending=2), _step(0.020, 4, 4, remote=2, pending=2),  # loads being read
         _step(0.025, 4, 4, remote=2, pending=2, copied=2, hook_s=0.012),  # reads done: the copy runs in this step
         _step(0.2, 36, 4, remote=2, pending=2),  # the loaded requests leave the wait and compute their suffixes
         _step(0.012, 4, 4)]  # decode again


def test_steps_are_split_into_alone_loads_read_and_the_copy() -> None:
    assert alone_steps(STEPS) == [0.010, 0.011, 0.012]  # never a prefill step, nor one with a load around
    assert in_flight_steps(STEPS) == [(0.030, 0.0), (0.020, 0.0)]
    assert copy_steps(STEPS) == [(0.025, 0.012)]
    extra, steps = delay(STEPS, 0.010)  # the four steps the added requests waited through, less 4 usual steps
    assert steps == 4 and extra == pytest.approx(0.030 + 0.020 + 0.025 + 0.2 - 0.040)


def _runs(alone: float, during: float, busy: float, idle: float, cached: int, tokens: list[int]) -> dict[str, Any]:
    return {"alone": {"steps": [_step(alone, 4, 4)] * 3, "kvtier_thread_s": 0.001},
            "with_loads": {"steps": [_step(alone, 4, 4), _step(during, 4, 4, remote=2, pending=2),
                                     _step(0.3, 20, 5, pending=2)],
                           "kvtier_thread_s": 0.011,
                           "first_token_s": [busy, busy + 0.01], "cached": [cached, cached], "tokens": [tokens] * 2},
            "idle": {"steps": [], "first_token_s": [idle, idle], "cached": [cached, cached], "tokens": [tokens] * 2}}


def test_a_round_reports_step_medians_loader_times_and_cached_tokens() -> None:
    row = round_sample(_runs(0.010, 0.015, 0.2, 0.1, 128, [7]))
    assert row["alone_step_s"] == 0.010 and row["during_step_s"] == 0.015 and row["during_steps"] == 1
    assert row["during_hook_s"] == 0.0 and row["copy_step_s"] is None  # no step reported a finished load
    assert row["extra_step_s"] == pytest.approx(0.015 + 0.3 - 0.020) and row["delayed_steps"] == 2
    assert row["load_thread_s"] == pytest.approx(0.010)
    assert row["loader_ttft_busy_s"] == pytest.approx(0.205) and row["loader_ttft_idle_s"] == 0.1
    assert row["cached"] == [128] * 4 and row["tokens"] == [[7]] * 4


def test_summary_pairs_rounds_and_checks_every_loader_hit_its_whole_prefix() -> None:
    rows = [round_sample(_runs(0.010, 0.020, 0.2, 0.1, 128, [7])),
            round_sample(_runs(0.020, 0.020, 0.2, 0.1, 128, [7]))]
    table = summarize({"kvtier_disk": rows, "kvtier_redis": [round_sample(_runs(0.01, 0.01, 0.2, 0.1, 96, [7]))]}, 128)
    assert table["kvtier_disk"]["during_vs_alone"]["median"] == pytest.approx(1.5)  # 2.0 and 1.0
    assert table["kvtier_disk"]["copy_step_s"] is None
    assert table["kvtier_disk"]["loaders_hit_whole_prefix"] is True
    assert table["kvtier_redis"]["loaders_hit_whole_prefix"] is False  # 96 of 128 tokens


def test_tokens_must_match_the_first_mode_round_by_round_and_be_there() -> None:
    same = {"none": [{"tokens": [[1], [2]]}], "kvtier_disk": [{"tokens": [[1], [2]]}],
            "kvtier_redis": [{"tokens": [[1], [3]]}]}
    assert same_tokens(same) == {"none": True, "kvtier_disk": True, "kvtier_redis": False}
    assert same_tokens({"none": [{"tokens": [[]]}]}) == {"none": False}  # a loader that gave nothing


def test_settings_that_cannot_measure_are_refused_in_one_line() -> None:
    assert settings_problem(1024, 48) is None
    assert "multiple of the chunk" in (settings_problem(1000, 48) or "")
    assert "--decode-tokens 4 is too few" in (settings_problem(1024, 4) or "")
