"""``kvtier bench serve`` without vLLM: the trace's scaling, the streaming clients (against a loopback SSE server),
the report files and the run's checks, the servers' CPU layout, and the command line's errors for a missing trace and a
missing vLLM CPU build (the report's accounting and simulation: test_serve_report.py)."""

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
from test_serve_report import metric_samples, reply

from kvtier.bench import serve, serve_client, serve_report
from kvtier.bench.serve_trace import (
    Scaling,
    ServeRequest,
    block_token_ids,
    hit_workload,
    scale,
    synthetic_rows,
    write_rows,
)


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
    row = {**serve_report.latency_summary([reply(0, [1]), reply(1, [2], ttft=0.3)]),
           **serve_report.hit_summary(metric_samples(0, 0, 0, {}), metric_samples(60, 20, 20, {"cpu": 20}))}
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
    from kvtier.ops import vllm_server
    from kvtier.ops.vllm_server import Server, ServerSpec, kvtier_transfer, running

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
    from kvtier.bench.vllm_driver import cpu_build_problem

    if cpu_build_problem() is None:
        pytest.skip("this interpreter has vLLM's CPU build")
    proc = _cli("--quick", "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kvtier: error: kvtier bench serve needs vLLM's CPU build") and ".venv-e2e" in proc.stderr


def test_the_learned_mode_saves_by_the_admission_and_the_other_kvtier_modes_save_every_chunk(tmp_path: Path) -> None:
    from kvtier.config import load_config

    admissions = {}
    for mode in ("kvtier_cpu", "kvtier_cpu_disk", "kvtier_cpu_learned"):
        path = serve.kvtier_config(mode, tmp_path, 64 << 20, 128 << 20, None)
        assert path is not None
        admissions[mode] = load_config(path).policy.admission
    assert admissions == {"kvtier_cpu": "all", "kvtier_cpu_disk": "all", "kvtier_cpu_learned": "learned"}
    assert serve.kvtier_config("prefix", tmp_path, 64 << 20, 128 << 20, None) is None
