"""``kvtier bench serve``'s report (kvtier.bench.serve_report) without vLLM: the hit accounting by source and its
reconciliation with kvtier's counters, tier errors, the output comparison, latency and ratios, the simulation and
the measured causes of a gap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import serve_report
from kvtier.bench.serve_client import Reply
from kvtier.bench.serve_trace import Scaling, ServeRequest, hit_workload, scale, synthetic_rows, write_rows

SRC = "vllm:prompt_tokens_by_source_total"


def metric_samples(compute: float, local: float, external: float, tiers: dict[str, float]) -> dict[Any, float]:
    out: dict[Any, float] = {(SRC, (("source", "local_compute"),)): compute,
                             (SRC, (("source", "local_cache_hit"),)): local,
                             (SRC, (("source", "external_kv_transfer"),)): external,
                             ("kvtier_load_bytes_total", ()): external * 10,
                             ("kvtier_load_failures_total", ()): 0.0,
                             (serve_report.PREFILL_COMPUTED, ()): compute}
    for tier, n in tiers.items():
        out["kvtier_tier_read_bytes_total", (("tier", tier),)] = n * 10
        out["kvtier_hit_tokens_total", (("group", "0"), ("tier", tier))] = n
        out["kvtier_stored_bytes_total", (("tier", tier),)] = n * 100
    return out


def test_hit_rates_by_source_and_kvtier_tiers_reconcile_with_vllms_external_count() -> None:
    before = metric_samples(100, 0, 0, {"cpu": 0, "disk": 0})
    after = metric_samples(700, 200, 100, {"cpu": 60, "disk": 40})
    row = serve_report.hit_summary(before, after)
    assert row["prompt_tokens"] == 900 and row["tokens_by_source"]["local_cache_hit"] == 200
    assert row["hit_rate"] == pytest.approx(300 / 900) and row["engine_hit_rate"] == pytest.approx(200 / 900)
    assert row["kvtier_hit_tokens"] == {"cpu": 60, "disk": 40}
    assert row["kvtier_tier_hit_rate"]["disk"] == pytest.approx(40 / 900)
    assert row["reconciled"] and row["reconcile_difference"] == 0
    assert row["kvtier_load_bytes"] == 1000 and row["kvtier_stored_bytes"] == {"cpu": 6000, "disk": 4000}
    assert row["kvtier_tier_read_bytes"] == {"cpu": 600, "disk": 400} and row["prefill_computed_tokens"] == 600
    off = serve_report.hit_summary(before, metric_samples(700, 200, 100, {"cpu": 60, "disk": 30}))
    assert not off["reconciled"] and off["reconcile_difference"] == -10


def test_tier_errors_are_split_by_tier_and_kind() -> None:
    before = {**metric_samples(0, 0, 0, {}), ("kvtier_tier_errors_total", (("kind", "timeout"), ("tier", "redis"))): 2.0}
    after = {**metric_samples(10, 0, 0, {}), **{("kvtier_tier_errors_total", (("kind", k), ("tier", t))): n
                                          for k, t, n in (("timeout", "redis", 9.0), ("error", "redis", 1.0),
                                                          ("error", "disk", 0.0))}}
    row = serve_report.hit_summary(before, after)
    assert row["kvtier_tier_errors"] == 8
    assert row["kvtier_tier_errors_by_kind"] == {"redis:timeout": 7, "redis:error": 1}  # no zero rows


def test_a_prefix_only_server_has_engine_hits_and_no_kvtier_hits() -> None:
    row = serve_report.hit_summary(metric_samples(0, 0, 0, {}), metric_samples(80, 20, 0, {}))
    assert (row["engine_hit_rate"], row["kvtier_hit_rate"], row["kvtier_hit_tokens"]) == (0.2, 0.0, {})
    assert row["reconciled"]


def reply(i: int, tokens: list[int], ttft: float = 0.1, error: str | None = None) -> Reply:
    return Reply(i, sent_s=float(i), ttft_s=ttft, latency_s=2 * ttft, queued_s=0.0, prompt_tokens=100,
                 tokens=tokens, error=error)


def test_mismatches_count_differing_and_failed_completions() -> None:
    ref = [reply(0, [1, 2]), reply(1, [3, 4]), reply(2, [5])]
    got = [reply(0, [1, 2]), reply(1, [3, 9]), reply(2, [], error="boom")]
    assert serve_report.mismatches(got, ref) == [1, 2]
    assert serve_report.mismatches(ref, ref) == []


def test_latency_quantiles_and_throughput_over_the_replay_span() -> None:
    replies = [reply(i, [7] * 4, ttft=0.01 * (i + 1)) for i in range(100)]
    row = serve_report.latency_summary(replies)
    assert (row["ttft_p50_s"], row["ttft_p90_s"], row["ttft_p99_s"]) == pytest.approx((0.50, 0.90, 0.99))
    assert row["span_s"] == pytest.approx(99 + 2.0)  # last sent at 99 s, 2 s long
    assert row["generated_tokens_per_s"] == pytest.approx(400 / 101)
    assert row["prompt_tokens"] == 10_000 and row["errors"] == 0


def test_ratios_are_to_the_prefix_mode() -> None:
    modes = {"prefix": {"ttft_p50_s": 0.2, "ttft_p90_s": 0.4, "e2e_p50_s": 1.0, "generated_tokens_per_s": 10.0,
                        "prompt_tokens_per_s": 100.0},
             "kvtier_cpu": {"ttft_p50_s": 0.1, "ttft_p90_s": 0.4, "e2e_p50_s": 0.5, "generated_tokens_per_s": 15.0,
                            "prompt_tokens_per_s": 0.0}}
    serve_report.add_ratios(modes)
    assert modes["kvtier_cpu"]["vs_prefix"]["ttft_p50_s"] == 0.5
    assert modes["kvtier_cpu"]["vs_prefix"]["generated_tokens_per_s"] == 1.5
    assert modes["prefix"]["vs_prefix"]["e2e_p50_s"] == 1.0


def test_simulation_predicts_more_hits_with_a_kvtier_tier_and_flags_a_gap(tmp_path: Path) -> None:
    requests = scale(write_rows(synthetic_rows(), tmp_path / "s.jsonl"), 24, Scaling())
    workload = hit_workload(requests, 32)
    sim = serve_report.simulate(workload, 8, {"prefix": [], "kvtier_cpu_disk": [20, 10_000],
                                              "kvtier_no_prefix": [20]},
                                {"prefix": True, "kvtier_cpu_disk": True, "kvtier_no_prefix": False})
    assert sim["prefix"]["kvtier_hit_rate"] == 0.0
    assert sim["kvtier_cpu_disk"]["hit_rate"] > sim["prefix"]["hit_rate"]
    assert sim["kvtier_cpu_disk"]["kvtier_hit_rate"] > 0.3  # the disk tier holds every turn's history
    assert sim["kvtier_no_prefix"]["engine_hit_rate"] == 0.0
    measured = {"kvtier_cpu_disk": {"kvtier_hit_rate": sim["kvtier_cpu_disk"]["kvtier_hit_rate"] - 0.05,
                                    "hit_rate": sim["kvtier_cpu_disk"]["hit_rate"],
                                    "engine_hit_rate": sim["kvtier_cpu_disk"]["engine_hit_rate"]}}
    cmp = serve_report.compare(measured, sim)
    assert list(cmp) == ["kvtier_cpu_disk"]
    assert cmp["kvtier_cpu_disk"]["kvtier_gap_points"] == pytest.approx(-5.0) and cmp["kvtier_cpu_disk"]["flagged"]


def test_blocks_no_earlier_request_has_prefilled_yet_are_counted_as_lost_to_concurrency() -> None:
    reqs = [ServeRequest(0.0, [5] * 97, 1, (0, 1, 2, 3)) for _ in range(3)] + [ServeRequest(0.0, [6] * 64, 1, (9, 8))]
    workload = hit_workload(reqs, 32)  # 3 full blocks of each 97-token prompt can hit
    replies = [Reply(0, sent_s=0.0, ttft_s=1.0, latency_s=2.0, queued_s=0.0, prompt_tokens=97),
               Reply(1, sent_s=0.5, ttft_s=1.0, latency_s=2.0, queued_s=0.0, prompt_tokens=97),  # 0 not prefilled
               Reply(2, sent_s=1.5, ttft_s=1.0, latency_s=2.0, queued_s=0.0, prompt_tokens=97),  # 0 prefilled
               Reply(3, sent_s=0.1, ttft_s=1.0, latency_s=2.0, queued_s=0.0, prompt_tokens=64)]  # nothing shared
    assert serve_report.in_flight_share(workload, replies) == pytest.approx(96 / (3 * 97 + 64))
    spaced = [Reply(i, sent_s=3.0 * i, ttft_s=1.0, latency_s=2.0, queued_s=0.0, prompt_tokens=97) for i in range(3)]
    assert serve_report.in_flight_share(hit_workload(reqs[:3], 32), spaced) == 0.0


def test_a_gap_is_explained_with_the_measured_size_of_each_cause() -> None:
    row = {"engine_hit_rate": 0.10, "hit_rate": 0.20, "kvtier_hit_rate": 0.10, "kvtier_store_failures": {"error": 2},
           "kvtier_load_failures": 1}
    sim = {"engine_hit_rate": 0.05, "hit_rate": 0.30, "kvtier_hit_rate": 0.25}
    [cmp] = serve_report.compare({"m": row}, {"m": sim}, {"m": 0.04}).values()
    assert cmp["flagged"] and cmp["kvtier_gap_points"] == pytest.approx(-15.0)
    assert cmp["in_flight_points"] == pytest.approx(4.0)
    text = " | ".join(cmp["explanation"])
    assert "hit 10.0% against 5.0% for an LRU of its size (+5.0 points)" in text
    assert "concurrency: 4.0 points" in text and "3 chunks not stored or not loaded" in text
    assert "unexplained" not in text
    [bare] = serve_report.compare({"m": {**row, "engine_hit_rate": 0.05, "kvtier_store_failures": {},
                                         "kvtier_load_failures": 0}}, {"m": sim}).values()
    assert bare["flagged"] and bare["explanation"] == ["none of the causes measured here (the engine cache in front, "
                                                       "prefills in flight, failures): unexplained"]
    close = serve_report.compare({"m": {**row, "kvtier_hit_rate": 0.24, "hit_rate": 0.29}}, {"m": sim})
    assert not close["m"]["flagged"] and close["m"]["explanation"] == []


def test_bytes_saved_per_byte_loaded_and_the_admissions_decisions_come_from_the_servers_counters() -> None:
    admission = serve_report.ADMISSION
    before = {**metric_samples(0, 0, 0, {}), (admission, (("decision", "admitted"),)): 5.0}
    after = {**metric_samples(70, 0, 30, {"cpu": 30}), (admission, (("decision", "admitted"),)): 45.0,
             (admission, (("decision", "declined"),)): 60.0}
    row = serve_report.mode_summary([reply(0, [1])], before, after, None)
    assert row["kvtier_admission_chunks"] == {"admitted": 40, "declined": 60}
    assert row["saved_per_loaded"] == pytest.approx(3000 / 300)  # stored 100 B per hit token, loaded 10 B
    assert serve_report.mode_summary([reply(0, [1])], before, metric_samples(70, 30, 0, {}), None)[
        "saved_per_loaded"] is None  # nothing loaded: no ratio
    point = {"memory": 0.25, "engine_blocks": 8, "modes": {"kvtier_cpu_learned": {**row, "vs_prefix": {}}}}
    assert "10.0x" in serve_report.table(point)
