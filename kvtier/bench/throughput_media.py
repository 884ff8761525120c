"""The disk, Redis and transfer cases of ``kvtier bench throughput`` (see :mod:`kvtier.bench.throughput`).

Raw limits used here:

* disk: each chunk is written with ``os.open`` + ``os.write`` (+ ``os.fsync`` in fsync mode) + ``os.close`` to
  a new file, one ``asyncio.to_thread`` call per file, gathered (the tier's write fan-out), and read back with
  ``readinto`` into pre-touched buffers two ways, the faster of them per round being the limit: one
  ``to_thread`` per file, and ``READ_STREAMS`` threads each reading a run of files in a loop (the tier's read
  fan-out). Cold rounds drop the page cache of exactly the files read, before each round.
* redis: one redis-py pipeline (hiredis parser, no transaction) of SET, then of GET, on the same server (the
  baseline the goal is judged against); beside it ``raw_socket``: the same commands as RESP frames on one plain
  socket, values sent from and received straight into pre-touched buffers (what loopback + redis-server allow).
* transfer: one contiguous ``copy_`` of the same bytes as the gather / scatter moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import socket
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import torch
import xxhash

from kvtier.bench.measure import (
    Spread,
    chunk_views,
    drop_page_cache,
    format_size,
    gbps,
    interleave,
    make_keys,
    pretouch,
    same_bytes,
    timed,
    touched,
)
from kvtier.bench.redis_servers import redis_server
from kvtier.bench.throughput_run import Runner, Settings
from kvtier.errors import KvtierError
from kvtier.tiers.disk.io import READ_STREAMS, SMALL_RECORD


def raw_write(path: str, chunk: torch.Tensor, fsync: bool) -> None:
    """Write one chunk's bytes to a new file (the disk's raw limit)."""
    view = chunk.view(torch.uint8).numpy().data.cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while view.nbytes:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, out: torch.Tensor) -> None:
    """Read a whole file into ``out`` (pre-touched, exactly the file's size)."""
    view = out.view(torch.uint8).numpy().data.cast("B")
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < view.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path}: short read")
            got += n


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def bench_disk(run: Runner, root: Path, chunk_bytes: int, fsync: bool) -> None:
    """Disk tier ``put`` / ``get`` (warm and cold) against plain file writes and reads."""
    from kvtier.config import DiskTierConfig
    from kvtier.tiers.disk.tier import DiskTier

    s = run.settings
    n = s.chunks(chunk_bytes)
    base = root / f"{format_size(chunk_bytes)}-{'fsync' if fsync else 'nofsync'}"
    (base / "raw").mkdir(parents=True)
    paths = [str(base / "raw" / f"{i:05d}.bin") for i in range(n)]
    src = chunk_views(touched(n * chunk_bytes), chunk_bytes)
    bufs = chunk_views(pretouch(torch.empty(n * chunk_bytes, dtype=torch.uint8)), chunk_bytes)
    tier = DiskTier(DiskTierConfig(name="disk", capacity=4 * n * (chunk_bytes + 65536), path=str(base / "tier"),
                                   fsync=fsync))
    run.call(tier.start())
    keys = make_keys(f"disk:{chunk_bytes}:{fsync}", n)
    items = list(zip(keys, src, strict=True))
    extra: dict[str, Any] = {"threads": "asyncio.to_thread per file"}

    async def write_raw() -> None:
        await asyncio.gather(*(asyncio.to_thread(raw_write, p, c, fsync) for p, c in zip(paths, src, strict=True)))

    async def read_raw() -> None:
        await asyncio.gather(*(asyncio.to_thread(raw_read, p, b) for p, b in zip(paths, bufs, strict=True)))

    def read_raw_loops(loops: int, hashed: bool = False) -> Callable[[], Coroutine[Any, Any, None]]:
        async def read() -> None:
            runs = _split(list(zip(paths, bufs, strict=True)), loops)
            await asyncio.gather(*(asyncio.to_thread(_read_run, run, hashed) for run in runs))
        return read

    try:
        def store() -> float:
            run.call(tier.delete(keys))
            seconds, ok = run.clocked(lambda: tier.put(items))
            if not all(ok):
                raise RuntimeError("disk tier refused a write")
            return seconds

        def store_raw() -> float:
            _unlink_all(paths)
            return run.clocked(write_raw)[0]

        samples = interleave({"kvtier": store, "raw": store_raw}, s.disk_repeats, s.warmup)
        run.record("disk", "store", chunk_bytes, n, samples, "os.write new files (+fsync)", fsync=fsync, **extra)
        if fsync != s.fsync[0]:
            return  # loads do not depend on the write mode: measured once
        tier_paths = [tier.layout.path(k) for k in keys]
        for cache in ("warm", "cold"):
            _bench_disk_load(run, tier, keys, tier_paths, paths,
                             {"files": read_raw, **{f"loops{n}": read_raw_loops(n) for n in RAW_READ_LOOPS}},
                             {f"hashed{n}": read_raw_loops(n, hashed=True) for n in RAW_READ_LOOPS},
                             chunk_bytes, cache, extra)
        got = run.call(tier.get(keys[:1]))[0]
        if got is None or not same_bytes(got, src[0]) or not same_bytes(bufs[-1], src[-1]):
            raise RuntimeError("disk round trip returned different bytes")
    finally:
        run.call(tier.close())


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """``items`` in at most ``parts`` consecutive runs of (nearly) equal length."""
    size = max(1, -(-len(items) // parts))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _read_run(run: list[tuple[str, torch.Tensor]], hashed: bool = False) -> None:
    """Read each file into its buffer; ``hashed``: xxh3-64 each right after its read (kvtier's read check)."""
    for path, buf in run:
        raw_read(path, buf)
        if hashed:
            xxhash.xxh3_64_intdigest(buf.view(torch.uint8).numpy().data)


RAW_READ_LOOPS = sorted({1, 2, READ_STREAMS})  # plain read loops in this many threads, beside one thread per file


def _bench_disk_load(run: Runner, tier: Any, keys: list[bytes], tier_paths: list[str], paths: list[str],
                     read_raw: dict[str, Any], read_hashed: dict[str, Any], chunk_bytes: int, cache: str,
                     extra: dict[str, Any]) -> None:
    """Warm or cold ``get`` against the fastest, round by round, of several plain ways to read the same files:
    one ``to_thread`` per file, and 1, 2 or ``READ_STREAMS`` threads each reading a run of files in a loop (on
    2 cores, one or two loops are fastest for page-cached files; for uncached ones more reads in flight win on
    some devices). Second baseline (``raw_alt``): the same loops, each file hashed right after its read, so
    that the cost of the checksum every kvtier read verifies shows apart from the tier's own overhead."""
    cold = cache == "cold"
    held: list[Any] = []

    def load() -> float:
        held.clear()
        if cold:
            drop_page_cache(tier_paths)
        seconds, out = run.clocked(lambda: tier.get(keys))
        if any(t is None for t in out):
            raise RuntimeError("disk tier missed a record it holds")
        held.append(out)
        return seconds

    def plain(read: Any) -> Any:
        def measure() -> float:
            if cold:
                drop_page_cache(paths)
            return run.clocked(read)[0]
        return measure

    s = run.settings
    samples = interleave({"kvtier": load, **{name: plain(read) for name, read in {**read_raw, **read_hashed}.items()}},
                         s.disk_repeats, s.warmup)
    samples["raw"] = [min(round_) for round_ in zip(*(samples[name] for name in read_raw), strict=True)]
    samples["hashed"] = [min(round_) for round_ in zip(*(samples[name] for name in read_hashed), strict=True)]
    nbytes = chunk_bytes * len(keys)
    each = {name: round(Spread.of([gbps(nbytes, x) for x in samples[name]]).median, 3)
            for name in (*read_raw, *read_hashed)}
    loops = "/".join(str(n) for n in RAW_READ_LOOPS)
    run.record("disk", "load", chunk_bytes, len(keys), samples,
               f"readinto pre-touched buffers, best of one thread per file and {loops} reading loops",
               cache=cache, raw_gbps_each=each,
               alt=("hashed", f"the same reads + xxh3 of each file (kvtier's read check), best of {loops} loops"),
               **{**extra, "threads": (f"page-cache pass in one call, then up to {READ_STREAMS} reading loops"
                                       if chunk_bytes < SMALL_RECORD else f"{READ_STREAMS} reading loops per get")})


def redis_context(settings: Settings) -> contextlib.AbstractContextManager[str]:
    """The Redis to measure: ``--redis-url`` (reachable, else a KvtierError naming it), or a private server on a
    free loopback port (``redis-server`` on PATH, else a KvtierError)."""
    if settings.redis_url:
        _check_reachable(settings.redis_url)
        return contextlib.nullcontext(settings.redis_url)
    if shutil.which("redis-server") is None:
        raise KvtierError("--tiers redis: redis-server is not on PATH (apt-get install redis-server), or give "
                          "--redis-url URL, or drop redis from --tiers")
    return redis_server(maxmemory=f"{max(1 << 30, 4 * settings.batch_bytes)}")


def _check_reachable(url: str) -> None:
    """Raise a one-line KvtierError when nothing accepts a connection at ``url``'s host and port."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return  # a socket path: redis-py says what is wrong with it
    try:
        host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    except ValueError as exc:
        raise KvtierError(f"--redis-url: {url} is not a Redis URL ({exc}): give redis://HOST:PORT/DB") from None
    try:
        socket.create_connection((host, port), timeout=5.0).close()
    except OSError as exc:
        raise KvtierError(f"--redis-url: cannot reach {url} ({exc.strerror or exc}): start Redis there, or drop "
                          "redis from --tiers") from None


def bench_redis(run: Runner, url: str, chunk_bytes: int) -> None:
    """Redis tier ``put`` / ``get`` against redis-py pipelined SET / GET of the same bytes."""
    import redis

    from kvtier.config import RedisTierConfig
    from kvtier.tiers.redis.tier import RedisTier

    s = run.settings
    n = s.chunks(chunk_bytes)
    src = chunk_views(touched(n * chunk_bytes), chunk_bytes)
    keys = make_keys(f"redis:{chunk_bytes}", n)
    items = list(zip(keys, src, strict=True))
    tier = RedisTier(RedisTierConfig(name="redis", capacity=1 << 40, url=url, timeout=30.0, connect_timeout=5.0))
    run.call(tier.start())
    client = redis.Redis.from_url(url)
    raw_keys = [b"bench-raw:" + k.hex().encode() for k in keys]
    views = [c.view(torch.uint8).numpy().data for c in src]
    bufs = chunk_views(pretouch(torch.empty(n * chunk_bytes, dtype=torch.uint8)), chunk_bytes)
    resp = RawResp(url)
    held: list[Any] = []
    try:
        def store() -> float:
            run.call(tier.delete(keys))
            seconds, ok = run.clocked(lambda: tier.put(items))
            if not all(ok):
                raise RuntimeError("redis tier refused a write")
            return seconds

        def store_raw() -> float:
            client.delete(*raw_keys)
            return _timed_pipeline(client, [("set", k, v) for k, v in zip(raw_keys, views, strict=True)])[0]

        def store_socket() -> float:
            client.delete(*raw_keys)
            return timed(lambda: resp.set_many(raw_keys, views))

        samples = interleave({"kvtier": store, "raw": store_raw, "socket": store_socket}, s.repeats, s.warmup)
        run.record("redis", "store", chunk_bytes, n, samples, "redis-py pipelined SET (hiredis)",
                   alt=("socket", "RESP SET frames on one plain socket"))

        def load() -> float:
            held.clear()
            seconds, out = run.clocked(lambda: tier.get(keys))
            if any(t is None for t in out):
                raise RuntimeError("redis tier missed a record it holds")
            held.append(out)
            return seconds

        def load_raw() -> float:
            seconds, values = _timed_pipeline(client, [("get", k) for k in raw_keys])
            if any(v is None or len(v) != chunk_bytes for v in values):
                raise RuntimeError("raw GET missed a value")
            return seconds

        def load_socket() -> float:
            return timed(lambda: resp.get_many(raw_keys, bufs))

        samples = interleave({"kvtier": load, "raw": load_raw, "socket": load_socket}, s.repeats, s.warmup)
        run.record("redis", "load", chunk_bytes, n, samples, "redis-py pipelined GET (hiredis)",
                   alt=("socket", "RESP GET into pre-touched buffers on one plain socket"),
                   verified=bool(held) and same_bytes(held[0][0], src[0]) and same_bytes(bufs[-1], src[-1]))
    finally:
        resp.close()
        client.delete(*raw_keys)
        run.call(tier.delete(keys))
        run.call(tier.close())
        client.close()


class RawResp:
    """Pipelined SET / GET as RESP frames on one plain socket: the loopback + redis-server limit."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = cast(io.BufferedReader, self.sock.makefile("rb", buffering=1 << 20))

    def set_many(self, keys: list[bytes], values: list[memoryview]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, value.nbytes))
            self.sock.sendall(value)
            self.sock.sendall(b"\r\n")
        for _ in keys:
            if self.reader.readline() != b"+OK\r\n":
                raise RuntimeError("SET failed")

    def get_many(self, keys: list[bytes], outs: list[torch.Tensor]) -> None:
        self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys))
        for out in outs:
            view = out.view(torch.uint8).numpy().data.cast("B")
            if self.reader.readline() != b"$%d\r\n" % view.nbytes:
                raise RuntimeError("GET returned a different length")
            got = 0
            while got < view.nbytes:
                n = self.reader.readinto(view[got:])
                if not n:
                    raise RuntimeError("connection closed")
                got += n
            self.reader.read(2)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def _timed_pipeline(client: Any, commands: list[tuple[Any, ...]]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for name, *cmd_args in commands:
        getattr(pipe, name)(*cmd_args)
    values = pipe.execute()
    return time.perf_counter() - t0, values


def bench_transfer(run: Runner, chunk_bytes: int) -> None:
    """``gather`` / ``scatter`` between paged Llama-shaped layers and payloads, against a contiguous copy."""
    from kvtier.kvcopy.transfer import KVLayout, gather, scatter

    s = run.settings
    layers, block, heads, head = s.transfer_layers, 16, 8, 128
    block_bytes = layers * 2 * block * heads * head * 2  # one block over all layers, bf16
    if chunk_bytes % block_bytes:
        return  # chunks smaller than a block have no paged layout
    bpc = chunk_bytes // block_bytes
    n = s.chunks(chunk_bytes)
    num_blocks = n * bpc + 1  # block 0 is the null block
    shape = (2, num_blocks, block, heads, head)
    paged = [touched(2 * num_blocks * block * heads * head * 2).view(torch.bfloat16).view(shape)
             for _ in range(layers)]
    order = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    block_ids = [order[i * bpc:(i + 1) * bpc] for i in range(n)]
    out = pretouch(torch.empty((n, layers, 2, bpc * block, heads, head), dtype=torch.bfloat16))
    flat_out = out.view(-1).view(torch.uint8)
    other = touched(flat_out.numel())

    def do_gather() -> float:
        return timed(lambda: gather(paged, block_ids, KVLayout.KV_FIRST, out=out), "cpu")

    def do_scatter() -> float:
        return timed(lambda: scatter(paged, block_ids, KVLayout.KV_FIRST, out), "cpu")

    def raw_in() -> float:
        return timed(lambda: flat_out.copy_(other), "cpu")

    def raw_out() -> float:
        return timed(lambda: other.copy_(flat_out), "cpu")

    extra: dict[str, Any] = {"layers": layers, "blocks_per_chunk": bpc, "device": "cpu"}
    samples = interleave({"kvtier": do_gather, "raw": raw_in}, s.repeats, s.warmup)
    run.record("transfer", "gather", chunk_bytes, n, samples, "contiguous copy_ of the same bytes", **extra)
    samples = interleave({"kvtier": do_scatter, "raw": raw_out}, s.repeats, s.warmup)
    run.record("transfer", "scatter", chunk_bytes, n, samples, "contiguous copy_ of the same bytes", **extra)
