"""``kvtier check --probe``: try each tier of a config against this host, the way the engine would use it.

* disk: create (if missing, as the tier would) the tier's directory, write, fsync and remove a file in it, then
  remove the directories the probe created;
* redis: connect with the configured credentials, TLS and timeouts and PING (a cluster: CLUSTER INFO must say
  ``cluster_state:ok`` and every node must answer PING), reporting the round-trip time;
* gpu: the device exists (``torch`` is imported only here, and only when a gpu tier is configured);
* capacities against the host (below): memory tiers reserved as at start, then against RAM and
  GPU memory, disk quotas against the free space of their file system, a Redis tier against the server's
  ``maxmemory`` (0, unbounded, warns) and ``maxmemory-policy`` (one that does not evict warns);
* the record-signing key (``security.hmac_key_env``): set, and at least 16 bytes, as the engine requires.

Each probe gives :class:`Finding`\\ s: ``ok``, ``warn`` (the config would take more than the host has; kvtier
still starts) or ``fail`` (the tier cannot start or work here), each naming the config key to look at.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import (
    CpuTierConfig,
    DiskTierConfig,
    GpuTierConfig,
    KvtierConfig,
    RedisTierConfig,
    TierConfig,
    TierKind,
)
from kvtier.config.parse import format_size
from kvtier.errors import ConfigError
from kvtier.records.security import load_hmac_key
from kvtier.tiers.redis.client import RedisEndpoint, make_client, parse_endpoint

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
        findings.extend(probe_gpus(gpus))
    findings.extend(host_capacity(cfg))
    findings.extend(probe_signing(cfg, env))
    return findings


def probe_signing(cfg: KvtierConfig, env: Mapping[str, str]) -> list[Finding]:
    """The record-signing key the engine will read (``security.hmac_key_env``): set and long enough."""
    var = cfg.security.hmac_key_env
    if not var:
        return []
    try:
        key = load_hmac_key(cfg.security, env)
    except ConfigError as exc:
        problem = str(exc).removeprefix(f"{exc.path}: ")
        return [Finding(exc.path, "security", FAIL, f"{problem}: the engine will refuse to start")]
    return [Finding("security.hmac_key_env", "security", OK, f"${var} holds a signing key of {len(key or b'')} bytes")]


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
    return make_client(endpoint, section, sync=True, node=(host, port))


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


EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")  # maxmemory policies that make room for new records


def _maxmemory(section: RedisTierConfig, key: str, client: Any) -> list[Finding]:
    """Warnings when the server's memory is unbounded, below the tier's capacity, or full without evicting."""
    memory = client.info("memory")
    limit, policy = int(memory.get("maxmemory", 0) or 0), str(memory.get("maxmemory_policy", ""))
    found: list[Finding] = []
    if not limit:
        found.append(Finding(key, section.name, WARN, "the server's maxmemory is 0 (unbounded): kvtier's records "
                             "grow until the host runs out of memory (run Redis with maxmemory of at least "
                             f"{format_size(section.capacity)} and maxmemory-policy allkeys-lru)"))
    elif section.capacity > limit:
        found.append(Finding(key, section.name, WARN, f"{format_size(section.capacity)} is more than the server's "
                             f"maxmemory {format_size(limit)}: the server evicts first (lower capacity or raise "
                             f"maxmemory)"))
    volatile = policy.startswith("volatile-")
    if limit and policy and policy not in EVICTING and not (volatile and section.ttl):
        why = ("evicts only keys with an expiry, and kvtier's records have none without the tier's ttl" if volatile
               else "refuses new records once full instead of evicting old ones")
        found.append(Finding(key, section.name, WARN, f"the server's maxmemory-policy is {policy}: it {why} (set "
                             "maxmemory-policy allkeys-lru)"))
    return found


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


# -- the host: gpu devices, and capacities against RAM, GPU memory and free disk.
#
#
# Memory tiers (cpu, and gpu tiers on ``device: cpu``) reserve their address space here the way they do at start
# (a private anonymous mapping each, all held at once, never written, then released): a reservation the host
# refuses is a failure, the tier would not start. Then they are compared with ``MemAvailable`` of
# ``/proc/meminfo``: pinned (page-locked) cpu tiers are allocated whole at start, so more than that fails too;
# pageable ones are backed as they fill, so more than that is a warning (the host swaps or runs out later). Gpu
# tiers are allocated whole on their device: more than its free memory fails. Disk quotas (summed per file system)
# are compared with the space free to this user there (``os.statvfs``): more is a warning, a disk tier then fills
# its file system before its quota.

HUGE_PAGE = 2 << 20  # the slack a pageable pool maps beyond its capacity (kvtier.tiers.memory.arena.HUGE_PAGE)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty where there is none."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        return {}
    return out


def _keys(tiers: Sequence[tuple[int, TierConfig]]) -> str:
    return " + ".join(f"tiers[{i}].capacity" for i, _ in tiers)


def _names(tiers: Sequence[tuple[int, TierConfig]]) -> str:
    return ", ".join(t.name for _, t in tiers)


def host_capacity(cfg: KvtierConfig) -> list[Finding]:
    """Warnings where the config's memory tiers or disk quotas exceed what this host has."""
    findings = []
    memory = [(i, t) for i, t in enumerate(cfg.tiers) if t.kind is TierKind.CPU or
              (isinstance(t, GpuTierConfig) and t.device.startswith("cpu"))]
    if memory:
        findings.append(_ram(memory))
    by_fs: dict[int, list[tuple[int, DiskTierConfig]]] = {}
    for i, t in enumerate(cfg.tiers):
        if isinstance(t, DiskTierConfig):
            at = _existing(Path(t.path))
            by_fs.setdefault(os.stat(at).st_dev, []).append((i, t))
    findings.extend(_disk_space(tiers) for tiers in by_fs.values())
    return findings


def reserve(sizes: Sequence[int]) -> tuple[int, OSError] | None:
    """Reserve ``sizes`` bytes of address space at once, as pageable memory tiers do at start (nothing written,
    nothing made resident), then release them; the index of the first the host refuses, and why, or None."""
    held: list[mmap.mmap] = []
    try:
        for i, size in enumerate(sizes):
            try:
                held.append(mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
            except (OSError, OverflowError) as exc:
                return i, exc if isinstance(exc, OSError) else OSError(str(exc))
        return None
    finally:
        for m in held:
            m.close()


def _ram(tiers: Sequence[tuple[int, TierConfig]]) -> Finding:
    info = meminfo()
    want = sum(t.capacity for _, t in tiers)
    key, name = _keys(tiers), _names(tiers)
    have = (f"{format_size(info['MemAvailable'])} available of {format_size(info.get('MemTotal', 0))}, "
            f"swap {format_size(info.get('SwapTotal', 0))}") if "MemAvailable" in info else "RAM unknown"
    refused = reserve([t.capacity for _, t in tiers])
    if refused is not None:
        i, t = tiers[refused[0]]
        return Finding(f"tiers[{i}].capacity", t.name, FAIL, f"this host refuses to reserve "
                       f"{format_size(t.capacity)} for tier {t.name!r} ({refused[1].strerror or refused[1]}; "
                       f"{have}): the tier would not start; lower the capacity")
    if "MemAvailable" not in info:
        return Finding(key, name, WARN, "cannot read /proc/meminfo: memory capacity not checked")
    avail = info["MemAvailable"]
    if want <= avail:
        return Finding(key, name, OK, f"memory tiers take {format_size(want)} of RAM ({have})")
    pinned = _pinned(tiers)
    if sum(t.capacity for _, t in pinned) > avail:
        return Finding(_keys(pinned), _names(pinned), FAIL, f"pinned cpu tiers take "
                       f"{format_size(sum(t.capacity for _, t in pinned))}, allocated whole at start: more than "
                       f"this host's RAM ({have}), the tier would not start; lower the capacity or set pin_memory: "
                       f"false")
    return Finding(key, name, WARN, f"memory tiers take {format_size(want)}, more than this host's RAM ({have}); "
                   f"they start (memory is used as they fill) but the host swaps or runs out: lower the capacity")


def _pinned(tiers: Sequence[tuple[int, TierConfig]]) -> list[tuple[int, TierConfig]]:
    """The cpu tiers that pin their memory here (pin_memory true or unset, and CUDA present: torch decides)."""
    maybe: list[tuple[int, TierConfig]] = [(i, t) for i, t in tiers
                                           if isinstance(t, CpuTierConfig) and t.pin_memory is not False]
    if not maybe:
        return []
    try:
        import torch
    except ImportError:
        return []
    return maybe if torch.cuda.is_available() else []


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (a disk tier creates its directory at start)."""
    at = path
    while not at.exists() and at.parent != at:
        at = at.parent
    return at


def _disk_space(tiers: Sequence[tuple[int, DiskTierConfig]]) -> Finding:
    """Quotas of the disk tiers on one file system against its space free to this user."""
    at = _existing(Path(tiers[0][1].path))
    st = os.statvfs(at)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    want = sum(t.capacity for _, t in tiers)
    key, name = _keys(tiers), _names(tiers)
    have = f"{format_size(free)} free of {format_size(size)} at {at}"
    if want > free:
        return Finding(key, name, WARN, f"disk quota {format_size(want)} is more than the free space ({have}; "
                       f"records already there count as used): lower the capacity or free some space")
    return Finding(key, name, OK, f"disk quota {format_size(want)} fits ({have})")


def probe_gpus(tiers: Sequence[tuple[str, GpuTierConfig]]) -> list[Finding]:
    """Each gpu tier's device exists, and the tiers on one CUDA device fit its free memory."""
    from kvtier.ops.progress import loading

    try:
        with loading("kvtier check --probe", "torch", transient=True):  # seconds: say so on a terminal
            import torch
    except ImportError:
        return [Finding(f"{p}.device", t.name, FAIL, "torch is not installed: a gpu tier needs it "
                        "(pip install torch)") for p, t in tiers]
    findings: list[Finding] = []
    per_device: dict[int, list[tuple[str, GpuTierConfig]]] = {}
    for path, tier in tiers:
        key = f"{path}.device"
        try:
            dev = torch.device(tier.device)
        except RuntimeError as exc:
            findings.append(Finding(key, tier.name, FAIL, f"bad device {tier.device!r}: {exc} (use e.g. cuda:0)"))
            continue
        if dev.type == "cpu":
            findings.append(Finding(key, tier.name, OK, "device cpu: a gpu tier in host memory (counted as RAM)"))
        elif dev.type != "cuda":
            findings.append(Finding(key, tier.name, WARN, f"device type {dev.type} is not probed"))
        elif not torch.cuda.is_available():
            findings.append(Finding(key, tier.name, FAIL, f"device {dev} does not exist: torch {torch.__version__} "
                                    "sees no CUDA GPU here (run on a GPU host, or use a cpu tier)"))
        elif (dev.index or 0) >= torch.cuda.device_count():
            findings.append(Finding(key, tier.name, FAIL, f"device {dev} does not exist: this host has "
                                    f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                                    f"cuda:{torch.cuda.device_count() - 1} (set {key})"))
        else:
            findings.append(Finding(key, tier.name, OK, f"device {dev}: {torch.cuda.get_device_name(dev)}"))
            per_device.setdefault(dev.index or 0, []).append((path, tier))
    for index, on_device in per_device.items():
        findings.append(_gpu_memory(index, on_device))
    return findings


def _gpu_memory(index: int, tiers: Sequence[tuple[str, GpuTierConfig]]) -> Finding:
    import torch

    free, total = torch.cuda.mem_get_info(index)
    want = sum(t.capacity for _, t in tiers)
    key = " + ".join(f"{p}.capacity" for p, _ in tiers)
    name = ", ".join(t.name for _, t in tiers)
    have = f"{format_size(free)} free of {format_size(total)} on cuda:{index}"
    if want > free:  # allocated whole at start
        return Finding(key, name, FAIL, f"gpu tiers take {format_size(want)}, more than the device has free "
                       f"({have}): the tier would not start; lower the capacity")
    return Finding(key, name, OK, f"gpu tiers take {format_size(want)} ({have})")
