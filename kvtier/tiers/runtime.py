"""A background asyncio loop for synchronous callers (the connector halves run in vLLM's sync code).

``LoopThread.run(coro)`` blocks for the result; ``submit(coro)`` returns a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

# A stop is bounded whatever a medium does (docs/guarantees.md: persist_at_close + STOP_MARGIN_S):
CLOSE_WAIT_S = 0.5  # a closing tier waits at most this long for its writes in flight, and as long for its bookkeeping
TIER_CLOSE_S = 2 * CLOSE_WAIT_S + 0.5  # the most a stop waits for its tiers' closes (run at once); past it, given up
LOOP_CLOSE_S = 0.5  # the most a stop waits for the I/O loop's thread to end
SAVES_AT_STOP_S = 1.0  # the most a worker's stop waits for its pending saves; past it, they are dropped
STOP_MARGIN_S = SAVES_AT_STOP_S + TIER_CLOSE_S + LOOP_CLOSE_S  # a stop's bound past policy.persist_at_close


class LoopThread:
    """Owns one event loop running in a daemon thread."""

    def __init__(self, name: str = "kvtier-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        try:
            io_thread()
            # asyncio.to_thread's threads (disk I/O) likewise
            self._loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
                thread_name_prefix="kvtier-io", initializer=io_thread))
        finally:
            asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=LOOP_CLOSE_S)
        if not self._thread.is_alive():
            self._loop.close()


def single_threaded_torch() -> None:
    """Make torch ops run on the calling thread alone (kvtier's I/O threads: copies into and out of the tiers).

    A parallel torch op gives the thread that runs it an OpenMP team of its own. In an engine whose compute
    threads fill every core, a second team means more OpenMP threads than cores: OpenMP then stops spin-waiting,
    and each of the engine's many small parallel ops pays a thread wake-up (measured in vLLM's CPU engine:
    requests that never hit, cpu tier: see ``kvtier bench vllm-overhead``). Only this thread's OpenMP setting
    changes (torch's own ``set_num_threads`` is process-wide, and vLLM forbids it after binding its threads). A
    no-op until torch is imported or where no OpenMP runtime is loaded; never raises."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.get_num_threads()  # torch sets this thread's OpenMP threads on its first use: let that happen first
        ctypes.CDLL(None).omp_set_num_threads(1)
    except Exception as exc:  # no OpenMP runtime, another platform: torch keeps its own setting here
        logger.debug("torch ops on %s stay multi-threaded: %r", threading.current_thread().name, exc)


def io_thread() -> None:
    """Initializer of every kvtier I/O thread: off the engine's compute cores, torch single-threaded."""
    off_compute_cores()
    single_threaded_torch()


def compute_cores(env: Mapping[str, str] = os.environ) -> frozenset[int]:
    """The cores vLLM's CPU build bound the engine's OpenMP threads to, read from what it sets for its worker
    process (``OMP_PLACES`` '{0,1,2}', ``GOMP_CPU_AFFINITY`` '0 1 2', ``KMP_AFFINITY`` '...,proclist=[0,1,2]');
    empty when nothing was bound or the value is in a form not read here."""
    places = env.get("OMP_PLACES", "")
    if places:
        return _core_list(places.replace("{", " ").replace("}", " ")) if ":" not in places else frozenset()
    kmp = env.get("KMP_AFFINITY", "")
    if "proclist=[" in kmp:
        return _core_list(kmp.split("proclist=[", 1)[1].split("]", 1)[0])
    return _core_list(env.get("GOMP_CPU_AFFINITY", ""))


def _core_list(text: str) -> frozenset[int]:
    """'0,1 3-5' -> {0, 1, 3, 4, 5}; empty on anything else."""
    cores: set[int] = set()
    for item in text.replace(",", " ").split():
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return frozenset()
        cores.update(range(int(low), int(high or low) + 1))
    return frozenset(cores)


def off_compute_cores() -> None:
    """Move the calling thread to the cores the engine's compute threads leave free.

    vLLM's CPU build binds one OpenMP thread to each of its worker's cores and keeps some cores out of that
    list: one for its scheduler process, one more when a KV connector is set. A thread the worker starts
    inherits the core its main thread is bound to, so kvtier's copies and I/O would run on a compute core, and
    every parallel op of the engine waits for the OpenMP thread they hold up. Moved to the cores kept out (those
    the worker's parent process may use, less the compute cores) they share the reserved cores with the
    scheduler instead. A no-op where no binding is found, no core is left over, or off Linux; never raises."""
    compute = compute_cores()
    if not compute or not sys.platform.startswith("linux"):
        return
    try:
        spare = os.sched_getaffinity(os.getppid()) - compute
        if spare:
            os.sched_setaffinity(0, spare)  # 0: the calling thread
    except OSError as exc:
        logger.debug("kvtier thread %s stays on its cores: %r", threading.current_thread().name, exc)


BACKGROUND_NICE = 19


def background_thread() -> None:
    """Initializer of kvtier's background writer threads: torch single-threaded (see ``single_threaded_torch``)
    and the lowest CPU priority (nice 19), so that the engine's threads run first.

    Why: on a host whose cores the engine fills (vLLM's CPU engine binds a compute thread to every core), a
    write that runs beside a step takes a core from it, and the step's parallel ops wait for that core (measured
    in vLLM's CPU engine, disk tier, requests that never hit: 35-40 ms of writer CPU per 600-token request ran
    inside the next request's decode). At nice 19 the writes fill the engine's idle time and still progress
    (a small share of a core) when it is never idle, unlike ``SCHED_IDLE``, which can starve them; the worker's
    save backlog bound (``policy.save_backlog``) skips saves when they cannot keep up, and an idle engine step
    waits for the writes it needs (``WorkerHalf.get_finished``). Linux sets this per thread; elsewhere, or
    without permission, nothing changes. Like every I/O thread it runs off the engine's compute cores
    (``io_thread``). Never raises."""
    io_thread()
    if not sys.platform.startswith("linux"):  # elsewhere PRIO_PROCESS would set the whole process's priority
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError) as exc:
        logger.debug("kvtier writer thread keeps its priority: %r", exc)
