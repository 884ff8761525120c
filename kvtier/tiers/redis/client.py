"""Where and how kvtier connects to Redis: URL parsing, credentials, TLS options, URL redaction, and
:func:`make_client`, the one builder of redis-py clients (the tier's, the offline reader's, the probe's).

URLs: ``redis://[user[:password]@]host:port[/db]``, ``rediss://`` (TLS), and for a cluster
``redis+cluster://host:port,host:port`` (or ``rediss+cluster://``, or ``cluster: true`` in the section).
A password in the URL wins; otherwise it is read from the environment variable named by ``password_env``
(``KVTIER_REDIS_PASSWORD``), so it never has to be in the YAML. Passwords never appear in logs or errors:
``redact`` (``kvtier.config.parse.redact_url``, re-exported here) replaces them with ``***``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from kvtier.config import RedisTierConfig
from kvtier.config.parse import redact_url
from kvtier.errors import ConfigError

_SCHEMES = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True),
            "rediss+cluster": (True, True)}


@dataclass(frozen=True)
class RedisEndpoint:
    """Resolved connection settings of one Redis tier."""

    hosts: tuple[tuple[str, int], ...]
    db: int = 0
    tls: bool = False
    cluster: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    url: str = ""  # redacted

    def redis_kwargs(self, section: RedisTierConfig) -> dict[str, Any]:
        """Keyword arguments shared by ``redis.asyncio.Redis`` and ``RedisCluster``."""
        kw: dict[str, Any] = {"username": self.username, "password": self.password,
                              "socket_timeout": max(section.timeout, 0.001),
                              "socket_connect_timeout": section.connect_timeout, "health_check_interval": 0}
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=section.tls_ca, ssl_certfile=section.tls_cert,
                      ssl_keyfile=section.tls_key)
        return kw


def make_client(endpoint: RedisEndpoint, section: RedisTierConfig, *, sync: bool = False,
                node: tuple[str, int] | None = None, retry: bool = False, full_coverage: bool = False,
                **extra: Any) -> Any:
    """A redis-py client for ``endpoint`` with the section's credentials, TLS settings and timeouts:
    ``redis.asyncio`` (the tier) or, with ``sync``, the blocking one (offline tools, the probe). A cluster endpoint
    gets a cluster client (``full_coverage``: refuse to start while a slot has no node), unless ``node`` names one
    server to talk to. Without ``retry`` a failed call is not retried: the tier's breaker, or the caller, decides
    when to try again. ``extra``: more keyword arguments for the client (``max_connections``, hooks)."""
    if sync:
        from redis import Redis
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry
    else:
        from redis.asyncio import Redis  # type: ignore[assignment]
        from redis.asyncio.cluster import ClusterNode, RedisCluster  # type: ignore[assignment]
        from redis.asyncio.retry import Retry  # type: ignore[assignment]
    from redis.backoff import NoBackoff

    kw = endpoint.redis_kwargs(section)
    if not retry:
        kw["retry"] = Retry(NoBackoff(), 0)
    if endpoint.cluster and node is None:
        nodes = [ClusterNode(h, p) for h, p in endpoint.hosts]
        return RedisCluster(startup_nodes=nodes, require_full_coverage=full_coverage, **kw, **extra)
    host, port = node or endpoint.hosts[0]
    return Redis(host=host, port=port, db=endpoint.db, **kw, **extra)


#: The URL with any password replaced by ``***`` (user names are kept); one implementation, in kvtier.config.parse.
redact = redact_url


def parse_endpoint(section: RedisTierConfig, env: Mapping[str, str]) -> RedisEndpoint:
    """Resolve a section's URL, cluster flag and credentials. Invalid URLs raise ``ConfigError``."""
    path = f"tiers.{section.name}.url"
    safe = redact(section.url)
    scheme, sep, rest = section.url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ConfigError(path, f"unsupported Redis URL {safe!r}",
                          "use redis://, rediss://, redis+cluster:// or rediss+cluster://")
    tls, cluster = _SCHEMES[scheme]
    userinfo, at, hostpart = rest.rpartition("@")
    hostlist, _, dbpart = hostpart.partition("/")
    dbpart = dbpart.partition("?")[0]
    user, _, password = userinfo.partition(":") if at else ("", "", "")
    hosts = tuple(_host_port(h, path, safe) for h in hostlist.split(",") if h)
    if not hosts:
        raise ConfigError(path, f"no host in Redis URL {safe!r}")
    try:
        db = int(dbpart) if dbpart else 0
    except ValueError:
        raise ConfigError(path, f"database {dbpart!r} in {safe!r} is not a number") from None
    cluster = cluster or section.cluster
    if cluster and db:
        raise ConfigError(path, "Redis Cluster has only database 0")
    return RedisEndpoint(hosts=hosts, db=db, tls=tls, cluster=cluster,
                         username=section.username or unquote(user) or None,
                         password=unquote(password) or env.get(section.password_env) or None, url=safe)


def _host_port(text: str, path: str, safe: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if text.count(":") == 1 or text.startswith("[") else (text, "", "")
    host = (host or text).strip("[]")
    try:
        return host, int(port) if port else 6379
    except ValueError:
        raise ConfigError(path, f"invalid port in Redis URL {safe!r}") from None
