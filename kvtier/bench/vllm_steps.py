"""Inside a benchmark's engine process (kvtier.bench.vllm_proc): a batch of decoding requests, and optionally
requests that load their prefix from kvtier asynchronously added to it mid-decode, stepped one engine step at a
time with each step's record (``kvtier bench vllm-contention``).

Per step: its wall time, the prompt and decode tokens it computed (from the scheduler's output), how many
requests were waiting for an asynchronous kvtier load when it ran, how many were running, and how many added
requests had no first token yet (their load or prefill was under way); the CPU time of
kvtier's threads over the whole run. Per added request: the seconds from being added to the end of the step that
gave it its first token, and the tokens the engine reported cached for it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier.bench.vllm_proc import kvtier_thread_seconds

STEADY_STEPS = 4  # decode steps of the batch alone before the loading requests are added


def _remote_waiting(scheduler: Any) -> int:
    from vllm.v1.request import RequestStatus

    return sum(1 for r in scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)


def _recording_schedule(scheduler: Any, scheduled: list[int]) -> Any:
    """Wrap ``scheduler.schedule`` so each step's scheduled token count lands in ``scheduled``; the original."""
    original = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        scheduled.append(int(out.total_num_scheduled_tokens))
        return out

    scheduler.schedule = schedule
    return original


def mixed_batch(llm: Any, scheduler: Any, decode: Sequence[list[int]], decode_tokens: int,
                load: Sequence[list[int]]) -> dict[str, Any]:
    """Run ``decode`` (each generating ``decode_tokens``) to steady decoding, then add ``load`` (one token
    each), and step until every request finished; the per-step and per-request records."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    scheduled: list[int] = []
    original = _recording_schedule(scheduler, scheduled)
    steps: list[dict[str, Any]] = []
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    decoding = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True, detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    cpu0 = kvtier_thread_seconds()
    try:
        for i, prompt in enumerate(decode):
            engine.add_request(f"d{i}", TokensPrompt(prompt_token_ids=list(prompt)), decoding)
        decoded = 0
        while True:
            if load and not added and (decoded >= STEADY_STEPS or not decode):
                for i, prompt in enumerate(load):
                    added[f"l{i}"] = time.perf_counter()
                    engine.add_request(f"l{i}", TokensPrompt(prompt_token_ids=list(prompt)), one)
            if not engine.has_unfinished_requests():
                break
            pending = len(added) - len(first)  # added requests still without their first token
            remote, running, t = _remote_waiting(scheduler), len(scheduler.running), time.perf_counter()
            outputs = engine.step()
            end = time.perf_counter()
            remote = max(remote, _remote_waiting(scheduler))  # a load started in this step ran beside it
            steps.append({"s": end - t, "tokens": scheduled[-1] if scheduled else 0, "remote": remote,
                          "running": running, "pending": pending})
            scheduled.clear()
            for out in outputs:
                if out.request_id in added and out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = end - added[out.request_id]
                    cached[out.request_id] = int(out.num_cached_tokens or 0)
                if out.request_id in added and out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            if all(len(r.output_token_ids) > 0 for r in scheduler.running) and len(scheduler.running) >= len(decode):
                decoded += 1
    finally:
        scheduler.schedule = original
    return {"steps": steps, "kvtier_thread_s": kvtier_thread_seconds() - cpu0,
            "first_token_s": [first.get(f"l{i}") for i in range(len(load))],
            "cached": [cached.get(f"l{i}", 0) for i in range(len(load))],
            "tokens": [tokens.get(f"l{i}", []) for i in range(len(load))]}
