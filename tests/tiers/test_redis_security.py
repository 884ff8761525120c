"""Redis tier credentials and TLS: URL / env passwords, ACL users, wrong passwords, redaction, TLS options."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from contract import assert_same, rand

from kvtier.bench.redis_servers import RedisServer, TlsFiles
from kvtier.config import RedisTierConfig
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.tiers.redis.client import parse_endpoint, redact
from kvtier.tiers.redis.tier import RedisTier

KEY = b"namespace-A-0000" + bytes(16)
SECRET = "s3cr3t-Pa55"


def section(url: str, **kw: Any) -> RedisTierConfig:
    kw.setdefault("timeout", 2.0)
    return RedisTierConfig(name=kw.pop("name", "shared"), capacity=1 << 26, url=url, **kw)


def test_url_parsing() -> None:
    ep = parse_endpoint(section("redis://alice:p%40ss@10.0.0.1:7000/3"), env={})
    assert (ep.hosts, ep.db, ep.username, ep.password, ep.tls, ep.cluster) == (
        (("10.0.0.1", 7000),), 3, "alice", "p@ss", False, False)
    ep = parse_endpoint(section("rediss+cluster://h1:7001,h2:7002,h3"), env={"KVTIER_REDIS_PASSWORD": "envpw"})
    assert ep.hosts == (("h1", 7001), ("h2", 7002), ("h3", 6379)) and ep.tls and ep.cluster
    assert ep.password == "envpw" and ep.username is None
    ep = parse_endpoint(section("redis://:urlpw@h:1", username="bob", password_env="MY_PW"), env={"MY_PW": "x"})
    assert (ep.username, ep.password) == ("bob", "urlpw")  # the URL's password wins over the env
    assert parse_endpoint(section("redis://h", cluster=True), env={}).cluster
    for bad in ("http://h:1", "redis://h:port", "redis://h:1/zero", "redis+cluster://h:1/2", "redis://"):
        with pytest.raises(ConfigError, match=r"tiers\.shared\.url"):
            parse_endpoint(section(bad), env={})


def test_passwords_are_redacted() -> None:
    assert redact("redis://alice:hunter2@h:1/0") == "redis://alice:***@h:1/0"
    assert redact("rediss://:hunter2@h:1") == "rediss://:***@h:1"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    ep = parse_endpoint(section("redis://u:hunter2@h:1"), env={})
    assert "hunter2" not in repr(ep) and "hunter2" not in ep.url
    with pytest.raises(ConfigError) as err:
        parse_endpoint(section("redis://u:hunter2@h:notaport"), env={})
    assert "hunter2" not in str(err.value)


def test_tls_options_reach_the_client() -> None:
    sec = section("rediss://127.0.0.1:6390/0", tls_ca="/etc/ca.pem", tls_cert="/etc/c.pem", tls_key="/etc/c.key")
    tier = RedisTier(sec, env={})
    client = tier._make_client()
    kw = client.connection_pool.connection_kwargs
    assert kw["ssl_ca_certs"] == "/etc/ca.pem" and kw["ssl_certfile"] == "/etc/c.pem"
    assert kw["ssl_keyfile"] == "/etc/c.key"
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert not tier._fast  # raw sockets do not speak TLS: rediss:// goes through redis-py


async def test_wrong_password_is_a_clear_error_at_start(redis_factory: Callable[..., RedisServer],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    srv = redis_factory(password=SECRET)
    caplog.set_level(logging.DEBUG)
    for url, env in ((f"redis://:wrong-{SECRET}@127.0.0.1:{srv.port}/0", {}),
                     (srv.url, {"KVTIER_REDIS_PASSWORD": "nope"}), (srv.url, {})):
        tier = RedisTier(section(url, name="team-cache"), env=env)
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable, match=r"redis tier 'team-cache'.*authentication") as err:
            await tier.start()
        assert time.monotonic() - t0 < 5
        assert SECRET not in str(err.value)
    assert SECRET not in caplog.text


async def test_password_from_env_and_acl_user(redis_factory: Callable[..., RedisServer]) -> None:
    srv = redis_factory(password=SECRET)
    srv.cli("ACL", "SETUSER", "kv", "on", ">kvpass", "~*", "+@all")
    t = rand((1000,))
    tier = RedisTier(section(srv.url), env={"KVTIER_REDIS_PASSWORD": SECRET})
    await tier.start()
    assert await tier.put([(KEY, t)]) == [True]
    await tier.close()
    acl = RedisTier(section(f"redis://kv:kvpass@127.0.0.1:{srv.port}/0"), env={})
    await acl.start()
    assert_same((await acl.get([KEY]))[0], t)
    assert await acl.contains([KEY]) == [True]
    await acl.close()


async def test_unreachable_at_start_is_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.bench.redis_servers import free_port

    tier = RedisTier(section(f"redis://u:{SECRET}@127.0.0.1:{free_port()}/0", timeout=0.2, connect_timeout=0.5),
                     env={})
    with caplog.at_level(logging.DEBUG):
        await tier.start()  # logs, does not raise: the engine runs on without this tier
        assert await tier.get([KEY]) == [None]
        assert await tier.put([(KEY, rand((10,)))]) == [False]
    assert "not reachable" in caplog.text and SECRET not in caplog.text
    await tier.close()


async def test_tls_round_trip_with_client_certificates(redis_factory: Callable[..., RedisServer],
                                                       tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    tls = TlsFiles.create(tmp_path)
    srv = redis_factory(tls=tls, password=SECRET)
    assert srv.url.startswith("rediss://")
    sec = section(srv.url, tls_ca=tls.ca, tls_cert=tls.client_cert, tls_key=tls.client_key)
    tier = RedisTier(sec, env={"KVTIER_REDIS_PASSWORD": SECRET})
    await tier.start()
    items = [(KEY[:16] + bytes([i + 1]) * 16, rand((3000 + i * (1 << 20),), seed=i)) for i in range(3)]  # to 8 MiB
    assert await tier.put(items) == [True] * 3
    got = await tier.get([key for key, _ in items] + [KEY])
    for g, (_, t) in zip(got[:3], items, strict=True):
        assert_same(g, t)
    assert got[3] is None and await tier.contains([items[0][0], KEY]) == [True, False]
    srv.cli("SET", tier.redis_key(KEY).decode(), "garbage")
    assert await tier.get([KEY]) == [None] and tier.stats().corrupt == 1
    await tier.close()
    no_cert = RedisTier(section(srv.url, tls_ca=tls.ca), env={"KVTIER_REDIS_PASSWORD": SECRET})
    await no_cert.start()  # the handshake fails: logged, not fatal; every call misses
    assert await no_cert.get([items[0][0]]) == [None]
    await no_cert.close()
