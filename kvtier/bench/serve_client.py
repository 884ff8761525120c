"""Clients of ``kvtier bench serve``: streamed completions of token ids against vLLM's OpenAI server, sent in the
trace's arrival order by a pool of threads (at most ``concurrency`` in flight).

A request's time to first token is the time from sending it to the first streamed chunk that carries a token
(kvtier.ops.vllm_server.stream_completion);
its latency is the time to the end of the stream. Both are measured from the moment it is sent, which can be
later than its arrival when every client is busy (``queued_s``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvtier.bench.serve_trace import ServeRequest
from kvtier.ops.vllm_server import stream_completion


@dataclass
class Reply:
    """What one streamed request gave."""

    index: int
    sent_s: float  # from the start of the replay
    ttft_s: float
    latency_s: float
    queued_s: float
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details, when it reports them
    error: str | None = None


def _ask(host: str, port: int, model: str, request: ServeRequest, index: int, t0: float) -> Reply:
    sent = time.perf_counter() - t0
    try:
        got = stream_completion(host, port, model, request.prompt, request.max_tokens)
    except (OSError, RuntimeError, ValueError) as exc:
        return Reply(index, sent, 0.0, time.perf_counter() - t0 - sent, sent - request.arrival_s,
                     len(request.prompt), error=f"{type(exc).__name__}: {exc}")
    details = got.usage.get("prompt_tokens_details") or {}
    return Reply(index, sent, got.ttft_s, time.perf_counter() - t0 - sent, max(0.0, sent - request.arrival_s),
                 len(request.prompt), got.tokens, details.get("cached_tokens"))


def replay(host: str, port: int, model: str, requests: Sequence[ServeRequest], concurrency: int,
           progress: Callable[[int], None] | None = None) -> list[Reply]:
    """Send every request at its arrival time (or as soon as one of ``concurrency`` clients is free, in order);
    the replies in request order."""
    slots = threading.BoundedSemaphore(concurrency)
    futures: list[Future[Reply]] = []

    def job(index: int, request: ServeRequest, t0: float) -> Reply:
        try:
            return _ask(host, port, model, request, index, t0)
        finally:
            slots.release()
            if progress is not None:
                progress(1)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-serve-client") as pool:
        t0 = time.perf_counter()
        for index, request in enumerate(requests):
            wait = request.arrival_s - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)
            slots.acquire()
            futures.append(pool.submit(job, index, request, t0))
    return [f.result() for f in futures]
