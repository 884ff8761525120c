"""The Redis tier: one key per record, shared by every engine and host that points at the same Redis.

Lifecycle: ``RedisTier(section)`` -> ``await start()`` (connects, checks credentials: a wrong password raises
``TierUnavailable`` naming the tier; an unreachable server only logs, its calls are misses until it answers)
-> ``contains`` / ``get`` / ``put`` / ``delete`` -> ``await close()``.

Keys are ``{key_prefix}:{namespace digest hex}:{chunk hash hex}``; values are ``kvtier.records.codec`` records. A record
of 4 MiB or more is stored in parts of 2-4 MiB, the head under that key and part k under ``{<key>}:k`` (same
cluster slot), because Redis's allocator makes values above 8 MiB cost about three times more server CPU
(``.bulk`` has the details). Small commands (EXISTS, DEL, PING) and cluster routing use redis-py. Record
values move over kvtier's own RESP connections (``.resp``): read straight into the result tensor (buffers
recycled by ``kvtier.tiers.memory.recycle``), written with scatter-gather, spread over ``connections``
sockets per server (per cluster node). With ``rediss://`` everything goes through redis-py (``.plain``), in the
same layout.

Failures never reach the caller: a timeout, a connection error or a server error is a miss (``False`` /
``None``), counted in ``stats()`` (``errors``, ``timeouts``; ``kvtier.control.metrics.RedisStats``: breaker state /
opens / rejected calls, server error replies, slot-map reloads). ``timeout`` bounds a whole EXISTS / DEL round
and, for record transfers (which may move gigabytes), every wait for the server without progress. A circuit
breaker stops calling a server after ``breaker_failures`` consecutive failures: calls then miss at once, and one
probe goes through after ``breaker_backoff`` seconds (doubling up to 30 s while the probes fail). Connections are
re-opened as needed. Corrupt or foreign values (another key, another namespace, a bad checksum or signature) are
misses, deleted and counted in ``stats().corrupt``.

A private tier (``private: true``, no ``ttl``: no other engine uses this Redis) is tracked by the directory as a
local tier is: ``start`` lists the records the server holds (``entries``, the catalog's scan), lookups ask the
server nothing, and the directory keeps it within ``capacity`` by choosing victims, which are deleted here. A record
the server dropped behind the directory (``maxmemory`` eviction, a flush, a restart) reads as a miss.

Capacity of a shared tier: kvtier does not own Redis memory. ``used_bytes`` is what this process wrote and did not
delete (TTL expiry and other writers are invisible to it), a report only: puts are not refused because of it, and
may take it above ``capacity``; only a single record larger than ``capacity`` is refused. Bound the server
instead::

    maxmemory 64gb
    maxmemory-policy allkeys-lru   # evict least recently used records when full; never refuse writes
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from redis.exceptions import RedisError

from kvtier.config import RedisTierConfig
from kvtier.control.metrics import RedisStats, Timer
from kvtier.errors import TierUnavailable
from kvtier.layout import dtype_name
from kvtier.records import codec
from kvtier.records.keys import Key
from kvtier.tiers.base import Tier, TierEntry
from kvtier.tiers.memory.recycle import Recycler, Slots
from kvtier.tiers.redis import plain as redis_plain
from kvtier.tiers.redis.breaker import CircuitBreaker
from kvtier.tiers.redis.bulk import GetResult, get_records, record_commands, set_records
from kvtier.tiers.redis.catalog import RedisSource, scan_entries
from kvtier.tiers.redis.client import RedisEndpoint, make_client, parse_endpoint
from kvtier.tiers.redis.resp import RespError, RespPool

log = logging.getLogger(__name__)
T = TypeVar("T")
Addr = tuple[str, int]


class RedisTier(Tier):
    """Redis standalone or Redis Cluster. See the module docstring."""

    is_shared = True
    _stats: RedisStats

    def __init__(self, section: RedisTierConfig, hmac_key: bytes | None = None, *,
                 env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic,
                 buffer_pool_bytes: int = 512 << 20) -> None:
        super().__init__(section.name, section.capacity)
        self._stats = RedisStats()
        self.section = section
        self._env = os.environ if env is None else env
        self.endpoint: RedisEndpoint = parse_endpoint(section, self._env)
        self._hmac_key = hmac_key
        self.breaker = CircuitBreaker(section.breaker_failures, section.breaker_backoff,
                                      max_backoff=max(30.0, section.breaker_backoff), clock=clock)
        self._client: Any = None  # redis.asyncio.Redis or RedisCluster
        self._pools: dict[Addr, RespPool] = {}
        self._sizes: dict[Key, int] = {}
        self._used = 0
        self._px = int(section.ttl * 1000) if section.ttl else None
        self.expiring = self._px is not None
        self._max_raw = codec.DEFAULT_MAX_RAW  # not the capacity: a small reader must not reject big records
        self.buffers = Recycler(buffer_pool_bytes)
        self._fast = not self.endpoint.tls  # raw sockets cannot speak TLS; rediss:// uses redis-py only
        # private (no other engine uses it) and not expiring: the directory tracks it as it does a local tier
        self.is_shared = not section.private or self.expiring
        self._listed: list[TierEntry] = []  # what the server held at start (a private tier's list_entries)
        self._own: set[bytes] | None = None  # the namespaces this process serves (describe); None: never described
        self._answered = False  # the server answered at start
        self._stop = threading.Event()  # ends a listing still running when the tier closes

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and check the credentials. Raises ``TierUnavailable`` on authentication failure only."""
        from redis.exceptions import AuthenticationError, RedisError, ResponseError

        self._client = self._make_client()
        self._stop = threading.Event()  # a new one: a listing left from an earlier start keeps the set one
        self._answered = False
        try:
            async with asyncio.timeout(self.section.connect_timeout + self.section.timeout):
                if self.endpoint.cluster:
                    await self._client.initialize()
                await self._client.ping()
        except (AuthenticationError, ResponseError) as exc:
            text = str(exc)
            if not (isinstance(exc, AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text):
                log.warning("redis tier %r: %s answered %s at start", self.name, self.endpoint.url, text)
                return
            await self.close()
            raise TierUnavailable(f"redis tier {self.name!r} at {self.endpoint.url}: authentication failed "
                                  f"({text}); check the URL's user/password or ${self.section.password_env}") from None
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("redis tier %r: %s not reachable at start (%s); its calls are misses until it answers",
                        self.name, self.endpoint.url, type(exc).__name__)
            self.breaker.failure()
            return
        self._answered = True

    async def list_entries(self) -> None:
        """A private tier whose server answered at start: list the records it holds, for the directory to adopt
        (``entries``: this process's namespaces, up to ``capacity``). The listing deletes nothing: a record past
        the capacity, an unreadable one (another deployment's key, a torn write) and those a failed scan did not
        reach stay on the server, never read, so the first that ``allkeys-lru`` evicts. A listing the tier's
        ``close`` stopped keeps nothing."""
        if self.is_shared or not self._answered:
            return
        log.info("redis tier %r: listing the records on %s", self.name, self.endpoint.url)
        t0, stop = time.monotonic(), self._stop
        listing = await asyncio.to_thread(scan_entries, RedisSource(self.section, self._env), stop)
        if stop.is_set():  # closed meanwhile (and maybe started again, with a listing of its own)
            return
        if listing.error:
            log.warning("redis tier %r: listing the records on %s stopped (%s); those not listed are misses",
                        self.name, self.endpoint.url, listing.error)
        self._listed = listing.entries
        log.info("redis tier %r: %d record(s) on %s (%.1f s), %d of them this engine's within its capacity; %d "
                 "unreadable left to the server's eviction", self.name, len(listing.entries), self.endpoint.url,
                 time.monotonic() - t0, len(self.entries()), len(listing.bad))

    def _mine(self, key: Key) -> bool:
        return self._own is None or key[:16] in self._own

    def entries(self) -> list[TierEntry]:
        """A private tier: the records of this process's namespaces (all until ``describe`` names them) the server
        held at start (``list_entries``), in the order listed, up to ``capacity``; a shared tier lists none."""
        kept: list[TierEntry] = []
        total = 0
        for entry in self._listed:
            if self._mine(entry.key) and total + entry.size <= self.capacity_bytes:
                kept.append(entry)
                total += entry.size
        return kept

    def _make_client(self) -> Any:
        """redis.asyncio's client; no retries: the breaker, not redis-py, decides when to try again."""
        return make_client(self.endpoint, self.section, max_connections=self.section.pool_size)

    async def close(self) -> None:
        self._stop.set()  # a scan still running ends after its current batch
        self._listed, self._answered = [], False
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await client.aclose()
            except Exception as exc:  # closing a broken connection must not fail shutdown
                log.debug("redis tier %r: close: %r", self.name, exc)

    # -- contract ----------------------------------------------------------------------------------------------

    def redis_key(self, key: Key) -> bytes:
        """The Redis key of a record: ``{prefix}:{namespace digest hex}:{chunk hash hex}``."""
        return f"{self.section.key_prefix}:{key[:16].hex()}:{key[16:].hex()}".encode()

    async def contains(self, keys: Sequence[Key]) -> list[bool]:
        self._stats.lookups += len(keys)
        if not keys:
            return []
        found = await self._guarded(lambda: self._small(redis_plain.exists(self._client, self._names(keys))), None)
        out = found if found is not None else [False] * len(keys)
        self._stats.hits += sum(out)
        return out

    async def get(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        self._stats.gets += len(keys)
        if not keys:
            return []
        with Timer(self._stats, "get_seconds"):
            result = await self._guarded(lambda: self._get(keys), None)
        if result is None:
            return [None] * len(keys)
        corrupt = sorted(set(result.corrupt))
        if corrupt:
            self._stats.corrupt += len(corrupt)
            log.warning("redis tier %r: %d corrupt or foreign record(s) deleted", self.name, len(corrupt))
            await self.delete([keys[i] for i in corrupt])
        await self._server_errors(result.errors)
        hits = [v for v in result.values if v is not None]
        self._stats.get_hits += len(hits)
        self._stats.bytes_out += sum(v.nbytes for v in hits)
        return result.values

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        ok = [False] * len(items)
        todo: list[tuple[int, Key, list[Any], int, int]] = []
        for i, (key, tensor) in enumerate(items):
            parts, size = self._encode(key, tensor)
            previous = self._sizes.get(key, 0)
            if parts is None or not self._reserve(key, size):
                self._stats.puts_refused += 1
                continue
            todo.append((i, key, parts, size, previous))
        if not todo:
            return ok
        with Timer(self._stats, "put_seconds"):
            stored = await self._guarded(lambda: self._put([(self.redis_key(t[1]), t[2]) for t in todo]), None)
        for j, (i, key, _, size, previous) in enumerate(todo):
            ok[i] = bool(stored and stored[j])
            self._commit(key, size, previous, ok[i])
        return ok

    async def delete(self, keys: Sequence[Key]) -> int:
        if not keys:
            return 0
        totals = [self._sizes.pop(key, None) for key in keys]
        self._used -= sum(t for t in totals if t)
        removed = await self._guarded(
            lambda: self._small(redis_plain.delete_records(self._client, self._names(keys), totals)), None)
        n = sum(removed) if removed is not None else 0
        self._stats.deletes += n
        return n

    def used_bytes(self) -> int:
        return self._used

    def stored_size(self, nbytes: int) -> int:
        return codec.stored_size(nbytes, signed=bool(self._hmac_key), memory=False)

    def stats(self) -> RedisStats:
        """The tier's counters, with its breaker's state, openings and refused calls as of now."""
        b = self.breaker
        self._stats.breaker_state, self._stats.breaker_opens, self._stats.breaker_rejected = \
            int(b.state), b.opens, b.rejected
        return self._stats

    def describe(self, manifests: Mapping[bytes, Mapping[str, Any]]) -> None:
        """SET ``{key_prefix}:manifest:{namespace hex}`` per namespace for ``kvtier stats``, in the background; a
        private tier then lists only these namespaces' records (other ranks' and other models' are not its)."""
        from kvtier.tiers.redis.catalog import publish

        self._own = (self._own or set()) | {bytes(d) for d in manifests}
        publish(self.name, self.endpoint, self.section, manifests)

    # -- helpers -----------------------------------------------------------------------------------------------

    async def _guarded(self, op: Callable[[], Awaitable[T]], fallback: T) -> T:
        """Run ``op`` through the breaker; any failure is counted and becomes ``fallback``."""
        if self._client is None or not self.breaker.allow():
            return fallback
        try:
            result = await op()
        except TimeoutError:
            self._stats.timeouts += 1
            self.breaker.failure()
            log.debug("redis tier %r: timeout", self.name)
            return fallback
        except (OSError, RedisError, RespError) as exc:  # connection and server errors
            self._stats.errors += 1
            self.breaker.failure()
            log.debug("redis tier %r: %s: %s", self.name, type(exc).__name__, exc)
            return fallback
        except Exception:  # a bug, not an outage: still a miss, never the engine's problem, but say so
            self._stats.errors += 1
            self.breaker.failure()
            log.warning("redis tier %r: unexpected error", self.name, exc_info=True)
            return fallback
        except BaseException:  # cancelled: do not leave a half-open probe pending forever
            self.breaker.failure()
            raise
        self.breaker.success()
        return result

    def _names(self, keys: Sequence[Key]) -> list[bytes]:
        return [self.redis_key(k) for k in keys]

    async def _small(self, op: Awaitable[T]) -> T:
        """A round of small commands, bounded by ``timeout`` as a whole."""
        async with asyncio.timeout(self.section.timeout):
            return await op

    def _encode(self, key: Key, tensor: torch.Tensor) -> tuple[list[Any] | None, int]:
        try:
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            parts = codec.encode(key, flat.numpy(), dtype_name(tensor.dtype), tuple(tensor.shape),
                                 compression=self.section.compression, hmac_key=self._hmac_key)
        except (ValueError, TypeError, RuntimeError) as exc:
            log.warning("redis tier %r: cannot store a %s tensor: %s", self.name, tensor.dtype, exc)
            return None, 0
        return parts, sum(memoryview(p).nbytes for p in parts)

    def _reserve(self, key: Key, size: int) -> bool:
        """Count ``size`` bytes in ``used_bytes`` before writing; ``_commit`` settles it.

        The total never refuses a put: the server's ``maxmemory`` policy governs Redis memory, and TTL expiry
        or other writers free space this counter cannot see, so refusing on it would stop caching for good.
        Only a single record larger than ``capacity`` is refused (a tier never takes an item above its
        capacity), counted in ``puts_refused``."""
        if size > self.capacity_bytes:
            return False
        self._used += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        return True

    def _commit(self, key: Key, size: int, previous: int, ok: bool) -> None:
        """Settle a reservation: count a stored record, or give the bytes back (keeping what was there)."""
        if ok:
            self._stats.puts += 1
            self._stats.bytes_in += size
        elif self._sizes.get(key) == size:
            self._used += previous - self._sizes.pop(key)
            if previous:
                self._sizes[key] = previous

    # -- data path ---------------------------------------------------------------------------------------------

    async def _get(self, keys: Sequence[Key]) -> GetResult:
        names = [self.redis_key(k) for k in keys]
        if not self._fast:
            async with asyncio.timeout(self.section.timeout * (2 + len(names))):
                return await redis_plain.get_records(self._client, names, keys, max_raw=self._max_raw,
                                                     hmac_key=self._hmac_key)
        shards = await self._shards(names)
        slots = Slots(self.buffers, len(keys))  # the payloads evenly spaced in one buffer, across shards
        outs = await asyncio.gather(*(self._get_shard(addr, idx, names, keys, slots) for addr, idx in shards),
                                    return_exceptions=True)
        result = GetResult(values=[None] * len(keys))
        for idx, out in self._succeeded(shards, outs):
            for j, value in enumerate(out.values):
                result.values[idx[j]] = value
            result.corrupt += [idx[j] for j in out.corrupt]
            result.errors += out.errors
        return result

    async def _get_shard(self, addr: Addr, idx: list[int], names: list[bytes], keys: Sequence[Key],
                         slots: Slots) -> GetResult:
        async with self._pool(addr).connection() as conn:
            return await get_records(conn, [names[i] for i in idx], [keys[i] for i in idx],
                                     max_raw=self._max_raw, hmac_key=self._hmac_key, alloc=self.buffers.take,
                                     place=lambda j, n: slots.take(idx[j], n))

    async def _put(self, items: list[tuple[bytes, list[Any]]]) -> list[bool]:
        if not self._fast:
            async with asyncio.timeout(self.section.timeout * (1 + len(items))):
                replies = await redis_plain.put_records(self._client, items, self._px)
            await self._server_errors([r for r in replies if r is not None])
            return [r is None for r in replies]
        shards = await self._shards([name for name, _ in items])
        outs = await asyncio.gather(*(self._put_shard(addr, [items[i] for i in idx]) for addr, idx in shards),
                                    return_exceptions=True)
        ok = [False] * len(items)
        errors: list[str] = []
        for idx, out in self._succeeded(shards, outs):
            for j, flag in enumerate(out):
                ok[idx[j]] = flag is None
                errors += [flag] if flag is not None else []
        await self._server_errors(errors)
        return ok

    def _succeeded(self, shards: list[tuple[Addr, list[int]]], outs: Sequence[T | BaseException],
                   ) -> list[tuple[list[int], T]]:
        """The shards that worked. When only some failed (one cluster node down), the others' results stand
        and the failures are counted here; when all failed, the first failure is raised for the breaker."""
        failed = [out for out in outs if isinstance(out, BaseException)]
        bugs = [exc for exc in failed if not isinstance(exc, OSError | RespError | TimeoutError)]
        if bugs or (failed and len(failed) == len(outs)):
            raise (bugs or failed)[0]
        for exc in failed:
            if isinstance(exc, TimeoutError):
                self._stats.timeouts += 1
            else:
                self._stats.errors += 1
            log.debug("redis tier %r: one shard failed: %r", self.name, exc)
        return [(idx, out) for (_, idx), out in zip(shards, outs, strict=True) if not isinstance(out, BaseException)]

    async def _server_errors(self, errors: list[str]) -> None:
        """Count error replies; a MOVED / ASK means the cluster's slots moved: reload the slot map."""
        if not errors:
            return
        self._stats.server_errors += len(errors)
        log.debug("redis tier %r: %d error replies, first: %s", self.name, len(errors), errors[0])
        if self.endpoint.cluster and any(e.startswith(("MOVED", "ASK")) for e in errors):
            self._stats.slot_refreshes += 1
            try:
                async with asyncio.timeout(self.section.connect_timeout):
                    await self._client.nodes_manager.initialize()
            except Exception as exc:  # the next call will find out again
                log.debug("redis tier %r: slot map reload failed: %r", self.name, exc)

    async def _put_shard(self, addr: Addr, items: list[tuple[bytes, list[Any]]]) -> list[str | None]:
        async with self._pool(addr).connection() as conn:
            return await set_records(conn, [record_commands(name, parts, self._px) for name, parts in items])

    async def _shards(self, names: Sequence[bytes]) -> list[tuple[Addr, list[int]]]:
        """Split a batch per server (cluster node), then over up to ``connections`` sockets each."""
        groups: dict[Addr, list[int]] = {}
        if self.endpoint.cluster:
            await self._client.initialize()  # no-op once the slot map is known
            for i, name in enumerate(names):
                node = self._client.get_node_from_key(name)
                groups.setdefault((node.host, node.port), []).append(i)
        else:
            groups[self.endpoint.hosts[0]] = list(range(len(names)))
        out: list[tuple[Addr, list[int]]] = []
        for addr, idx in groups.items():
            k = max(1, min(self.section.connections, len(idx)))
            out += [(addr, idx[j::k]) for j in range(k)]
        return out

    def _pool(self, addr: Addr) -> RespPool:
        pool = self._pools.get(addr)
        if pool is None:
            ep = self.endpoint
            pool = self._pools[addr] = RespPool(addr[0], addr[1], self.section.connections,
                                                timeout=self.section.timeout,
                                                connect_timeout=self.section.connect_timeout,
                                                username=ep.username, password=ep.password, db=ep.db)
        return pool


__all__ = ["RedisTier"]
