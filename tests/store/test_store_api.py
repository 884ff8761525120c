"""The TieredStore API boundary: what a key and a value are, over real cpu, disk and Redis tiers. Everything some
tier cannot take raises TypeError / ValueError at the call, naming the fix, and no tier is written; everything
accepted round-trips through every tier."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.config import load_config
from kvtier.layout import DTYPE_SIZES
from kvtier.records.keys import KEY_BYTES, Namespace, chunk_keys
from kvtier.store.tiered import TieredStore

CHUNK = 16
KEYS = chunk_keys(Namespace("api").digest(), list(range(CHUNK * 40)), CHUNK)
GOOD = torch.arange(64, dtype=torch.float32).reshape(4, 16)


@pytest.fixture
async def store(tmp_path: Path, redis_server: Any) -> AsyncIterator[TieredStore]:
    """cpu, disk and redis, write-through: a put reaches every tier."""
    prefix = f"api{os.getpid()}x{id(tmp_path)}"
    cfg = load_config({"chunk_size": CHUNK, "policy": {"write": "write_through"}, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity": "1MiB"},
        {"name": "disk", "kind": "disk", "capacity": "4MiB", "path": str(tmp_path / "disk")},
        {"name": "redis", "kind": "redis", "capacity": "16MiB", "url": redis_server.url, "key_prefix": prefix}],
    }, env={})
    s = TieredStore.from_config(cfg)
    await s.start()
    s.redis_probe = (redis_server, prefix)  # type: ignore[attr-defined]
    yield s
    await s.close()


def assert_untouched(store: TieredStore) -> None:
    """No tier holds or was asked to store anything: bytes, files, Redis keys, counters, directory."""
    server, prefix = store.redis_probe  # type: ignore[attr-defined]
    for name in store.tier_names:
        tier = store.tier(name)
        assert tier.used_bytes() == 0 and tier.stats().puts == 0 and tier.stats().puts_refused == 0, name
        assert store.directory.used_bytes(name) == 0
    disk_root = Path(store.tier("disk").layout.root)  # type: ignore[attr-defined]
    assert [*disk_root.rglob("*.kvt"), *disk_root.rglob("*.kvt.*.tmp")] == []  # no record, nor a temporary one
    assert server.cli("--scan", "--pattern", f"{prefix}*").strip() == ""
    assert store.directory.stats.unplaced == 0


BAD_KEYS: list[tuple[Any, type[Exception], str]] = [
    ("a" * KEY_BYTES, TypeError, "a key must be bytes, got str"),
    (7, TypeError, "a key must be bytes, got int"),
    (bytearray(KEY_BYTES), TypeError, "bytes(key)"),
    (memoryview(bytes(KEY_BYTES)), TypeError, "bytes(key)"),
    (bytes(KEY_BYTES - 1), ValueError, "key of 31 bytes (a key is 32 bytes: a 16-byte namespace digest"),
    (bytes(KEY_BYTES + 1), ValueError, "key of 33 bytes"),
]


@pytest.mark.parametrize(("key", "error", "text"), BAD_KEYS)
async def test_a_bad_key_is_refused_before_any_tier_is_touched(store: TieredStore, key: Any,
                                                               error: type[Exception], text: str) -> None:
    with pytest.raises(error, match="items\\[1\\] key: ") as info:
        await store.put([(KEYS[0], GOOD), (key, GOOD)])
    assert text in str(info.value)
    assert_untouched(store)
    for call in (store.get([key]), store.lookup([key]), store.read("disk", [key]), store.delete("cpu", [key])):
        with pytest.raises(error, match="keys\\[0\\]: "):
            await call
    with pytest.raises(error):
        store.lookup_local([KEYS[0], key])


BAD_VALUES: list[tuple[Any, type[Exception], str]] = [
    (np.zeros(4, dtype=np.float32), TypeError, "torch.from_numpy"),
    ([1.0, 2.0], TypeError, "a value must be a torch.Tensor, got list"),
    (None, TypeError, "got NoneType"),
    (torch.zeros(4, dtype=torch.int64), ValueError, "dtype int64 cannot be stored"),
    (torch.zeros(4, dtype=torch.float64), ValueError, "value.view(torch.uint8)"),
    (torch.zeros(4, dtype=torch.bool), ValueError, "dtype bool cannot be stored"),
    (torch.zeros(4, dtype=torch.complex64), ValueError, "dtype complex64"),
    (torch.zeros(4).to_sparse(), ValueError, "value.to_dense()"),
    (torch.empty(4, device="meta"), ValueError, "meta device holds no data"),
    (torch.zeros([1] * 9), ValueError, "at most 8 dimensions"),
]


@pytest.mark.parametrize(("value", "error", "text"), BAD_VALUES)
async def test_a_value_some_tier_cannot_store_is_refused(store: TieredStore, value: Any,
                                                         error: type[Exception], text: str) -> None:
    with pytest.raises(error, match="items\\[1\\] value: ") as info:
        await store.put([(KEYS[0], GOOD), (KEYS[1], value)])
    assert text in str(info.value)
    with pytest.raises(error, match="items\\[0\\] value: "):
        await store.write("cpu", [(KEYS[1], value)])  # the data plane checks what it writes too
    assert_untouched(store)


@pytest.mark.parametrize(("call", "error", "text"), [
    (lambda s: s.put({KEYS[0]: GOOD}), TypeError, "list(d.items())"),
    (lambda s: s.put([GOOD]), TypeError, "items[0] must be a (key, tensor) pair, got Tensor"),
    (lambda s: s.put([(KEYS[0], GOOD, None)]), TypeError, "items[0] must be a (key, tensor) pair"),
    (lambda s: s.put([(KEYS[0], GOOD), (KEYS[1], GOOD), (KEYS[0], GOOD * 2)]), ValueError,
     "items[2]: key " + KEYS[0].hex() + " is also items[0]: put each chunk once"),
    (lambda s: s.put([(KEYS[0], GOOD)], parents=[None, None]), ValueError, "one key or None per item (1)"),
    (lambda s: s.put([(KEYS[0], GOOD)], parents=["parent"]), TypeError, "parents[0]: a key must be bytes"),
    (lambda s: s.put([(KEYS[0], GOOD)], tiers="cpu"), TypeError, "sequence of tier names, got str (one: [name])"),
    (lambda s: s.put([(KEYS[0], GOOD)], tiers=["cpu", "ssd"]), ValueError,
     "no tier named 'ssd' in this store; its tiers: cpu, disk, redis"),
    (lambda s: s.get(KEYS[0]), TypeError, "keys must be a sequence of keys, got bytes (pass one key as [key])"),
    (lambda s: s.write("ssd", [(KEYS[0], GOOD)]), ValueError, "no tier named 'ssd'"),
])
async def test_a_malformed_call_names_the_fix(store: TieredStore, call: Any, error: type[Exception],
                                              text: str) -> None:
    """A put to a tier name the store lacks used to store nothing and return 0: data dropped silently."""
    with pytest.raises(error) as info:
        await call(store)
    assert text in str(info.value)
    assert_untouched(store)


def edge_values() -> list[torch.Tensor]:
    """Everything the boundary accepts: each storable dtype, and shapes and layouts every tier copies."""
    base = torch.arange(32, dtype=torch.float32)
    typed = [base.to(torch.float32 if d.startswith("float8") else getattr(torch, d)).to(getattr(torch, d))
             for d in DTYPE_SIZES]
    return [*typed,
            torch.randn(8, 4).t(),  # not contiguous
            torch.zeros(1).expand(8),  # stride 0
            torch.zeros(0, 3),  # zero-size
            torch.tensor(2.5),  # zero dimensions
            torch.ones([1, 2] * 4),  # eight dimensions
            torch.randn(4, requires_grad=True)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().contiguous().view(torch.uint8) if a.dim() else a.detach().reshape(1).view(torch.uint8),
        b.contiguous().view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8))


async def test_every_accepted_value_round_trips_through_every_tier(store: TieredStore) -> None:
    values = edge_values()
    keys = KEYS[:len(values)]
    assert await store.put(zip(keys, values, strict=True)) == len(values)  # any iterable of pairs
    for name in store.tier_names:
        got = await store.read(name, keys)
        for i, (want, have) in enumerate(zip(values, got, strict=True)):
            assert have is not None and same(want, have), (name, i, want.dtype, tuple(want.shape))
        assert store.tier(name).stats().puts == len(values)
    assert (await store.lookup(keys)).hits == len(values)
