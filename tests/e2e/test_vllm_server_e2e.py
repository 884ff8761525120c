"""kvtier in a real ``vllm`` OpenAI server (vLLM's CPU build): its start in the server's log, its metrics in the
server's own ``/metrics`` and its KV events on vLLM's ZMQ stream (``--kv-events-config``).

One server for the module: the tiny Llama, vLLM's prefix cache off (so every hit is kvtier's), kvtier with a cpu
tier of two chunks in front of a disk tier (write-back: what cpu evicts is demoted to disk). The test binds the
SUB socket on a loopback port and vLLM's publisher connects to it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import engine_env

from kvtier import __version__
from kvtier.bench.redis_servers import free_port
from kvtier.ops.vllm_server import Samples, Server, ServerSpec, kvtier_transfer, metric, running

CHUNK = 32
CHUNK_BYTES = 4 * 2 * 2 * 64 * 4 * CHUNK  # tiny Llama: 4 layers, K/V, 2 heads of 64, float32


class Events:
    """vLLM's KV events as they arrive (a thread reading a bound SUB socket)."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.bind(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.received: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                self.received.extend(self._decoder.decode(self._socket.recv_multipart()[-1]).events)

    def kvtier(self) -> list[tuple[str, str, tuple[Any, ...]]]:
        return [(type(e).__name__, e.ownership, tuple(e.block_hashes)) for e in list(self.received)
                if (getattr(e, "ownership", None) or "").startswith("kvtier:")]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)


@pytest.fixture(scope="module")
def server(models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("server")
    config = work / "kvtier.yaml"
    # no copies to disk while running (the demotion's lifecycle below; persisting: test_vllm_restart_e2e.py)
    config.write_text(f"chunk_size: {CHUNK}\nserve_without_prefix_caching: true\n"
                      "policy: {persist_after_idle: 0, persist_max_lag: 0}\n"
                      "tiers:\n"
                      f"  - {{name: cpu, kind: cpu, capacity: {2 * CHUNK_BYTES}B}}\n"
                      f"  - {{name: disk, kind: disk, capacity: 64MiB, path: {work / 'disk'}}}\n")
    model, _ = models("llama")
    events_port = free_port()
    events = Events(events_port)
    spec = ServerSpec(model, free_port(), block_size=CHUNK, max_model_len=1024, max_num_seqs=4, prefix_caching=False,
                      transfer=kvtier_transfer(str(config)), events_endpoint=f"tcp://127.0.0.1:{events_port}",
                      env=engine_env(work))
    try:
        with running(spec, work / "server.log") as server:
            server.events = events  # type: ignore[attr-defined]
            yield server
    finally:
        events.close()


def events_of(server: Server) -> Events:
    return server.events  # type: ignore[attr-defined,no-any-return]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_kvtier_says_in_the_servers_log_that_it_started_with_which_tiers(server: Server) -> None:
    """kvtier's INFO lines go through vLLM's handlers: one block with kvtier's version, its tiers and capacities,
    how it writes and persists, and vLLM's load-failure policy (kvtier set it to recompute); and the identity its
    records are tied to (before, none of kvtier's INFO lines reached the log)."""
    text = server.log.read_text(errors="replace")
    start = [line for line in text.splitlines() if f"kvtier {__version__}: tiers " in line]
    assert len(start) == 1, text[-4000:]
    assert f"cpu (cpu, {2 * CHUNK_BYTES // 1024} KiB), disk (disk, 64 MiB, " in start[0]
    assert "write_back" in start[0] and "kv_load_failure_policy recompute" in start[0]
    assert " INFO " in start[0]  # vLLM's format
    assert "kvtier records are tied to" in text


def test_metrics_show_kvtiers_hits_by_tier_equal_to_the_tokens_the_engine_did_not_compute(server: Server) -> None:
    """A 200-token prompt twice: the first is computed whole (the engine counts 200 computed) and saves 6 chunks
    (2 in cpu, 4 demoted or placed on disk); the second computes 8 and loads 192 from kvtier, with the same tokens.
    kvtier's hit tokens by tier sum to the engine's own count of transferred tokens."""
    p = prompt(11, 200)
    m0 = server.metrics()
    first = server.complete(p)
    m1 = server.metrics()
    assert delta(m1, m0, "vllm:prompt_tokens_by_source_total", source="local_compute") == 200  # truly uncached
    time.sleep(1.0)  # saves are written in the background
    second = server.complete(p)
    m2 = server.metrics()
    transferred = delta(m2, m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert transferred == 192 and delta(m2, m1, "vllm:prompt_tokens_by_source_total", source="local_compute") == 8
    by_tier = {tier: delta(m2, m1, "kvtier_hit_tokens_total", group="0", tier=tier) for tier in ("cpu", "disk")}
    assert sum(by_tier.values()) == transferred and by_tier["disk"] > 0, by_tier
    assert second == first
    assert delta(m2, m0, "kvtier_stored_chunks_total", tier="disk") >= 4
    assert m2[("kvtier_capacity_bytes", (("rank", "0"), ("tier", "cpu")))] == 2 * CHUNK_BYTES
    assert m2[("kvtier_used_bytes", (("rank", "0"), ("tier", "disk")))] > 0
    assert delta(m2, m1, "kvtier_load_failures_total") == 0


def test_a_chunk_evicted_from_cpu_is_published_stored_then_removed(server: Server) -> None:
    """Prompt A's chunks enter cpu; prompt B's evict them (demoted to disk): the ZMQ stream shows, for one of A's
    chunks, BlockStored from kvtier's cpu tier, then BlockRemoved from it, then BlockStored on disk."""
    before = len(events_of(server).kvtier())
    server.complete(prompt(21, 2 * CHUNK + 8))
    time.sleep(1.0)
    server.complete(prompt(22, 2 * CHUNK + 8))
    deadline, lifecycle = time.monotonic() + 20, None
    while lifecycle is None and time.monotonic() < deadline:
        time.sleep(0.5)
        lifecycle = _stored_removed_demoted(events_of(server).kvtier()[before:])
    assert lifecycle is not None, events_of(server).kvtier()[before:]
    assert all(e.medium in ("CPU", "STORAGE") for e in events_of(server).received
               if (getattr(e, "ownership", None) or "").startswith("kvtier:"))


def _stored_removed_demoted(seen: list[tuple[str, str, tuple[Any, ...]]]) -> tuple[int, int, int] | None:
    """Positions of a chunk's BlockStored in cpu, then its BlockRemoved from cpu, then its BlockStored on disk."""
    for i, (kind, tier, chunk) in enumerate(seen):
        if (kind, tier) != ("BlockStored", "kvtier:cpu"):
            continue
        later = seen[i + 1:]
        if ("BlockRemoved", "kvtier:cpu", chunk) in later:
            gone = i + 1 + later.index(("BlockRemoved", "kvtier:cpu", chunk))
            if ("BlockStored", "kvtier:disk", chunk) in seen[gone + 1:]:
                return i, gone, gone + 1 + seen[gone + 1:].index(("BlockStored", "kvtier:disk", chunk))
    return None
