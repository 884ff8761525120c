"""LMCache's storage backends, run as kvtier's peer in the Redis and disk benchmarks of the same run.

LMCache 0.5.6 installs without its dependencies beside kvtier's venv (its wheel carries its native Redis client),
and its storage backends run on the CPU. Each ``LmcachePeer`` is one backend exactly as LMCache's engine builds it
for records of one size: a ``LocalCPUBackend`` (the allocator every LMCache read and write goes through, its own
cache off) beneath a ``RemoteBackend`` (``resp://``: the native C++ client; ``redis://``: the redis-py connector)
or a ``LocalDiskBackend``, their coroutines on an event loop in a thread of its own, as in LMCache's engine. A
record is one LMCache chunk, bf16 ``(2, layers, 256 tokens, 512)``: 512 KiB a layer, so 1, 4 and 32 MiB records
are 2, 8 and 64 layers.

What is timed is what each backend does for a batch: a put from records already in LMCache's CPU memory until its
completion callbacks have fired for every key; a get into LMCache's CPU memory. kvtier's tiers are timed the same
way (records in memory to stored; stored to a buffer in memory); the copy from or into an engine's KV blocks is in
neither.

Install it (a folder of the checkout that git ignores; nothing else is touched)::

    .venv/bin/python -m pip install --no-deps --target .peers/lmcache lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

VERSION = "0.5.6"
DEFAULT_PATH = Path(__file__).resolve().parents[1] / ".peers" / "lmcache"
INSTALL = (f".venv/bin/python -m pip install --no-deps --target .peers/lmcache lmcache=={VERSION} "
           "aiofile==3.12.3 caio==0.12.10")
CHUNK_TOKENS = 256
WIDTH = 512  # heads x head size of the chunk's rows: 2 x 256 x 512 bf16 = 512 KiB a layer
LAYER_BYTES = 2 * CHUNK_TOKENS * WIDTH * 2
GB = 1 << 30
CLOSE_WAIT_S = 10.0


def unavailable(path: Path | None) -> str | None:
    """Why LMCache cannot run here (one line), or None once ``import lmcache`` works. ``path``: a folder that pip
    installed it into with ``--target``, put first on ``sys.path`` (None: the default, when it exists)."""
    where = path if path is not None else DEFAULT_PATH
    if where.is_dir() and str(where) not in sys.path:
        sys.path.insert(0, str(where))
    elif path is not None and not where.is_dir():
        return f"LMCache: {path} is not a folder; install it there: {INSTALL}"
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        import lmcache
        from lmcache.v1.storage_backend import local_disk_backend, remote_backend  # noqa: F401
    except Exception as exc:  # an ImportError, or a native module built for another torch
        return f"LMCache is not importable ({type(exc).__name__}: {exc}); install it: {INSTALL}"
    found = getattr(lmcache, "__version__", "?")
    if found != VERSION:
        return f"LMCache {found} found, the benchmark is written for {VERSION}: {INSTALL}"
    return None


def wanted(path: Path | None, script: str) -> tuple[bool, str | None]:
    """Whether ``script`` measures LMCache, and the one-line error that stops it: ``--lmcache`` named a folder
    where LMCache does not import. Without ``--lmcache`` and without LMCache, a note on stderr says its rows are
    left out and how to install it."""
    why = unavailable(path)
    if why is None:
        return True, None
    if path is not None:
        return False, f"--lmcache {path}: {why}"
    print(f"{script}: its LMCache rows are left out: {why}", file=sys.stderr)
    return False, None


class LmcachePeer:
    """One LMCache storage backend for ``count`` records of ``size`` bytes (a multiple of 512 KiB): ``url`` a
    ``resp://`` or ``redis://`` address, or ``disk`` a folder for its local disk backend."""

    def __init__(self, size: int, count: int, *, url: str | None = None, disk: str | None = None,
                 name: str = "bench") -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        if size % LAYER_BYTES or (url is None) == (disk is None):
            raise ValueError("a record is a multiple of 512 KiB, on one of url or disk")
        self.layers, self.count = size // LAYER_BYTES, count
        # room for the batch written, the batch read back and the backend's own staging
        room = max(1.0, 3 * count * size / GB)
        options: dict[str, Any] = dict(chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=room,
                                       remote_serde="naive", save_unfull_chunk=False)
        if url is not None:
            options["remote_url"] = url
        elif disk is not None:
            options.update(local_disk=os.path.join(disk, ""), max_local_disk_size=room)
        config = LMCacheEngineConfig.from_defaults(**options)
        meta = LMCacheMetadata(model_name=name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.bfloat16, kv_shape=(self.layers, 2, CHUNK_TOKENS, 8, WIDTH // 8))
        self.keys = [CacheEngineKey(name, 1, 0, i, torch.bfloat16) for i in range(count)]
        self._held: list[Any] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self._thread.start()
        self.cpu: Any = None
        self.backend: Any = None
        try:
            self.cpu = LocalCPUBackend(config, meta, dst_device="cpu")
            self.backend = self._backend(config, meta, url)
        except BaseException:
            self.close()
            raise

    def _backend(self, config: Any, meta: Any, url: str | None) -> Any:
        if url is not None:
            from lmcache.v1.storage_backend.remote_backend import RemoteBackend

            return RemoteBackend(config, meta, self.loop, self.cpu, dst_device="cpu")
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        return LocalDiskBackend(config, self.loop, self.cpu, dst_device="cpu", metadata=meta)

    def stage(self, payloads: list[torch.Tensor]) -> list[Any]:
        """The payloads (uint8, ``size`` bytes each) copied into LMCache's CPU memory: what a put takes."""
        shape = torch.Size([2, self.layers, CHUNK_TOKENS, WIDTH])
        objs = []
        for payload in payloads:
            obj = self.cpu.allocate(shape, torch.bfloat16)
            if obj is None:
                raise RuntimeError("LMCache's CPU memory is full")
            obj.tensor.view(torch.uint8).view(-1).copy_(payload)
            objs.append(obj)
        return objs

    def put(self, objs: list[Any], timeout: float = 120.0) -> None:
        """Write the staged records; return once LMCache's completion callback has fired for every key (what is
        timed: ``stored`` asks the backend afterwards)."""
        left = len(objs)
        done = threading.Event()
        lock = threading.Lock()

        def written(_key: Any) -> None:
            nonlocal left
            with lock:
                left -= 1
                if left == 0:
                    done.set()

        self.backend.batched_submit_put_task(self.keys[:len(objs)], objs, on_complete_callback=written)
        if not done.wait(timeout):
            raise RuntimeError(f"LMCache stored {len(objs) - left} of {len(objs)} records in {timeout:.0f} s")

    def stored(self, count: int) -> bool:
        """Whether the backend holds the first ``count`` records (one existence check per key)."""
        return all(self.backend.contains(k) for k in self.keys[:count])

    def get(self) -> list[torch.Tensor]:
        """Read every record back (LMCache's ``resp://`` get of an absent key hangs: call after ``put``). The
        records of the previous get go back to LMCache's allocator first, unless ``release`` did already."""
        self.release()
        got = self.backend.batched_get_blocking(self.keys)
        if any(obj is None for obj in got):
            raise RuntimeError(f"LMCache lost {sum(obj is None for obj in got)} of {len(got)} records")
        self._held = got
        return [obj.tensor.view(torch.uint8).reshape(-1) for obj in got]

    def release(self, objs: list[Any] | None = None) -> None:
        """Give records (the last get's, by default) back to LMCache's allocator."""
        for obj in self._held if objs is None else objs:
            obj.ref_count_down()
        if objs is None:
            self._held = []

    def close(self) -> None:
        """Stop the backend and free LMCache's CPU memory, within ``2 * CLOSE_WAIT_S`` whatever it does."""
        if self.cpu is not None:
            self.release()
        if self.backend is not None:
            _unblock_close(getattr(self.backend, "connection", None))
            closing = threading.Thread(target=self.backend.close, name="lmcache-close", daemon=True)
            closing.start()
            closing.join(CLOSE_WAIT_S)
        if self.cpu is not None:
            self.cpu.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self.loop.close()


def _unblock_close(connection: Any) -> None:
    """LMCache 0.5.6's Redis connectors close with ``await self.pq_executor.shutdown()``: a blocking call that
    waits, on the event loop's own thread, for a coroutine scheduled on that loop, so it never returns. Its job
    queue's coroutine ``shutdown_async`` is what that line means; give it that (a close that hangs anyway is left
    to its daemon thread after ``CLOSE_WAIT_S``)."""
    connector = getattr(connection, "_connector", connection)  # under LMCache's instrumenting wrapper
    executor = getattr(connector, "pq_executor", None)
    if executor is not None and hasattr(executor, "shutdown_async"):
        executor.shutdown = executor.shutdown_async
