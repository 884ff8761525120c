"""``kvtier bench serve`` without vLLM: the trace's scaling, the hit accounting and its reconciliation, the
output comparison, the simulation, the streaming clients (against a loopback SSE server), the report files, and
the command line's errors for a missing trace and a missing vLLM CPU build."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import serve, serve_client, serve_report
from kvtier.bench.serve_client import Reply
from kvtier.bench.serve_trace import (
    Scaling,
    ServeRequest,
    block_token_ids,
    hit_workload,
    scale,
    synthetic_rows,
    write_rows,
)

SRC = "vllm:prompt_tokens_by_source_total"


def _rows(tmp_path: Path) -> Path:
    rows = [{"timestamp": 0, "input_length": 2000, "output_length": 300, "hash_ids": [0, 1, 2, 3]},
            {"timestamp": 2000, "input_length": 3000, "output_length": 5, "hash_ids": [0, 1, 2, 3, 4, 5]},
            {"timestamp": 3000, "input_length": 100_000, "output_length": 9000, "hash_ids": list(range(10, 206))}]
    return write_rows(rows, tmp_path / "trace.jsonl")


def test_scaling_maps_each_hash_block_to_the_same_tokens_and_caps_prompts_outputs_and_times(tmp_path: Path) -> None:
    got = scale(_rows(tmp_path), 3, Scaling(block_tokens=32, max_prompt=320, max_output=16, time_scale=0.5))
    assert [len(r.prompt) for r in got] == [125, 188, 320]  # ceil(2000 * 32 / 512), ceil(3000 / 16), the cap
    assert got[1].prompt[:125] == got[0].prompt  # blocks 0-3 shared: the same 128 tokens, cut at 125
    assert got[2].prompt[:32] != got[0].prompt[:32]
    assert [r.max_tokens for r in got] == [16, 1, 16]  # 300 * 32 / 512 = 18.75 -> capped; 5 -> 1
    assert [r.arrival_s for r in got] == [0.0, 1.0, 1.5]
    assert [len(r.hash_ids) for r in got] == [4, 6, 10]  # the blocks the capped prompt covers
    paced = scale(_rows(tmp_path), 3, Scaling(rate=4.0))
    assert [r.arrival_s for r in paced] == [0.0, 0.25, 0.5]


def test_a_hash_block_maps_to_the_same_run_of_tokens_in_every_run_and_request(tmp_path: Path) -> None:
    assert block_token_ids(7, 32) == block_token_ids(7, 32) and len(block_token_ids(7, 16)) == 16
    assert block_token_ids(7, 16) == block_token_ids(7, 32)[:16]  # the length only cuts the same run
    assert block_token_ids(7, 32) != block_token_ids(8, 32)
    assert all(3 <= t < 1000 for t in block_token_ids(123_456, 64))  # never a warm-up token (1000 and above)
    first, again = scale(_rows(tmp_path), 3, Scaling()), scale(_rows(tmp_path), 3, Scaling())
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert first[0].prompt[32:64] == block_token_ids(1, 32)  # the second block of request 0 is hash id 1
    wide = scale(_rows(tmp_path), 1, Scaling(block_tokens=64))
    assert len(wide[0].prompt) == 250 and wide[0].prompt[64:128] == block_token_ids(1, 64)


def test_sampling_conversations_keeps_each_chosen_conversation_whole_and_stable(tmp_path: Path) -> None:
    rows = []
    for turn in range(3):  # 40 conversations of 3 turns; conversation c's second block is 1000 + c
        for conv in range(40):
            rows.append({"timestamp": (turn * 40 + conv) * 100, "input_length": 512 * (2 + turn),
                         "output_length": 8, "hash_ids": [0, 1000 + conv] + [5000 + 10 * conv + t for t in range(turn)]})
    path = write_rows(rows, tmp_path / "conversations.jsonl")
    every = scale(path, 1000, Scaling())
    kept = scale(path, 1000, Scaling(sessions=4))
    assert len(every) == 120
    conversations = {r.hash_ids[1] for r in kept}
    assert 0 < len(conversations) < 40  # some conversations, not all
    assert len(kept) == 3 * len(conversations)  # each kept one with all of its turns
    assert [r.hash_ids[1] for r in kept] == [r.hash_ids[1] for r in every if r.hash_ids[1] in conversations]
    assert kept[0].arrival_s == 0.0  # times count from the first kept request
    assert [r.prompt for r in scale(path, 1000, Scaling(sessions=4))] == [r.prompt for r in kept]  # the same set
    assert len(scale(path, 5, Scaling(sessions=4))) == 5  # --requests counts kept requests
    assert "one conversation in 4" in Scaling(sessions=4).describe()
    one = write_rows(rows[:1], tmp_path / "one.jsonl")  # conversation 1000 only
    kept_none = next(n for n in range(2, 50) if zlib.crc32(b"0,1000") % n)
    with pytest.raises(ValueError, match=f"conversations --sessions {kept_none} keeps"):
        scale(one, 10, Scaling(sessions=kept_none))


def test_a_trace_line_without_input_length_or_a_trace_without_requests_is_a_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n{"timestamp": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a Mooncake trace line"):
        scale(bad, 5, Scaling())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        scale(empty, 5, Scaling())


def test_synthetic_turns_extend_their_conversation_and_interleave() -> None:
    rows = synthetic_rows(conversations=3, turns=2, first_blocks=2, new_blocks=1, gap_ms=100)
    assert [r["timestamp"] for r in rows] == [0, 100, 200, 300, 400, 500]
    assert rows[0]["hash_ids"] == [0, 1, 2] and rows[3]["hash_ids"] == [0, 1, 2, 7]
    assert rows[4]["hash_ids"][:-1] == rows[1]["hash_ids"]
    assert len({h for r in rows for h in r["hash_ids"]}) == 1 + 3 * 2 + 3


def test_the_simulated_workload_holds_only_blocks_the_engine_can_hit() -> None:
    reqs = [ServeRequest(0.0, [5] * 64, 1, (0, 1)), ServeRequest(0.0, [5] * 65, 1, (0, 1, 2))]
    workload = hit_workload(reqs, 32)
    assert [r.chunks for r in workload.requests] == [(0,), (0, 1)]  # the last token is always computed
    assert [r.input_len for r in workload.requests] == [64, 65]


def _samples(compute: float, local: float, external: float, tiers: dict[str, float]) -> dict[Any, float]:
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
    before = _samples(100, 0, 0, {"cpu": 0, "disk": 0})
    after = _samples(700, 200, 100, {"cpu": 60, "disk": 40})
    row = serve_report.hit_summary(before, after)
    assert row["prompt_tokens"] == 900 and row["tokens_by_source"]["local_cache_hit"] == 200
    assert row["hit_rate"] == pytest.approx(300 / 900) and row["engine_hit_rate"] == pytest.approx(200 / 900)
    assert row["kvtier_hit_tokens"] == {"cpu": 60, "disk": 40}
    assert row["kvtier_tier_hit_rate"]["disk"] == pytest.approx(40 / 900)
    assert row["reconciled"] and row["reconcile_difference"] == 0
    assert row["kvtier_load_bytes"] == 1000 and row["kvtier_stored_bytes"] == {"cpu": 6000, "disk": 4000}
    assert row["kvtier_tier_read_bytes"] == {"cpu": 600, "disk": 400} and row["prefill_computed_tokens"] == 600
    off = serve_report.hit_summary(before, _samples(700, 200, 100, {"cpu": 60, "disk": 30}))
    assert not off["reconciled"] and off["reconcile_difference"] == -10


def test_tier_errors_are_split_by_tier_and_kind() -> None:
    before = {**_samples(0, 0, 0, {}), ("kvtier_tier_errors_total", (("kind", "timeout"), ("tier", "redis"))): 2.0}
    after = {**_samples(10, 0, 0, {}), **{("kvtier_tier_errors_total", (("kind", k), ("tier", t))): n
                                          for k, t, n in (("timeout", "redis", 9.0), ("error", "redis", 1.0),
                                                          ("error", "disk", 0.0))}}
    row = serve_report.hit_summary(before, after)
    assert row["kvtier_tier_errors"] == 8
    assert row["kvtier_tier_errors_by_kind"] == {"redis:timeout": 7, "redis:error": 1}  # no zero rows


def test_a_prefix_only_server_has_engine_hits_and_no_kvtier_hits() -> None:
    row = serve_report.hit_summary(_samples(0, 0, 0, {}), _samples(80, 20, 0, {}))
    assert (row["engine_hit_rate"], row["kvtier_hit_rate"], row["kvtier_hit_tokens"]) == (0.2, 0.0, {})
    assert row["reconciled"]


def _reply(i: int, tokens: list[int], ttft: float = 0.1, error: str | None = None) -> Reply:
    return Reply(i, sent_s=float(i), ttft_s=ttft, latency_s=2 * ttft, queued_s=0.0, prompt_tokens=100,
                 tokens=tokens, error=error)


def test_mismatches_count_differing_and_failed_completions() -> None:
    ref = [_reply(0, [1, 2]), _reply(1, [3, 4]), _reply(2, [5])]
    got = [_reply(0, [1, 2]), _reply(1, [3, 9]), _reply(2, [], error="boom")]
    assert serve_report.mismatches(got, ref) == [1, 2]
    assert serve_report.mismatches(ref, ref) == []


def test_latency_quantiles_and_throughput_over_the_replay_span() -> None:
    replies = [_reply(i, [7] * 4, ttft=0.01 * (i + 1)) for i in range(100)]
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


class _Stream(BaseHTTPRequestHandler):
    """vLLM's streamed completion in miniature: each prompt token id + 1, one token per chunk, then usage."""

    in_flight = 0
    most = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _Stream.lock:
            _Stream.in_flight += 1
            _Stream.most = max(_Stream.most, _Stream.in_flight)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for tok in body["prompt"][: body["max_tokens"]]:
            time.sleep(0.02)
            self.wfile.write(f"data: {json.dumps({'choices': [{'token_ids': [tok + 1]}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"usage": {"prompt_tokens": len(body["prompt"]), "prompt_tokens_details": {"cached_tokens": 3}}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        with _Stream.lock:
            _Stream.in_flight -= 1

    def log_message(self, *args: Any) -> None:
        del args


@pytest.fixture
def sse_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_clients_stream_in_arrival_order_with_bounded_concurrency(sse_port: int) -> None:
    requests = [ServeRequest(0.05 * i, [10 * i, 10 * i + 1, 10 * i + 2], 3, ()) for i in range(8)]
    done: list[int] = []
    replies = serve_client.replay("127.0.0.1", sse_port, "m", requests, 2, done.append)
    assert [r.tokens for r in replies] == [[10 * i + 1, 10 * i + 2, 10 * i + 3] for i in range(8)]
    assert all(r.error is None and 0 < r.ttft_s < r.latency_s and r.cached_tokens == 3 for r in replies)
    assert [r.sent_s for r in replies] == sorted(r.sent_s for r in replies)
    assert replies[4].sent_s >= 0.2 - 0.01  # not before its arrival
    assert _Stream.most <= 2 and sum(done) == 8


def test_a_refused_connection_is_a_failed_reply_not_an_exception() -> None:
    from kvtier.bench.redis_servers import free_port

    [reply] = serve_client.replay("127.0.0.1", free_port(), "m", [ServeRequest(0.0, [1], 1, ())], 1)
    assert reply.error is not None and reply.tokens == []


def _doc(mismatch: int) -> dict[str, Any]:
    row = {**serve_report.latency_summary([_reply(0, [1]), _reply(1, [2], ttft=0.3)]),
           **serve_report.hit_summary(_samples(0, 0, 0, {}), _samples(60, 20, 20, {"cpu": 20}))}
    modes = {"prefix": {**row, "mismatches": 0}, "kvtier_cpu": {**row, "mismatches": mismatch}}
    serve_report.add_ratios(modes)
    point = {"memory": 0.1, "engine_blocks": 12, "reference_mode": "none", "modes": modes, "simulation": {},
             "ttft_s": {"prefix": [0.1, 0.3], "kvtier_cpu": [0.1, 0.3]}}
    settings = {"requests": 2, "trace_name": "t", "concurrency": 2, "working_set_tokens": 640, "model": "m",
                "scaling_text": Scaling().describe()}
    return {"settings": settings, "points": [point], "raw": {}}


def test_report_prints_the_scaling_and_table_and_writes_json_and_png(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    args = argparse.Namespace(quick=True, out=tmp_path, json=None, png=None, no_plot=False)
    assert serve.report(args, _doc(0)) == 0
    out = capsys.readouterr().out
    assert "each 512-token hash block -> 32 tokens" in out and "engine KV memory 10%" in out
    assert "kvtier_cpu" in out and "cpu 20.0" in out
    data = json.loads((tmp_path / "vllm_serve-quick.json").read_text())
    assert data["checks"] == {"passed": True, "failures": []}
    assert (tmp_path / "vllm_serve-quick.png").stat().st_size > 1000


def test_report_fails_the_run_when_a_completion_differs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(quick=False, out=tmp_path, json=None, png=None, no_plot=True)
    assert serve.report(args, _doc(3)) == 1
    assert "kvtier_cpu at 10%: 3 completions differ from none's" in capsys.readouterr().err
    assert json.loads((tmp_path / "vllm_serve.json").read_text())["checks"]["passed"] is False


def test_report_fails_the_run_when_the_servers_computed_on_different_cores(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's CPU build reserves one more core when a KV connector is set: servers that computed on other cores
    are no fair comparison, so the run fails and says on which cores each one computed."""
    args = argparse.Namespace(quick=False, out=tmp_path, json=None, png=None, no_plot=True)
    doc = _doc(0)
    doc["points"][0]["modes"]["prefix"]["worker_cores"] = [0]
    doc["points"][0]["modes"]["kvtier_cpu"]["worker_cores"] = [0, 1]
    assert serve.report(args, doc) == 1
    assert "compute ran on different cores: {'prefix': [0], 'kvtier_cpu': [0, 1]}" in capsys.readouterr().err
    doc["points"][0]["modes"]["kvtier_cpu"]["worker_cores"] = [0]
    assert serve.report(args, doc) == 0


def test_servers_reserve_the_same_core_with_or_without_a_connector_and_say_where_they_computed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.bench import vllm_server
    from kvtier.bench.vllm_server import Server, ServerSpec, kvtier_transfer, running

    started: list[dict[str, str]] = []

    class Exited:
        returncode = 1

        def __init__(self, cmd: list[str], env: dict[str, str], **_: Any) -> None:
            started.append(env)

        def poll(self) -> int:
            return 1

        def terminate(self) -> None: ...

        def wait(self, timeout: float | None = None) -> int:
            return 1

    monkeypatch.setattr(vllm_server.subprocess, "Popen", Exited)
    for spec in (ServerSpec("m", 1), ServerSpec("m", 1, transfer=kvtier_transfer("k.yaml")),
                 ServerSpec("m", 1, env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})):
        with pytest.raises(RuntimeError, match="exited"), running(spec, tmp_path / "x.log"):
            pass  # pragma: no cover
    assert [env["VLLM_CPU_NUM_OF_RESERVED_CPU"] for env in started] == ["1", "1", "0"]
    log = tmp_path / "server.log"
    log.write_text("INFO [ompmultiprocessing.py:185] \tlocal_world_size=1, reserve_cpu_num=1\n"
                   "INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 2]\n")
    server = Server(ServerSpec("m", 1), None, log)  # type: ignore[arg-type]
    assert server.worker_cores() == [0, 2]
    log.write_text("no binding here\n")
    assert server.worker_cores() is None


def test_plan_point_gives_the_engine_a_share_of_the_working_set_but_one_request_at_least() -> None:
    settings = {"max_model_len": 480, "kv_bytes_per_token": 1000, "tier_memory": 4.0}
    assert serve.plan_point(0.25, 3200, settings)["engine_blocks"] == 25
    small = serve.plan_point(0.01, 3200, settings)
    assert small["engine_blocks"] == 15 and small["cpu_tier_bytes"] == 15 * 32 * 1000 * 4


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", "bench", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_missing_trace_is_one_line_saying_where_to_get_it(tmp_path: Path) -> None:
    proc = _cli("--trace", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "nope.jsonl not found" in proc.stderr and "traces/README.md" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--memory", "0.1,2"), "argument --memory: expected a comma list of shares in (0, 1], got '0.1,2'"),
    (("--modes", "prefix,lmcache"), "argument --modes: unknown lmcache"),
    (("--requests", "0"), "argument --requests: expected an integer >= 1, got '0'"),
    (("--block-tokens", "x"), "argument --block-tokens"),
])
def test_a_bad_option_is_one_line_and_exit_code_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = _cli(*args, "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kvtier: error: ") and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_malformed_or_empty_trace_is_one_line_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1]}\n')
    proc = _cli("--trace", str(bad), "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot read the trace" in proc.stderr and "bad.jsonl:1: not a Mooncake trace line" in proc.stderr
    (tmp_path / "empty.jsonl").write_text("")
    proc = _cli("--trace", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no requests" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("*.json")), "a failed run writes no result file"


def test_without_vllms_cpu_build_it_names_venv_e2e(tmp_path: Path) -> None:
    from kvtier.bench.vllm_proc import cpu_build_problem

    if cpu_build_problem() is None:
        pytest.skip("this interpreter has vLLM's CPU build")
    proc = _cli("--quick", "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kvtier: error: kvtier bench serve needs vLLM's CPU build") and ".venv-e2e" in proc.stderr
