"""``kvtier check --probe``: try each tier of a config against this host, the way the engine would use it.

* disk: create (if missing, as the tier would) the tier's directory, write, fsync and remove a file in it, then
  remove the directories the probe created;
* redis: connect with the configured credentials, TLS and timeouts and PING (a cluster: CLUSTER INFO must say
  ``cluster_state:ok`` and every node must answer PING), reporting the round-trip time;
* gpu: the device exists (``torch`` is imported only here, and only when a gpu tier is configured);
* capacities against the host (``kvtier.ops.probe_host``): memory tiers reserved as at start, then against RAM and
  GPU memory, disk quotas against the free space of their file system, a Redis tier against the server's
  ``maxmemory``.

Each probe gives :class:`Finding`\\ s: ``ok``, ``warn`` (the config would take more than the host has; kvtier
still starts) or ``fail`` (the tier cannot start or work here), each naming the config key to look at.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import DiskTierConfig, GpuTierConfig, KvtierConfig, RedisTierConfig
from kvtier.config.parse import format_size
from kvtier.tiers.redis.conf import RedisEndpoint, parse_endpoint

OK, WARN, FAIL = "ok", "warn", "fail"
DIR_MODE = 0o700  # what the disk tier creates its root with


@dataclass(frozen=True)
class Finding:
    """One probe result: ``path`` is the config key it is about (``tiers[1].url``)."""

    path: str
    tier: str
    level: str
    message: str
    seconds: float | None = None


def probe(cfg: KvtierConfig, env: Mapping[str, str] | None = None) -> list[Finding]:
    """Probe every tier of ``cfg`` and its capacities against this host; ``env`` supplies Redis passwords
    (``password_env``; default ``os.environ``, as the engine reads them)."""
    from kvtier.ops.probe_host import host_capacity

    env = os.environ if env is None else env
    findings: list[Finding] = []
    gpus: list[tuple[str, GpuTierConfig]] = []
    for i, tier in enumerate(cfg.tiers):
        path = f"tiers[{i}]"
        if isinstance(tier, DiskTierConfig):
            findings.append(probe_disk(tier, path))
        elif isinstance(tier, RedisTierConfig):
            findings.extend(probe_redis(tier, path, env))
        elif isinstance(tier, GpuTierConfig):
            gpus.append((path, tier))
    if gpus:
        from kvtier.ops.probe_host import probe_gpus

        findings.extend(probe_gpus(gpus))
    findings.extend(host_capacity(cfg))
    return findings


# ---- disk --------------------------------------------------------------------------------------------------
def probe_disk(section: DiskTierConfig, path: str) -> Finding:
    """Create (if missing) ``section.path``, write and remove a file there; remove what the probe created."""
    key, root = f"{path}.path", Path(section.path)
    created: list[Path] = []
    start = time.perf_counter()
    try:
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(root))
        created = _make_dirs(root)
        fd, name = tempfile.mkstemp(prefix=".kvtier-probe-", dir=root)
        try:
            os.write(fd, b"kvtier probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return Finding(key, section.name, FAIL, _disk_error(key, root, exc))
    finally:
        for made in created:
            try:
                made.rmdir()
            except OSError:
                pass
    note = " (created it, then removed it again)" if created else ""
    return Finding(key, section.name, OK, f"wrote and removed a file in {root}{note}", time.perf_counter() - start)


def _make_dirs(root: Path) -> list[Path]:
    """``mkdir -p root`` (mode 0700, as the disk tier); return the directories created, deepest first."""
    missing: list[Path] = []
    at = root
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    created: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir(DIR_MODE)
            created.insert(0, d)
    except OSError:
        for d in created:
            d.rmdir()
        raise
    return created


def _disk_error(key: str, root: Path, exc: OSError) -> str:
    """One line: what failed at ``root`` and how to fix it."""
    where = exc.filename or root
    code = exc.errno
    if code in (errno.EACCES, errno.EPERM):
        return (f"cannot write in {where}: permission denied (make it writable by user {_user()}, "
                f"or set {key} to a directory it can write)")
    if code == errno.EROFS:
        return f"cannot write in {where}: read-only file system (set {key} to a writable directory)"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write in {where}: no space left on the device (free some space or set {key} elsewhere)"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return (f"cannot create {root}: {where} or one of its parents is a regular file, not a directory "
                f"(set {key} to a directory path)")
    return f"cannot write in {where}: {exc.strerror or exc} (set {key} to a writable directory)"


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())


# ---- redis -------------------------------------------------------------------------------------------------
def probe_redis(section: RedisTierConfig, path: str, env: Mapping[str, str]) -> list[Finding]:
    """PING a standalone server, or every node of a cluster; a warning when the server's ``maxmemory`` is
    below the tier's capacity (standalone only)."""
    from redis.exceptions import RedisError

    key = f"{path}.url"
    endpoint = parse_endpoint(section, env)
    try:
        if endpoint.cluster:
            return [_probe_cluster(section, key, endpoint)]
        host, port = endpoint.hosts[0]
        client = _client(section, endpoint, host, port)
        try:
            seconds = _ping(client)
            found = [Finding(key, section.name, OK, f"PING {host}:{port}: {seconds * 1000:.2f} ms", seconds)]
            return found + _maxmemory(section, f"{path}.capacity", client)
        finally:
            client.close()
    except (RedisError, OSError) as exc:
        return [Finding(key, section.name, FAIL, _redis_error(section, key, endpoint, exc))]


def _client(section: RedisTierConfig, endpoint: RedisEndpoint, host: str, port: int) -> Any:
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Redis(host=host, port=port, db=endpoint.db, retry=Retry(NoBackoff(), 0),
                 **endpoint.redis_kwargs(section))


def _ping(client: Any) -> float:
    """Connect (and authenticate) with one PING, then time a second one."""
    client.ping()
    start = time.perf_counter()
    client.ping()
    return time.perf_counter() - start


def _probe_cluster(section: RedisTierConfig, key: str, endpoint: RedisEndpoint) -> Finding:
    """CLUSTER INFO on the first seed that answers, then PING every node CLUSTER NODES lists."""
    from redis.exceptions import RedisError

    seed, last = None, None
    for host, port in endpoint.hosts:
        try:
            seed = _client(section, endpoint, host, port)
            _ping(seed)
            break
        except (RedisError, OSError) as exc:
            seed, last = None, exc
    if seed is None:
        assert last is not None
        raise last
    try:
        info = _text(seed.execute_command("CLUSTER", "INFO"))
        nodes = _cluster_nodes(_text(seed.execute_command("CLUSTER", "NODES")))
    finally:
        seed.close()
    if "cluster_state:ok" not in info:
        state = next((line for line in info.splitlines() if line.startswith("cluster_state")), "no cluster_state")
        return Finding(key, section.name, FAIL, f"cluster is not ok ({state.strip()}); check its nodes with "
                       f"redis-cli --cluster check {endpoint.hosts[0][0]}:{endpoint.hosts[0][1]}")
    slowest = 0.0
    for host, port in nodes:
        client = _client(section, endpoint, host, port)
        try:
            slowest = max(slowest, _ping(client))
        except (RedisError, OSError) as exc:
            return Finding(key, section.name, FAIL, f"cluster node {host}:{port}: "
                           f"{_redis_error(section, key, endpoint, exc)}")
        finally:
            client.close()
    return Finding(key, section.name, OK, f"cluster_state:ok, {len(nodes)} nodes answered PING "
                   f"(slowest {slowest * 1000:.2f} ms)", slowest)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, dict):  # a client that parses CLUSTER INFO itself
        return "\n".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def _cluster_nodes(text: str) -> list[tuple[str, int]]:
    """(host, port) of every node in CLUSTER NODES output (``id ip:port@cport flags ...``)."""
    nodes = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        address = parts[1].split("@")[0].split(",")[0]
        host, _, port = address.rpartition(":")
        if host and port.isdigit() and int(port):
            nodes.append((host.strip("[]"), int(port)))
    return nodes


def _maxmemory(section: RedisTierConfig, key: str, client: Any) -> list[Finding]:
    limit = int(client.info("memory").get("maxmemory", 0) or 0)
    if limit and section.capacity > limit:
        return [Finding(key, section.name, WARN, f"{format_size(section.capacity)} is more than the server's "
                        f"maxmemory {format_size(limit)}: the server evicts first (lower capacity or raise "
                        f"maxmemory)")]
    return []


def _redis_error(section: RedisTierConfig, key: str, endpoint: RedisEndpoint, exc: BaseException) -> str:
    """One line: authentication, timeout or connection failure, with the fix."""
    from redis.exceptions import AuthenticationError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeout

    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, AuthenticationError) or (isinstance(exc, ResponseError) and
                                                 ("NOAUTH" in text or "WRONGPASS" in text)):
        return (f"authentication failed for {key} {endpoint.url} ({text}); check the URL's user/password "
                f"or ${section.password_env}")
    if isinstance(exc, RedisTimeout | TimeoutError):
        return (f"no answer from {endpoint.url} within {section.connect_timeout + section.timeout:g} s "
                f"(check {key} and the timeouts)")
    return f"cannot reach {endpoint.url} ({text}); is redis-server running there? (check {key})"
