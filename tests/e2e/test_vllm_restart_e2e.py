"""A restart keeps what the cache held: a real ``vllm`` OpenAI server (vLLM's CPU build, the tiny Llama, vLLM's
prefix cache on as deployed) with kvtier cpu + disk under write-back, the cpu tier large enough that nothing is
demoted. Three prompts share a 160-token prefix. The server is stopped with SIGTERM and a new one starts on the same
disk directory: the same prompts hit from disk (``vllm:prompt_tokens_cached_by_source{source="disk"}``) with the
first server's outputs. Before persisting, the disk was empty at the stop (every chunk lived in cpu only) and the new
server hit nothing.

Three ways the chunks reach disk, one test each:

* the stop itself, with ``--shutdown-timeout 10``: vLLM then lets its worker run the connector's shutdown, which
  copies what only cpu holds (``policy.persist_at_close``). With vLLM's default ``--shutdown-timeout 0`` the API
  server kills the engine processes at once and nothing at the stop can run;
* the engine going idle (``policy.persist_after_idle``), with vLLM's default stop (an immediate kill, as a crash);
* the engine under continuous load, never idle (``policy.persist_max_lag``), with vLLM's default stop.

Expected disk hits in the new server: the first prompt loads its 3 chunks (192 tokens, vLLM's cache is empty); the
next two hold the 160-token prefix in vLLM's own cache, which ends inside chunk 2, and load that chunk's other 32
tokens each: 256. kvtier's ``kvtier_hit_tokens_total`` counts the same 256 as vLLM's ``external_kv_transfer``.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import engine_env

from kvtier.bench.redis_servers import free_port
from kvtier.ops.vllm_server import Server, ServerSpec, kvtier_transfer, metric, metric_sum, running

CHUNK, BLOCK = 64, 32
SHARED = 160  # 5 blocks, 2.5 chunks
RECORDS = 5  # the first prompt's 3 chunks, and the third chunk of each other prompt
DISK_HITS = 3 * CHUNK + 2 * (3 * CHUNK - SHARED)


def prompts() -> list[list[int]]:
    rng = random.Random(31)
    shared = [rng.randrange(3, 1000) for _ in range(SHARED)]
    return [shared + [rng.randrange(3, 1000) for _ in range(72)] for _ in range(3)]


def spec(model: str, work: Path, policy: str, extra: tuple[str, ...] = ()) -> ServerSpec:
    config = work / "kvtier.yaml"
    config.write_text(f"chunk_size: {CHUNK}\npolicy: {policy}\ntiers:\n"
                      "  - {name: cpu, kind: cpu, capacity: 64MiB}\n"
                      f"  - {{name: disk, kind: disk, capacity: 64MiB, path: {work / 'disk'}}}\n")
    return ServerSpec(model, free_port(), block_size=BLOCK, max_model_len=1024, max_num_seqs=4,
                      transfer=kvtier_transfer(str(config)), extra_args=extra, env=engine_env(work))


def records(work: Path) -> int:
    return len(list((work / "disk").rglob("*.kvt")))


def complete_all(server: Server) -> list[list[int]]:
    return [server.complete(p, max_tokens=6) for p in prompts()]


def second_server(model: str, work: Path, policy: str, first: list[list[int]], name: str) -> None:
    """A new server on the same directory: the same prompts hit from disk with the first server's outputs."""
    with running(spec(model, work, policy), work / f"{name}.log") as server:
        m0 = server.metrics()
        again = complete_all(server)
        m1 = server.metrics()
    disk = metric(m1, "vllm:prompt_tokens_cached_by_source_total", source="disk") - metric(
        m0, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    transferred = metric(m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - metric(
        m0, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    hit_tokens = metric_sum(m1, "kvtier_hit_tokens_total") - metric_sum(m0, "kvtier_hit_tokens_total")
    assert (disk, transferred, hit_tokens) == (DISK_HITS, DISK_HITS, DISK_HITS)
    assert metric_sum(m1, "kvtier_load_failures_total") == 0
    assert again == first


def test_a_graceful_stop_persists_the_cpu_tier_and_a_new_server_hits_it_from_disk(
        models: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No persisting while running (``persist_after_idle: 0``, ``persist_max_lag: 0``); the stop right after the last completion copies the 5
    chunks cpu alone held (the disk had none before the stop)."""
    model, _ = models("llama")
    work = tmp_path_factory.mktemp("restart-close")
    policy = "{persist_after_idle: 0, persist_max_lag: 0, persist_at_close: 4s}"
    with running(spec(model, work, policy, ("--shutdown-timeout", "10")), work / "first.log") as server:
        first = complete_all(server)
        assert records(work) == 0  # write-back: in cpu only
        stopping = time.monotonic()
    stopped = time.monotonic() - stopping
    print(f"stop with --shutdown-timeout 10: {stopped:.2f}s from SIGTERM to exit, {records(work)} records on disk")
    assert records(work) == RECORDS
    second_server(model, work, policy, first, "second")


def test_an_idle_engine_persists_the_cpu_tier_before_an_immediate_kill(
        models: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's default stop (``--shutdown-timeout 0``: the engine processes are killed at once, no shutdown hook
    runs); the chunks are on disk within ``persist_after_idle`` (0.5 s) + 1 s of the last completion."""
    model, _ = models("llama")
    work = tmp_path_factory.mktemp("restart-idle")
    policy = "{persist_after_idle: 500ms, persist_max_lag: 0, persist_at_close: 0}"
    with running(spec(model, work, policy), work / "first.log") as server:
        first = complete_all(server)
        idle = time.monotonic()
        while records(work) < RECORDS and time.monotonic() - idle < 15:
            time.sleep(0.02)
        took = time.monotonic() - idle
    print(f"{records(work)} records on disk {took:.2f}s after the last completion (persist_after_idle 0.5s)")
    assert records(work) == RECORDS and took < 0.5 + 1.0
    second_server(model, work, policy, first, "second")


LOAD_PROMPTS, LOAD_CLIENTS, LOAD_S = 8, 4, 10.0


def load_prompts() -> list[list[int]]:
    """8 prompts of 232 tokens, no prefix shared: each has 3 full chunks (192 tokens) to save."""
    rng = random.Random(47)
    return [[rng.randrange(3, 1000) for _ in range(3 * CHUNK + 40)] for _ in range(LOAD_PROMPTS)]


def steady_load(server: Server, prompts: list[list[int]], seconds: float) -> dict[int, list[int]]:
    """4 clients send the prompts back to back, in turn, for ``seconds``; the last answer to each prompt."""
    last: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    end = time.monotonic() + seconds

    def client(c: int) -> None:
        i = c
        try:
            while time.monotonic() < end:
                last[i % len(prompts)] = server.complete(prompts[i % len(prompts)], max_tokens=6)
                i += 1
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(LOAD_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return last


def test_under_continuous_load_a_killed_server_leaves_its_prefixes_on_disk(
        models: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    """kvtier's defaults (``persist_after_idle`` 1 s, ``persist_max_lag`` 2 s). 4 clients keep the engine busy for
    10 s with 8 prompts (each sent about 20 times: its later answers come from vLLM's prefix cache); the server is
    stopped the moment the load ends, with vLLM's default stop (the engine killed at once, never idle for 1 s).
    A new server on the same directory hits every prompt's 3 chunks from disk, with the first server's cached
    answers. Before ``persist_max_lag``, the copies waited for an idle second that never came: 0 tokens from
    disk."""
    model, _ = models("llama")
    work = tmp_path_factory.mktemp("restart-load")
    prompts = load_prompts()
    with running(spec(model, work, "{write: write_back}"), work / "first.log") as server:
        cached = steady_load(server, prompts, LOAD_S)
        on_disk = records(work)
    print(f"{on_disk} records on disk when the load ended and the server was stopped")
    assert sorted(cached) == list(range(LOAD_PROMPTS))
    with running(spec(model, work, "{write: write_back}"), work / "second.log") as server:
        m0 = server.metrics()
        again = {i: server.complete(p, max_tokens=6) for i, p in enumerate(prompts)}
        m1 = server.metrics()
    disk = metric(m1, "vllm:prompt_tokens_cached_by_source_total", source="disk") - metric(
        m0, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    assert disk == LOAD_PROMPTS * 3 * CHUNK
    assert metric_sum(m1, "kvtier_load_failures_total") == 0
    assert again == cached
