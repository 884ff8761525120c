"""Records damaged behind the engine's back, on disk and in Redis, while it runs: bit flips in the header or the
payload, truncation, another record's bytes under this record's name. Each must be a miss that the engine
recomputes (outputs unchanged, exactly), deleted from the tier and counted in ``stats().corrupt``.

Tier-level versions (every damage kind on one tier, the Redis stream staying in sync around bad values) are in
tests/tiers/test_disk.py and tests/tiers/test_redis.py; tests/engine/test_kvtier_connector.py flips one byte of
every record. These damage every other record (so good and bad loads mix in one request) and check deletion
and counts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from faultkit import (
    FaultRun,
    assert_clean,
    assert_identical,
    fault_waves,
    make_config,
    record_files,
    run_faulted,
    tier_section,
)

from kvtier.bench.redis_servers import RedisServer
from kvtier.engine import KVTierPair
from kvtier.records.codec import HEADER_SIZE, decode

WAVES = [fault_waves()[0], fault_waves()[3]]  # wave 1 repeats a prompt of wave 0: its loads read the damage
DAMAGES = ["flip_payload", "flip_header", "truncate", "foreign"]


def damaged(data: bytes, kind: str, other: bytes) -> bytes:
    buf = bytearray(data)
    if kind == "flip_payload":
        buf[HEADER_SIZE + (len(buf) - HEADER_SIZE) // 2] ^= 0x08
    elif kind == "flip_header":
        buf[HEADER_SIZE // 3] ^= 0x01
    elif kind == "truncate":
        del buf[-100:]
    else:  # a valid record of another key stored under this key's name
        buf = bytearray(other)
    return bytes(buf)


def key_of(name: object) -> bytes:
    """The kvtier key a disk file name (``<key hex>.kvt``) or a Redis key (``prefix:ns hex:hash hex``) stands for."""
    if isinstance(name, Path):
        return bytes.fromhex(name.name.removesuffix(".kvt"))
    assert isinstance(name, bytes)
    _, ns, chunk = name.decode().split(":")
    return bytes.fromhex(ns + chunk)


def check(run: FaultRun, tier: str, bad: dict[object, bytes], now: Callable[[object], bytes | None]) -> None:
    """Outputs identical; corrupt records counted; each one read was deleted: its name is now absent or holds
    a valid record of its own key (the engine recomputed and saved it again). Never-read ones are untouched."""
    assert_identical(run, WAVES)
    assert_clean(run)
    corrupt = run.tier_stats(tier).corrupt
    assert corrupt > 0 and run.load_failures() > 0
    still_bad = 0
    for name, data in bad.items():
        value = now(name)
        if value == data:
            still_bad += 1
        elif value is not None:
            decode(value, expected_key=key_of(name))  # raises CorruptRecord if not a valid record of this key
    assert still_bad <= len(bad) - corrupt


@pytest.mark.parametrize("kind", DAMAGES)
def test_damaged_disk_records(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "disk"
    bad: dict[object, bytes] = {}

    def damage(i: int, pair: KVTierPair) -> None:
        if i != 0:
            return
        files = record_files(root)
        for path in files[::2]:
            other = next(p for p in files if p != path)
            bad[path] = damaged(path.read_bytes(), kind, other.read_bytes())
            path.write_bytes(bad[path])

    def now(path: object) -> bytes | None:
        assert isinstance(path, Path)
        return path.read_bytes() if path.exists() else None

    run = run_faulted(make_config([tier_section("disk", root=root)]), WAVES, between_waves=damage)
    check(run, "disk", bad, now)
    assert_clean(run, root)


@pytest.mark.parametrize("kind", DAMAGES)
def test_damaged_redis_records(redis_server: RedisServer, kind: str) -> None:
    section = tier_section("redis", url=redis_server.url, timeout="1s")
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    bad: dict[object, bytes] = {}

    def damage(i: int, pair: KVTierPair) -> None:
        if i != 0:
            return
        names = sorted(client.scan_iter(match=f"{section['key_prefix']}:*"))
        for name in names[::2]:
            other = client.get(next(n for n in names if n != name))
            bad[name] = damaged(client.get(name), kind, other)
            client.set(name, bad[name])

    try:
        run = run_faulted(make_config([section]), WAVES, between_waves=damage)
        check(run, "redis", bad, client.get)
    finally:
        client.close()


def test_damage_at_every_step_on_disk_and_in_redis(tmp_path: Path, redis_factory: Callable[..., RedisServer]) -> None:
    """Damage disk and Redis records at every engine step (not only between waves): still no wrong output."""
    server = redis_factory()
    root = tmp_path / "disk"
    cfg = make_config([tier_section("disk", root=root, capacity="200KiB"),
                       tier_section("redis", url=server.url, timeout="1s")])
    client = redis.Redis(host="127.0.0.1", port=server.port)
    steps = [0]

    def on_step(_engine: object) -> None:
        for path in record_files(root)[steps[0] % 3::3]:
            try:  # the engine's I/O thread may delete or replace the file meanwhile
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            if len(data) > HEADER_SIZE + 100:  # already damaged (truncated or emptied) files stay as they are
                path.write_bytes(damaged(data, DAMAGES[steps[0] % 4], b""))
        for name in list(client.scan_iter(count=1000))[::3]:
            client.setrange(name, HEADER_SIZE + 7, b"\xff")
        steps[0] += 1

    try:
        run = run_faulted(cfg, WAVES, on_step=on_step)
    finally:
        client.close()
    assert_identical(run, WAVES)
    assert_clean(run, root)
    assert run.tier_stats("disk").corrupt + run.tier_stats("redis").corrupt > 0
