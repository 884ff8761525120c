"""A background asyncio loop for synchronous callers (the connector halves run in vLLM's sync code).

``LoopThread.run(coro)`` blocks for the result; ``submit(coro)`` returns a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


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
            single_threaded_torch()
            # asyncio.to_thread's threads (disk I/O) likewise
            self._loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
                thread_name_prefix="kvtier-io", initializer=single_threaded_torch))
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
        self._thread.join(timeout=5)
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
