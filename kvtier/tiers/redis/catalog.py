"""A Redis tier's records, read with redis-py (standalone, or every primary of a cluster), for the catalog.

Records are ``{key_prefix}:{namespace hex}:{chunk hash hex}`` (parts of large records: ``{<name>}:k``, see
``kvtier.tiers.redis.bulk``), manifests ``{key_prefix}:manifest:{namespace hex}``. Listing SCANs each server
(``MATCH``, ``COUNT 1000``) and reads each record's header with a pipelined ``GETRANGE`` (its size, dtype and
shape); when the tier has a ``ttl``, a record's write time is estimated from its ``PTTL`` (else unknown).
Connections ask for ``CLIENT NO-TOUCH`` (Redis 7.2+) so a scan does not refresh the records' LRU recency.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvtier.config import RedisTierConfig
from kvtier.errors import CorruptRecord, TierUnavailable
from kvtier.records.codec import HEADER_SIZE, decode_header
from kvtier.tiers.base import TierEntry
from kvtier.tiers.catalog import RecordInfo
from kvtier.tiers.manifest import Manifest, parse, redis_name
from kvtier.tiers.redis.client import RedisEndpoint, make_client, parse_endpoint

BATCH = 1000
MIN_TIMEOUT = 5.0  # seconds: an offline scan is not on a request's path; the tier's 50 ms would be too short

log = logging.getLogger(__name__)


def connect(endpoint: RedisEndpoint, section: RedisTierConfig, **extra: Any) -> Any:
    """A sync redis-py client (``Redis`` or ``RedisCluster``) with the tier's credentials and TLS settings, and
    redis-py's own retries (an offline tool has no breaker)."""
    slower = dataclasses.replace(section, timeout=max(section.timeout, MIN_TIMEOUT))
    return make_client(endpoint, slower, sync=True, retry=True, full_coverage=True, **extra)


def _no_touch(conn: Any) -> None:
    """On connect: do not let this connection's reads count as uses of the keys (ignored before Redis 7.2)."""
    from redis.exceptions import ResponseError

    conn.on_connect()
    try:
        conn.send_command("CLIENT", "NO-TOUCH", "ON")
        conn.read_response()
    except ResponseError:
        pass


class RedisSource:
    """Records of one Redis tier."""

    kind = "redis"

    def __init__(self, section: RedisTierConfig, env: Mapping[str, str] | None = None) -> None:
        import os

        self.name = section.name
        self.section = section
        self.endpoint = parse_endpoint(section, os.environ if env is None else env)
        self.location = self.endpoint.url
        self.prefix = section.key_prefix
        self._nodes: dict[str, Any] | None = None

    @contextmanager
    def _guard(self) -> Iterator[None]:
        from redis.exceptions import RedisError

        try:
            yield
        except (RedisError, OSError) as exc:
            raise TierUnavailable(f"{self.location}: {type(exc).__name__}: {exc}") from None

    def nodes(self) -> dict[str, Any]:
        """``host:port`` -> a client of that server (each primary of a cluster), connected on first use."""
        if self._nodes is None:
            with self._guard():
                hosts = list(self.endpoint.hosts)
                if self.endpoint.cluster:
                    cluster = connect(self.endpoint, self.section)
                    hosts = [(n.host, n.port) for n in cluster.get_primaries()]
                    cluster.close()
                single = dataclasses.replace(self.endpoint, cluster=False)
                nodes = {f"{h}:{p}": connect(dataclasses.replace(single, hosts=((h, p),)), self.section,
                                             redis_connect_func=_no_touch) for h, p in hosts}
                for client in nodes.values():
                    client.ping()
                self._nodes = nodes
        return self._nodes

    def _scan(self, match: str) -> Iterator[tuple[str, Any, list[bytes]]]:
        """(node, client, names) batches of the keys matching ``match`` on every server."""
        for ref, client in self.nodes().items():
            with self._guard():
                batch: list[bytes] = []
                for name in client.scan_iter(match=match, count=BATCH):
                    batch.append(name)
                    if len(batch) >= BATCH:
                        yield ref, client, batch
                        batch = []
                if batch:
                    yield ref, client, batch

    def manifests(self) -> dict[tuple[str, str], Manifest | None]:
        out: dict[tuple[str, str], Manifest | None] = {}
        start = len(f"{self.prefix}:manifest:")
        for _, client, names in self._scan(f"{self.prefix}:manifest:*"):
            with self._guard():  # one GET each: a cluster node refuses a multi-key command across slots
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                values = pipe.execute(raise_on_error=False)
            for name, value in zip(names, values, strict=True):
                out[("", name[start:].decode(errors="replace"))] = parse(value if isinstance(value, bytes) else None)
        return out

    def _key_of(self, name: bytes) -> bytes | None:
        parts = name.decode(errors="replace").rsplit(":", 2)  # the prefix may hold a colon itself
        if len(parts) != 3 or parts[0] != self.prefix or len(parts[1]) != 32 or len(parts[2]) != 32:
            return None
        try:
            return bytes.fromhex(parts[1] + parts[2])
        except ValueError:
            return None

    def records(self, namespace: str | None = None, headers: bool = True) -> Iterator[RecordInfo]:
        for ref, client, names in self._scan(f"{self.prefix}:{namespace or '*'}:*"):
            keyed = [(n, k) for n in names if (k := self._key_of(n)) is not None]
            with self._guard():
                pipe = client.pipeline(transaction=False)
                for name, _ in keyed:
                    pipe.getrange(name, 0, HEADER_SIZE - 1)
                    pipe.pttl(name)
                replies = pipe.execute(raise_on_error=False)
            now = time.time()
            for i, (_, key) in enumerate(keyed):
                record = self._record(key, ref, replies[2 * i], replies[2 * i + 1], now)
                if record is not None:
                    yield record

    def _record(self, key: bytes, ref: str, head: Any, pttl: Any, now: float) -> RecordInfo | None:
        if isinstance(head, Exception):
            return RecordInfo(key, 0, None, "", ref, error=str(head))
        if not head:
            return None  # expired or deleted since the scan saw it
        mtime = None
        if self.section.ttl and isinstance(pttl, int) and pttl >= 0:
            mtime = now - (self.section.ttl - pttl / 1000)
        try:
            header = decode_header(head, expected_key=key)
        except CorruptRecord as exc:
            return RecordInfo(key, len(head), mtime, "", ref, error=str(exc))
        return RecordInfo(key, header.total_len, mtime, "", ref, header)

    def detail(self, record: RecordInfo) -> RecordInfo:
        """Listed records already carry their header."""
        return record

    def name_of(self, key: bytes) -> bytes:
        return f"{self.prefix}:{key[:16].hex()}:{key[16:].hex()}".encode()

    def read(self, key: bytes) -> list[tuple[RecordInfo, bytes]]:
        from redis.exceptions import ResponseError

        from kvtier.tiers.redis.bulk import part_name, parts_of

        name = self.name_of(key)
        for ref, client in self.nodes().items():
            with self._guard():
                try:
                    head = client.get(name)
                except ResponseError:  # MOVED: another node holds its slot
                    continue
                if head is None:
                    continue
                header = _header_or_none(head, key)
                total = header.total_len if header else len(head)
                rest = [client.get(part_name(name, k)) or b"" for k in range(1, len(parts_of(total)))] \
                    if total > len(head) else []
            data = b"".join([head, *rest])
            return [(RecordInfo(key, len(data), None, "", ref, header), data)]
        return []

    def delete(self, records: Sequence[RecordInfo]) -> tuple[int, int]:
        from kvtier.tiers.redis.bulk import part_name, parts_of

        count = size = 0
        by_node: dict[str, list[RecordInfo]] = {}
        for r in records:
            by_node.setdefault(r.ref, []).append(r)
        for ref, group in by_node.items():
            with self._guard():
                pipe = self.nodes()[ref].pipeline(transaction=False)
                for r in group:
                    name = self.name_of(r.key)
                    pipe.delete(*[part_name(name, k) for k in range(len(parts_of(r.size)) if r.header else 1)])
                replies = pipe.execute()
            for r, removed in zip(group, replies, strict=True):
                if removed:
                    count, size = count + 1, size + r.size
        return count, size

    def notes(self) -> list[str]:
        return []

    def close(self) -> None:
        for client in (self._nodes or {}).values():
            client.close()
        self._nodes = None


@dataclasses.dataclass
class Listing:
    """What a scan found: the sound records (key, stored size), the keys of unreadable ones, and why it stopped
    early (None: it listed everything)."""

    entries: list[TierEntry] = dataclasses.field(default_factory=list)
    bad: list[bytes] = dataclasses.field(default_factory=list)
    error: str | None = None


def scan_entries(source: RedisSource, stop: threading.Event) -> Listing:
    """Every record of a tier, each key once, listed in a worker thread (it blocks); ends early once ``stop`` is
    set or anything fails (``Listing.error``), with what it had."""
    out = Listing()
    seen: set[bytes] = set()  # SCAN may return a key more than once
    try:
        for record in source.records():
            if stop.is_set():
                out.error = "stopped"
                break
            if record.key in seen:
                continue
            seen.add(record.key)
            if record.error is None and record.header is not None:
                out.entries.append(TierEntry(record.key, record.size))
            else:
                out.bad.append(record.key)
    except Exception as exc:  # a listing is best effort: what it missed is a miss
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        source.close()
    return out


def _header_or_none(head: bytes, key: bytes) -> Any:
    try:
        return decode_header(head, expected_key=key)
    except CorruptRecord:
        return None


def publish(tier: str, endpoint: RedisEndpoint, section: RedisTierConfig,
            manifests: Mapping[bytes, Mapping[str, Any]]) -> threading.Thread | None:
    """SET each namespace's manifest key (``redis_name``) of the Redis tier named ``tier`` in the background (its
    own short-lived sync client, so it works from any thread, before or after the tier's ``start``); failures are
    logged once, never raised. Returns the thread."""
    items = {redis_name(section.key_prefix, ns.hex()): json.dumps(dict(m), sort_keys=True).encode()
             for ns, m in manifests.items()}
    if not items:
        return None
    thread = threading.Thread(target=_publish, args=(tier, endpoint, section, items), name="kvtier-redis-manifest",
                              daemon=True)
    thread.start()
    return thread


def _publish(tier: str, endpoint: RedisEndpoint, section: RedisTierConfig, items: Mapping[bytes, bytes]) -> None:
    try:
        client = connect(endpoint, section)
        try:
            for name, value in items.items():
                client.set(name, value)
        finally:
            client.close()
    except Exception as exc:  # a description is best effort: never the engine's problem
        log.warning("redis tier %r: could not write namespace manifests (%s: %s)", tier,
                    type(exc).__name__, exc)
