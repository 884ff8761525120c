"""The tier contract (kvtier.tiers.base) as a reusable test suite.

Subclass ``TierContract`` in a ``Test*`` class and implement ``build(env, capacity, name)``: construct and
start a tier of ``capacity`` bytes. ``env`` is the value of the ``env`` fixture (``tmp_path`` by default;
override the fixture to hand over a server address). The same ``env`` and ``name`` must give the same medium,
so that ``close`` followed by a new ``build`` re-opens it. Class attributes describe the tier:

* ``persistent``: records survive close and re-open (disk, redis);
* ``exact_size``: ``stored_size(n)`` is exactly what an uncompressed record of n bytes costs, so refusals
  are predictable;
* ``may_lose``: records may vanish on their own (TTL, server-side eviction): a get may then be None.
* ``enforces_capacity``: ``put`` refuses what would take ``used_bytes`` above ``capacity``. False for a tier
  whose medium governs its own memory (redis: ``used_bytes`` is a report; only a single record larger than
  ``capacity`` is refused).

Tiers must make ``close`` idempotent. ``bytes_in`` / ``bytes_out`` may count payload bytes or stored bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.tiers.base import Tier

Factory = Callable[..., Awaitable[Tier]]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(4096,), (2, 8, 64), (3, 5, 7), (1,)]


def key(i: int, ns: bytes = b"contract-ns-0000") -> bytes:
    """A 32-byte key: 16-byte namespace + 16-byte digest of ``i``."""
    return ns[:16].ljust(16, b"\0") + hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def rand(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def raw(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    """Same dtype, shape and bytes (exact equality)."""
    assert got is not None, "expected a hit"
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    assert raw(got) == raw(want)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TierContract:
    persistent: ClassVar[bool] = False
    exact_size: ClassVar[bool] = True
    may_lose: ClassVar[bool] = False
    enforces_capacity: ClassVar[bool] = True

    async def build(self, env: Any, capacity: int, name: str) -> Tier:
        raise NotImplementedError("subclasses build and start their tier")

    @pytest.fixture
    def env(self, tmp_path: Path) -> Any:
        return tmp_path

    @pytest.fixture
    async def make(self, env: Any) -> AsyncIterator[Factory]:
        built: list[Tier] = []

        async def factory(capacity: int = 1 << 22, name: str = "t") -> Tier:
            tier = await self.build(env, capacity, name)
            built.append(tier)
            return tier

        yield factory
        for tier in built:
            await tier.close()

    async def cost(self, make: Factory, t: torch.Tensor) -> int:
        probe = await make(1 << 24, name=f"probe-{uuid.uuid4().hex[:8]}")
        return probe.stored_size(nbytes(t))

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    async def test_round_trip(self, make: Factory, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        tier = await make()
        t = rand(shape, dtype, seed=len(shape))
        want = t.clone()
        assert await tier.put([(key(1), t)]) == [True]
        t.zero_()  # the tier holds its own copy
        [back] = await tier.get([key(1)])
        assert_same(back, want)
        [again] = await tier.get([key(1)])
        assert_same(again, want)

    async def test_batched_results_in_order(self, make: Factory) -> None:
        tier = await make()
        items = [(key(i), rand((16 * (i + 1),), DTYPES[i % 3], seed=i)) for i in range(5)]
        assert await tier.put(items) == [True] * 5
        order = [3, None, 0, 4, 3, 1]
        got = await tier.get([key(i) if i is not None else key(99) for i in order])
        assert len(got) == len(order)
        for i, g in zip(order, got, strict=True):
            if i is None:
                assert g is None
            else:
                assert_same(g, items[i][1])

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    async def test_get_into_equals_get(self, make: Factory, dtype: torch.dtype) -> None:
        tier = await make()
        items = [(key(i), rand((8, 64), dtype, seed=i)) for i in range(3)]
        assert await tier.put(items) == [True] * 3
        got = await tier.get([key(i) for i in range(3)])
        outs = [torch.full((nbytes(t),), 7, dtype=torch.uint8) for _, t in items]
        spare = torch.full((nbytes(items[0][1]),), 7, dtype=torch.uint8)
        found = await tier.get_into([*zip([key(i) for i in range(3)], outs, strict=True), (key(9), spare)])
        assert found == [True, True, True, False]
        for value, out in zip(got, outs, strict=True):
            assert value is not None and raw(out) == raw(value)
        assert raw(spare) == bytes([7]) * spare.numel()  # a miss leaves its buffer alone
        with pytest.raises(ValueError):
            await tier.get_into([(key(0), torch.empty(3, dtype=torch.uint8))])

    async def test_results_stay_valid_while_held(self, make: Factory) -> None:
        # results may reuse the memory of dropped ones, never of ones (or views of ones) still held
        tier = await make()
        items = [(key(i), rand((4096,), seed=i)) for i in range(4)]
        assert await tier.put(items) == [True] * 4
        [first] = await tier.get([key(0)])
        assert first is not None
        view = first[1:].view(torch.uint8)
        del first
        for _ in range(3):
            for got, (_, want) in zip(await tier.get([k for k, _ in items]), items, strict=True):
                assert_same(got, want)
        assert raw(view) == raw(items[0][1])[4:]

    async def test_contains(self, make: Factory) -> None:
        tier = await make()
        await tier.put([(key(0), rand((64,))), (key(1), rand((64,), seed=1))])
        before = tier.stats().lookups
        assert await tier.contains([key(0), key(7), key(1)]) == [True, False, True]
        assert await tier.contains([]) == []
        assert tier.stats().lookups - before == 3

    async def test_miss_is_none(self, make: Factory) -> None:
        tier = await make()
        assert await tier.get([key(5), key(6)]) == [None, None]
        assert await tier.get([]) == []

    async def test_delete_returns_counts(self, make: Factory) -> None:
        tier = await make()
        await tier.put([(key(i), rand((256,), seed=i)) for i in range(3)])
        assert await tier.delete([key(0), key(1), key(42)]) == 2
        assert await tier.delete([key(0)]) == 0
        got = await tier.get([key(0), key(1), key(2)])
        assert got[:2] == [None, None]
        assert_same(got[2], rand((256,), seed=2))
        assert await tier.contains([key(0), key(2)]) == [False, True]
        assert await tier.delete([key(2)]) == 1
        assert tier.used_bytes() == 0

    async def test_capacity_never_exceeded(self, make: Factory) -> None:
        t = rand((16384,))  # 64 KiB
        cost = await self.cost(make, t)
        capacity = 4 * cost + cost // 2
        tier = await make(capacity, name="cap")
        results = []
        for i in range(6):
            results += await tier.put([(key(i), rand((16384,), seed=i))])
            assert tier.used_bytes() <= capacity or not self.enforces_capacity
        if not self.enforces_capacity:
            assert results == [True] * 6 and tier.stats().puts_refused == 0
        elif self.exact_size:
            assert results == [True] * 4 + [False] * 2
        assert tier.stats().puts_refused == results.count(False) >= int(self.enforces_capacity)
        big = rand((capacity // 4 + 1024,))
        assert await tier.put([(key(100), big)]) == [False]
        assert tier.stats().puts_refused == results.count(False) + 1
        assert await tier.get([key(100)]) == [None]
        stored = [i for i, ok in enumerate(results) if ok]
        assert await tier.delete([key(stored[0])]) == 1
        assert await tier.put([(key(50), rand((16384,), seed=50))]) == [True]
        assert tier.used_bytes() <= capacity or not self.enforces_capacity

    async def test_batch_put_refuses_what_does_not_fit(self, make: Factory) -> None:
        t = rand((16384,))
        cost = await self.cost(make, t)
        tier = await make(3 * cost, name="batch")
        results = await tier.put([(key(i), rand((16384,), seed=i)) for i in range(5)])
        assert len(results) == 5
        if not self.enforces_capacity:
            assert results == [True] * 5 and tier.stats().puts_refused == 0
            return
        assert tier.used_bytes() <= 3 * cost
        if self.exact_size:
            assert results.count(True) == 3
        assert tier.stats().puts_refused == results.count(False) >= 2

    async def test_overwrite(self, make: Factory) -> None:
        tier = await make()
        a, b = rand((1024,), seed=1), rand((1024,), seed=2)
        await tier.put([(key(0), a)])
        used = tier.used_bytes()
        assert await tier.put([(key(0), b)]) == [True]
        assert_same((await tier.get([key(0)]))[0], b)
        assert tier.used_bytes() == used
        c = rand((4, 128), torch.bfloat16, seed=3)
        assert await tier.put([(key(0), c)]) == [True]
        assert_same((await tier.get([key(0)]))[0], c)
        assert await tier.delete([key(0)]) == 1 and tier.used_bytes() == 0

    async def test_overwrite_in_a_full_tier_reuses_its_own_space(self, make: Factory) -> None:
        t = rand((16384,))
        cost = await self.cost(make, t)
        tier = await make(2 * cost, name="full")
        assert await tier.put([(key(0), t), (key(1), rand((16384,), seed=1))]) == [True, True]
        new = rand((16384,), seed=2)
        assert await tier.put([(key(0), new)]) == [True]
        assert_same((await tier.get([key(0)]))[0], new)
        assert tier.used_bytes() <= 2 * cost

    async def test_stats_counters(self, make: Factory) -> None:
        tier = await make()
        t0, t1 = rand((512,)), rand((128,), torch.float16, seed=1)
        await tier.put([(key(0), t0), (key(1), t1)])
        s = tier.stats()
        payload = nbytes(t0) + nbytes(t1)
        assert s.puts == 2
        assert payload <= s.bytes_in <= tier.stored_size(nbytes(t0)) + tier.stored_size(nbytes(t1))
        await tier.get([key(0), key(1), key(2)])
        assert (s.gets, s.get_hits) == (3, 2)
        assert payload <= s.bytes_out <= tier.stored_size(nbytes(t0)) + tier.stored_size(nbytes(t1))
        await tier.contains([key(0), key(9)])
        assert (s.lookups, s.hits) == (2, 1)
        assert s.corrupt == 0 and s.errors == 0
        assert set(s.as_dict()) >= {"hits", "bytes_in", "bytes_out", "puts_refused"}

    async def test_used_bytes_and_stored_size(self, make: Factory) -> None:
        tier = await make()
        ts = [rand((1000 + i,), seed=i) for i in range(3)]
        await tier.put([(key(i), t) for i, t in enumerate(ts)])
        assert all(tier.stored_size(nbytes(t)) >= nbytes(t) for t in ts)
        if self.exact_size:
            assert tier.used_bytes() == sum(tier.stored_size(nbytes(t)) for t in ts)

    async def test_close_then_reopen(self, make: Factory) -> None:
        tier = await make(name="reopen")
        t = rand((2, 300), torch.bfloat16, seed=9)
        await tier.put([(key(0), t)])
        await tier.close()
        await tier.close()  # idempotent
        again = await make(name="reopen")
        [back] = await again.get([key(0)])
        if self.persistent:
            assert_same(back, t)
            if not again.is_shared:
                assert [(e.key, e.size) for e in again.entries()] == [(key(0), again.used_bytes())]
        else:
            assert back is None and again.used_bytes() == 0
        assert await again.put([(key(1), t)]) == [True]
        assert_same((await again.get([key(1)]))[0], t)

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors])
    @given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "contains"]),
                                  st.integers(0, 5), st.integers(0, 3), st.integers(0, 1000)),
                        min_size=1, max_size=40))
    def test_property_random_ops(self, env: Any, ops: list[tuple[str, int, int, int]]) -> None:
        asyncio.run(self._run_ops(env, ops))

    async def _run_ops(self, env: Any, ops: list[tuple[str, int, int, int]]) -> None:
        sizes = [(256,), (1024,), (3000,), (4096,)]
        tier = await self.build(env, 3 * 4 * 4096 + 100, f"prop-{uuid.uuid4().hex[:8]}")
        model: dict[bytes, torch.Tensor] = {}
        try:
            for op, k, size, seed in ops:
                await self._apply(tier, model, op, key(k), rand(sizes[size], DTYPES[seed % 3], seed))
                assert tier.used_bytes() <= tier.capacity_bytes or not self.enforces_capacity
                if self.exact_size:  # no leaked or double-counted bytes
                    assert tier.used_bytes() == sum(tier.stored_size(nbytes(v)) for v in model.values())
        finally:
            await tier.close()

    async def _apply(self, tier: Tier, model: dict[bytes, torch.Tensor], op: str, k: bytes,
                     t: torch.Tensor) -> None:
        if op == "put":
            old = model.get(k)
            fits = (tier.used_bytes() - (tier.stored_size(nbytes(old)) if old is not None else 0)
                    + tier.stored_size(nbytes(t)) <= tier.capacity_bytes)
            if not self.enforces_capacity:
                fits = tier.stored_size(nbytes(t)) <= tier.capacity_bytes
            [ok] = await tier.put([(k, t)])
            if self.exact_size:
                assert ok == fits
            if ok:
                model[k] = t
        elif op == "get":
            [got] = await tier.get([k])
            if k in model and not (self.may_lose and got is None):
                assert_same(got, model[k])
            else:
                assert got is None
        elif op == "delete":
            n = await tier.delete([k])
            assert n == int(k in model) or self.may_lose
            model.pop(k, None)
        else:
            [found] = await tier.contains([k])
            assert found == (k in model) or (self.may_lose and not found)

