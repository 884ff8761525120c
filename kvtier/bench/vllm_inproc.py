"""Handles on the parts of an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank) that the
vLLM benchmarks time or drive, used inside the engine process of kvtier.bench.vllm_driver and of ``kvtier bench
vllm``: its scheduler, kvtier's two connector halves, the time the engine's thread spends in kvtier's hooks
(``HookTimer``), the CPU time of kvtier's threads, and where one request's time to first token goes (``PhaseTimer``,
``kvtier bench vllm``'s breakdown; ``medium_alone``, the medium's own time for the same records)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups", "take_events",
                   "get_kv_connector_stats", "get_external_cache_hit_sources", "on_new_request",
                   "get_loaded_kv_cache_group_ids", "has_pending_block_frees", "has_pending_push_work")
WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                "handle_preemptions", "bind_connector_metadata", "clear_connector_metadata", "get_transfer_results",
                "get_block_ids_with_load_errors", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
                "build_connector_worker_meta")
HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished", "handle_preemptions",
         "get_num_new_matched_tokens",
         "update_state_after_alloc", "build_connector_meta", "update_connector_output", "request_finished",
         "request_finished_all_groups")  # HookTimer's: the hooks that do kvtier's work
Span = tuple[float, float]


def kvtier_thread_seconds() -> float:
    """CPU seconds used so far by this process's kvtier threads (I/O loop, writers)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("kvtier") and thread.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # the thread just ended; or no such clock on this platform
                continue
    return total


class HookTimer:
    """Time the engine's thread spends in kvtier's connector methods (wraps them on the class, in-process)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self, cls: type) -> None:
        for name in HOOKS:
            if hasattr(cls, name):
                setattr(cls, name, self._wrap(getattr(cls, name)))

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if threading.current_thread() is threading.main_thread():
                    self.seconds += time.perf_counter() - t
        return timed


def worker_connector() -> Any:
    """The worker's KV connector of this process, or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def as_kvtier(connector: Any) -> Any:
    """``connector`` when it is kvtier's (vLLM's KVTierConnector is a TieredConnector), else None."""
    from kvtier.connector.tiered import TieredConnector

    return connector if isinstance(connector, TieredConnector) else None


def flush_kvtier() -> dict[str, Any]:
    """Wait for kvtier's pending saves; its worker counters since start (the kvtier.control.metrics snapshot)."""
    worker = as_kvtier(worker_connector())
    if worker is None:
        return {}
    worker.flush_saves()
    counters: dict[str, Any] = worker._work().totals()
    return counters


def engine_core(llm: Any) -> Any:
    """The engine core of an in-process engine."""
    try:
        return llm.llm_engine.engine_core.engine_core
    except AttributeError:
        raise RuntimeError("the benchmark needs vLLM's engine in this process: run with "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size 1") from None


def scheduler_of(llm: Any) -> Any:
    """The engine core's scheduler of an in-process engine."""
    return engine_core(llm).scheduler


def union(spans: Sequence[Span]) -> list[Span]:
    """``spans`` merged where they overlap, in order."""
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap(a: Sequence[Span], b: Sequence[Span]) -> float:
    """Seconds covered by both ``a`` and ``b``."""
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in union(a) for y0, y1 in union(b))


def _length(spans: Sequence[Span]) -> float:
    return sum(end - start for start, end in spans)


class PhaseTimer:
    """Where one request's time to first token goes, in an in-process engine: wraps (on the objects, not the
    classes) kvtier's scheduler and worker hooks, the worker store's reads and borrows (they run on kvtier's I/O
    loop), the copy into the engine's blocks, and the engine's model executor.

    The phases of ``breakdown`` add up to the time to first token:
      lookup        the engine's thread in kvtier's scheduler hooks (lookup, plans, reports)
      medium_wait   the engine's thread in a worker hook while a read of the tier ran (waiting for the medium)
      copy          the copy of what was read into the engine's blocks
      handoff       the rest of the worker hooks: hand-offs to the I/O loop and back, save gathers, bookkeeping
      compute       the model executor's time outside kvtier's hooks (the suffix's forward pass, input prep)
      engine        the rest: vLLM's scheduling and output processing, and its steps while a load was pending
    ``medium_s`` is the reads' own wall time (on the I/O loop, overlapping steps for an asynchronous load) and
    ``steps`` the engine steps of the request, ``steps_loading`` those that began before the last copy ended
    (the steps of a pending load, and the one that copied it)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[Span]] = {}
        self.reads: list[tuple[str, list[Any], bool]] = []  # (tier, keys, memory tier: borrowed) of each read
        self.nbytes = 0

    def install(self, llm: Any) -> None:
        core = engine_core(llm)
        self._wrap(core.model_executor, "execute_model", "forward")  # one call per engine step
        self._wrap(core.model_executor, "sample_tokens", "sample")
        sched = as_kvtier(getattr(core.scheduler, "connector", None))
        worker = as_kvtier(worker_connector())
        for name in SCHEDULER_HOOKS if sched is not None else ():
            self._wrap(sched, name, "lookup")
        if worker is None:
            return
        for name in WORKER_HOOKS:
            self._wrap(worker, name, "worker")
        half = worker._work()
        self._wrap(half._kv, "scatter", "copy", count_bytes=True)
        self._wrap_read(half.store)
        self._wrap_borrow(half.store)

    def begin(self) -> None:
        """Forget what the previous request recorded."""
        self.spans = {}
        self.reads = []
        self.nbytes = 0

    def _note(self, phase: str, start: float, name: str = "") -> None:
        span = (start, time.perf_counter())
        self.spans.setdefault(phase, []).append(span)
        if name:
            self.spans.setdefault(f"{phase}.{name}", []).append(span)

    def _wrap(self, owner: Any, name: str, phase: str, count_bytes: bool = False) -> None:
        method = getattr(owner, name, None)
        if method is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._note(phase, start, name if phase in ("lookup", "worker") else "")
                if count_bytes:
                    self.nbytes += sum(p.numel() * p.element_size() for p in args[-1])

        setattr(owner, name, timed)

    def _wrap_read(self, store: Any) -> None:
        method = store.read

        async def timed(tier: str, keys: Sequence[Any]) -> Any:
            start = time.perf_counter()
            try:
                return await method(tier, keys)
            finally:
                self._note("medium", start)
                self.reads.append((tier, list(keys), False))

        store.read = timed

    def _wrap_borrow(self, store: Any) -> None:
        """A memory tier's lending, on the engine's thread (what it cannot lend is read: ``_wrap_read``)."""
        method = store.borrow

        def timed(tier: str, keys: Sequence[Any], *args: Any) -> Any:
            start = time.perf_counter()
            lent = None
            try:
                lent = method(tier, keys, *args)
                return lent
            finally:
                self._note("medium", start)
                if lent is not None:  # else the tier lends nothing: it is read
                    self.reads.append((tier, list(keys), True))

        store.borrow = timed

    def breakdown(self, start: float, end: float) -> dict[str, Any]:
        """The phases (seconds) of the request run from ``start`` to its first token at ``end``."""
        spans = {k: [(max(a, start), min(b, end)) for a, b in v if b > start and a < end]
                 for k, v in self.spans.items()}
        get = lambda k: spans.get(k, [])  # noqa: E731
        medium, worker, copy = union(get("medium")), get("worker"), _length(get("copy"))
        medium_wait = overlap(worker, medium)
        lookup, hooks = _length(union(get("lookup"))), _length(union(worker))  # a hook may call another
        forward = _length(get("forward")) + _length(get("sample"))
        last_copy = max((b for _, b in get("copy")), default=start)
        return {"lookup": lookup, "medium_wait": medium_wait, "copy": copy,
                "handoff": max(0.0, hooks - copy - medium_wait), "compute": max(0.0, forward - hooks),
                "engine": max(0.0, (end - start) - lookup - forward), "medium_s": _length(medium),
                "steps": len(get("forward")), "steps_loading": sum(1 for a, _ in get("forward") if a < last_copy),
                "bytes": self.nbytes,
                "hooks": {k: _length(v) for k, v in spans.items() if "." in k and _length(v) > 0}}


def medium_alone(reads: Sequence[tuple[str, list[Any], bool]], repeats: int = 5) -> dict[str, float]:
    """The medium's own time for the bytes of ``reads`` (one request's), measured outside the engine's steps in
    this process: the same records read again from their tier (a memory tier's borrowed and released), and a
    plain copy of the same bytes into buffers allocated beforehand (the limit of any copy into the blocks).
    Medians over ``repeats``."""
    import torch

    worker = as_kvtier(worker_connector())
    if worker is None or not reads:
        return {}
    half = worker._work()
    store, run = half.store, half._loads.run_bounded
    read_s: list[float] = []
    copy_s: list[float] = []
    for _ in range(repeats):
        t = time.perf_counter()
        payloads: list[torch.Tensor] = []
        lent: list[tuple[str, list[Any]]] = []
        for tier, keys, borrowed in reads:
            got = store.borrow(tier, keys) if borrowed else run(store.read(tier, keys))
            payloads += [p for p in got or () if p is not None]
            if borrowed and got is not None:
                lent.append((tier, keys))
        read_s.append(time.perf_counter() - t)
        targets = [torch.empty_like(p) for p in payloads]
        t = time.perf_counter()
        for target, payload in zip(targets, payloads, strict=True):
            target.copy_(payload)
        copy_s.append(time.perf_counter() - t)
        for tier, keys in lent:  # given back once copied, untimed
            store.release(tier, keys)
    nbytes = sum(p.numel() * p.element_size() for p in payloads)
    return {"read_s": statistics.median(read_s), "memcpy_s": statistics.median(copy_s), "bytes": nbytes}
