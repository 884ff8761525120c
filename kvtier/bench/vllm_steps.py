"""Inside a benchmark's engine process (kvtier.bench.vllm_proc): a batch of decoding requests, and optionally
requests that load their prefix from kvtier asynchronously added to it mid-decode, stepped one engine step at a
time with each step's record (``kvtier bench vllm-contention``).

Per step: its wall time, the time the engine's thread spent inside kvtier's connector hooks (the copy of a
finished load into the engine's blocks happens there), the tokens it computed (from the scheduler's output), how
many requests were waiting for an asynchronous kvtier load, how many loads the workers reported finished (their
copy ran in this step), how many requests were running, and how many added requests had no first token yet.
Per run: the CPU time of kvtier's threads. Per added request: the seconds from being added to the end of the step
that gave it its first token, the tokens the engine reported cached for it, and its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.vllm_inproc import HookTimer, kvtier_thread_seconds

STEADY_STEPS = 4  # decode steps of the batch alone before the loading requests are added
MAX_STEPS = 20_000  # a run that has not ended by then is a hang, not a measurement


def _remote_waiting(scheduler: Any) -> int:
    from vllm.v1.request import RequestStatus

    return sum(1 for r in scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)


@dataclass
class _Added:
    """The loading requests of one run: when each was added, its first token's time, cached tokens, tokens."""

    at: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    def note(self, outputs: Sequence[Any], end: float) -> None:
        for out in outputs:
            rid = out.request_id
            if rid in self.at and rid not in self.first and out.outputs[0].token_ids:
                self.first[rid] = end - self.at[rid]
                self.cached[rid] = int(out.num_cached_tokens or 0)
            if rid in self.at and out.finished:
                self.tokens[rid] = list(out.outputs[0].token_ids)

    def result(self, count: int) -> dict[str, Any]:
        names = [f"l{i}" for i in range(count)]
        missing = [n for n in names if n not in self.first]
        if missing:
            raise RuntimeError(f"loading requests {missing} ended without a first token")
        return {"first_token_s": [self.first[n] for n in names], "cached": [self.cached[n] for n in names],
                "tokens": [self.tokens.get(n, []) for n in names]}


def _step(engine: Any, scheduler: Any, hooks: HookTimer, added: _Added, scheduled: list[int]) -> dict[str, Any]:
    """One engine step and its record."""
    pending = len(added.at) - len(added.first)
    remote, running, hook0, t = _remote_waiting(scheduler), len(scheduler.running), hooks.seconds, time.perf_counter()
    outputs = engine.step()
    end = time.perf_counter()
    added.note(outputs, end)
    return {"s": end - t, "hook_s": hooks.seconds - hook0, "tokens": scheduled[0],
            "remote": max(remote, _remote_waiting(scheduler)),  # a load started in this step ran beside it
            "copied": len(scheduler.finished_recving_kv_req_ids), "running": running, "pending": pending}


def mixed_batch(llm: Any, scheduler: Any, hooks: HookTimer, decode: Sequence[list[int]], decode_tokens: int,
                load: Sequence[list[int]]) -> dict[str, Any]:
    """Run ``decode`` (each generating ``decode_tokens``) to ``STEADY_STEPS`` decode steps, then add ``load`` (one
    token each), and step until every request finished; the per-step and per-request records."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True, detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    original = scheduler.schedule
    scheduled = [0]

    def schedule(*args: Any, **kwargs: Any) -> Any:  # note each step's scheduled token count
        out = original(*args, **kwargs)
        scheduled[0] = int(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = schedule
    steps: list[dict[str, Any]] = []
    added = _Added()
    cpu0 = kvtier_thread_seconds()
    try:
        for i, prompt in enumerate(decode):
            engine.add_request(f"d{i}", TokensPrompt(prompt_token_ids=list(prompt)), params)
        decoded = 0
        while len(steps) < MAX_STEPS:
            if load and not added.at and (decoded >= STEADY_STEPS or not engine.has_unfinished_requests()):
                for i, prompt in enumerate(load):
                    added.at[f"l{i}"] = time.perf_counter()
                    engine.add_request(f"l{i}", TokensPrompt(prompt_token_ids=list(prompt)), one)
            if not engine.has_unfinished_requests():
                break
            steps.append(_step(engine, scheduler, hooks, added, scheduled))
            decoded += steps[-1]["tokens"] == steps[-1]["running"] == len(decode) > 0  # a decode step of the batch
        else:
            raise RuntimeError(f"the run did not end within {MAX_STEPS} steps")
    finally:
        scheduler.schedule = original
    return {"steps": steps, "kvtier_thread_s": kvtier_thread_seconds() - cpu0, **added.result(len(load))}
