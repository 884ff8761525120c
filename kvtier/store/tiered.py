"""TieredStore: ordered tiers plus the directory, for callers that hold both planes in one process.

Lifecycle: ``store = TieredStore.from_config(cfg)`` -> ``await store.start()`` (starts the tiers, adopts what
persistent tiers already hold) -> ``lookup`` / ``get`` / ``put`` -> ``await store.close()`` (under write-back
first copies what only memory tiers hold to disk, within ``policy.persist_at_close``: ``persist_memory`` below,
with the plans of kvtier.control.persist).

Control plane: ``self.directory`` (see kvtier.control.directory). Data plane: ``read`` / ``read_into`` / ``borrow`` +
``release`` / ``write`` / ``delete`` / ``move`` / ``execute`` act on tiers without deciding anything; the
connector's worker half uses only these, while its scheduler half owns a directory of its own. ``get`` and
``put`` compose both planes.

Keys and values (:func:`check_items`, at every public call): a key is 32 ``bytes``, the 16-byte digest of a
:class:`kvtier.records.keys.Namespace` (model, revision, dtype, layout, rank, tenant: what makes equal tokens hold
different KV) followed by the 16-byte chained blake2b hash of the chunk's tokens and of every chunk before it;
``kvtier.records.keys.chunk_keys(namespace.digest(), token_ids, chunk_size)`` computes them, the same in every process
and on every host. A value is a dense torch tensor on any real device, contiguous or not, of a dtype every tier
stores (float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, uint8; ``.view(torch.uint8)`` stores
any other as raw bytes), with at most 8 dimensions; zero-size tensors are allowed. Anything else, a key twice in
one ``put``, or a tier name the store does not have, raises ``TypeError`` / ``ValueError`` at the call, before
any tier is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.config import KvtierConfig, WritePolicy
from kvtier.control.directory import Directory, StorePlan
from kvtier.control.metrics import snapshot
from kvtier.control.persist import copy_target
from kvtier.control.planner import place, promote
from kvtier.layout import DTYPE_SIZES, KVCacheConfig
from kvtier.records.codec import MAX_DIMS
from kvtier.records.keys import DIGEST_BYTES, KEY_BYTES, Key
from kvtier.store.assembly import Role, applied, build_tiers, close_tiers, directory_for, start_tiers
from kvtier.tiers.base import Borrowing, Tier

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_KEY_HINT = (f"a key is {KEY_BYTES} bytes: a {DIGEST_BYTES}-byte namespace digest and a {DIGEST_BYTES}-byte chunk "
             "hash, from kvtier.records.keys.chunk_keys(Namespace(...).digest(), token_ids, chunk_size)")


def check_key(key: Any, where: str) -> Key:
    """``key`` itself when it is a 32-byte ``bytes`` key; else ``TypeError`` / ``ValueError`` naming ``where``."""
    if not isinstance(key, bytes):
        fix = "convert it with bytes(key)" if isinstance(key, bytearray | memoryview) else _KEY_HINT
        raise TypeError(f"{where}: a key must be bytes, got {type(key).__name__} ({fix})")
    if len(key) != KEY_BYTES:
        raise ValueError(f"{where}: key of {len(key)} bytes ({_KEY_HINT})")
    return key


def check_keys(keys: Any, name: str = "keys") -> list[Key]:
    """A list of checked keys from a sequence of them."""
    if isinstance(keys, bytes | bytearray | str | memoryview) or not isinstance(keys, Iterable):
        raise TypeError(f"{name} must be a sequence of keys, got {type(keys).__name__} (pass one key as [key])")
    return [check_key(k, f"{name}[{i}]") for i, k in enumerate(keys)]


def check_value(value: Any, where: str) -> None:
    """Raise unless every tier can store ``value`` (see the module docstring)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: a value must be a torch.Tensor, got {type(value).__name__} "
                        "(numpy arrays: torch.from_numpy(array))")
    if value.layout is not torch.strided or value.is_nested:
        raise ValueError(f"{where}: a {value.layout} tensor cannot be stored (store value.to_dense())")
    if value.is_meta:
        raise ValueError(f"{where}: a tensor on the meta device holds no data")
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"{where}: dtype {dtype} cannot be stored; records hold {', '.join(DTYPE_SIZES)} "
                         "(store value.view(torch.uint8) for its raw bytes)")
    if value.dim() > MAX_DIMS or any(n >= 1 << 32 for n in value.shape):
        raise ValueError(f"{where}: shape {tuple(value.shape)} cannot be stored: at most {MAX_DIMS} dimensions "
                         "below 2**32 each (reshape it)")


def check_items(items: Any, parents: Any = None) -> list[tuple[Key, torch.Tensor]]:
    """The ``(key, tensor)`` pairs of a put as a list, each checked, no key twice; ``parents`` (None, or one key
    or None per item) checked too."""
    if isinstance(items, Mapping | bytes | str) or not isinstance(items, Iterable):
        raise TypeError(f"items must be a sequence of (key, tensor) pairs, got {type(items).__name__} "
                        "(a dict: list(d.items()))")
    pairs = list(items)
    seen: dict[Key, int] = {}
    for i, item in enumerate(pairs):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise TypeError(f"items[{i}] must be a (key, tensor) pair, got {type(item).__name__}")
        key = check_key(item[0], f"items[{i}] key")
        check_value(item[1], f"items[{i}] value")
        if key in seen:
            raise ValueError(f"items[{i}]: key {key.hex()} is also items[{seen[key]}]: put each chunk once")
        seen[key] = i
    if parents is not None:
        if isinstance(parents, bytes | str) or len(parents) != len(pairs):
            raise ValueError(f"parents must hold one key or None per item ({len(pairs)})")
        for i, p in enumerate(parents):
            if p is not None:
                check_key(p, f"parents[{i}]")
    return [(k, v) for k, v in pairs]


@dataclass(frozen=True)
class LookupResult:
    """The longest available prefix: ``hits`` chunks, ``tiers[i]`` holding chunk ``i``."""

    hits: int
    tiers: tuple[str, ...]


class TieredStore:
    """Ordered tiers, plus the directory when this process holds the control plane too (``directory`` None: the
    data plane of a worker process, whose scheduler owns the directory; ``lookup`` / ``get`` / ``put`` need one)."""

    def __init__(self, tiers: Sequence[Tier], directory: Directory | None, *,
                 write: WritePolicy = WritePolicy.WRITE_BACK, promote_on_hit: bool = True,
                 role: Role = Role.STORE, persist_at_close: float = 0.0) -> None:
        """``persist_at_close``: seconds ``close`` may spend copying what only memory tiers hold to disk
        (kvtier.control.persist; with the directory, under write-back)."""
        self._tiers = {t.name: t for t in tiers}
        self._order = [t.name for t in tiers]
        self._directory = directory
        self._role = role
        self.write_policy = write
        self.promote_on_hit = promote_on_hit
        self.persist_at_close = persist_at_close
        self._executing = 0  # ``execute`` calls in flight (on the event loop)
        self._quiet = asyncio.Event()
        self._quiet.set()

    @classmethod
    def from_config(cls, cfg: KvtierConfig, *, hmac_key: bytes | None = None, kcc: KVCacheConfig | None = None,
                    role: Role = Role.STORE, rank: int = 0, tp_size: int = 1) -> TieredStore:
        """Build (not start) the tiers a config describes for ``role`` and ``rank`` (kvtier.store.assembly), with a
        directory unless ``role`` is WORKER."""
        cfg = applied(cfg, kcc, rank, tp_size)
        tiers = build_tiers(cfg, hmac_key)
        directory = None if role is Role.WORKER else directory_for(cfg, tiers)
        return cls(tiers, directory, write=cfg.policy.write, promote_on_hit=cfg.policy.promote_on_hit, role=role,
                   persist_at_close=cfg.policy.persist_at_close)

    @property
    def completes_writes(self) -> bool:
        """Whether this store marks its own writes done in its directory (one process holds both planes)."""
        return self._directory is not None

    @property
    def directory(self) -> Directory:
        if self._directory is None:
            raise RuntimeError("this TieredStore is a worker's data plane: its scheduler owns the directory")
        return self._directory

    @property
    def tier_names(self) -> list[str]:
        return list(self._order)

    def tier(self, name: str) -> Tier:
        return self._tiers[name]

    async def start(self) -> None:
        """Start the tiers (kvtier.store.assembly.start_tiers: persistent ones adopted into the directory)."""
        await start_tiers([self._tiers[n] for n in self._order], self._role, self._directory)

    async def close(self) -> None:
        """Persist what only memory tiers hold (with the directory, under write-back: ``persist``, once, for at most
        ``persist_at_close``), then close every tier (started or not: a tier's close is safe either way; all within
        ``TIER_CLOSE_S``); re-raise once."""
        budget, self.persist_at_close = self.persist_at_close, 0.0
        if budget > 0 and self._directory is not None and self.write_policy is WritePolicy.WRITE_BACK:
            try:  # a round still running at the budget's end is cancelled: a hung disk never holds the stop
                await asyncio.wait_for(self.persist(budget), budget)
            except TimeoutError:
                logger.warning("persisting the memory tiers at close: a copy still running after the %.1fs budget "
                               "was given up", budget)
            except Exception:  # a failing disk must not keep the other tiers open
                logger.exception("persisting the memory tiers at close failed")
        await close_tiers([self._tiers[n] for n in self._order])

    async def persist(self, budget_s: float) -> int:
        """Copy the chunks only a memory tier holds into the first persistent local tier after it, oldest first,
        within about ``budget_s`` seconds (kvtier.store.tiered.persist_memory); return how many were copied."""
        return await persist_memory(self, budget_s)

    def stats(self) -> dict[str, float]:
        """Every tier's counters and, when this store holds it, the directory's: one flat snapshot
        (kvtier.control.metrics: ``tier_<name>_<field>``, ``directory_<field>``)."""
        directory = self._directory.stats if self._directory is not None else None
        return snapshot(tiers={name: self._tiers[name].stats() for name in self._order}, directory=directory)

    def _chain(self, tiers: Sequence[str] | None) -> list[str]:
        """The store's tiers named in ``tiers`` (all when None), in store order; unknown names raise."""
        if tiers is None:
            return list(self._order)
        if isinstance(tiers, str | bytes) or not isinstance(tiers, Iterable):
            raise TypeError(f"tiers must be a sequence of tier names, got {type(tiers).__name__} (one: [name])")
        names = list(tiers)
        for name in names:
            self._tier_name(name)
        return [n for n in self._order if n in names]

    def _tier_name(self, name: Any) -> str:
        if name not in self._tiers:
            raise ValueError(f"no tier named {name!r} in this store; its tiers: {', '.join(self._order)}")
        return str(name)

    # ---- composed operations ---------------------------------------------------------------------------
    def lookup_local(self, keys: Sequence[Key], tiers: Sequence[str] | None = None) -> LookupResult:
        """Longest prefix held by local tiers, from the directory alone (no I/O)."""
        found = self.directory.lookup(check_keys(keys), self._chain(tiers))
        return LookupResult(len(found), tuple(found))

    async def lookup(self, keys: Sequence[Key], tiers: Sequence[str] | None = None) -> LookupResult:
        """Longest prefix held by any tier: local ones from the directory, shared ones asked."""
        keys, chain = check_keys(keys), self._chain(tiers)
        found = list(self.directory.lookup(keys, chain))
        shared = [n for n in chain if self._tiers[n].is_shared]
        rest = list(keys[len(found):])
        for name in shared:
            if not rest:
                break
            tier = self._tiers[name]
            present = await tier.contains(rest)  # the tier counts its lookups and hits
            run = 0
            while run < len(present) and present[run]:
                run += 1
            found.extend([name] * run)
            rest = rest[run:]
            if run < len(present):
                break
        return LookupResult(len(found), tuple(found))

    async def get(self, keys: Sequence[Key], tiers: Sequence[str] | None = None) -> list[torch.Tensor | None]:
        """Read the longest available prefix of ``keys``; entries past it (or failed reads) are None.

        A chunk read from a slower tier is promoted to the fastest tier of the chain when configured.
        """
        keys, chain = check_keys(keys), self._chain(tiers)
        result = await self.lookup(keys, chain)
        out: list[torch.Tensor | None] = [None] * len(keys)
        by_tier: dict[str, list[int]] = {}
        for i, name in enumerate(result.tiers):
            by_tier.setdefault(name, []).append(i)
        for name, positions in by_tier.items():
            values = await self._read_tracked(name, [keys[i] for i in positions])
            for i, value in zip(positions, values, strict=True):
                out[i] = value
        if self.promote_on_hit and chain:
            promote = [(keys[i], out[i]) for i, name in enumerate(result.tiers)
                       if name != chain[0] and out[i] is not None]
            if promote:
                await self._promote([(k, v) for k, v in promote if v is not None], chain)
        return out

    async def _read_tracked(self, name: str, keys: list[Key]) -> list[torch.Tensor | None]:
        """Read from one tier with the keys held (pinned and touched, as the scheduler half holds a hit's keys:
        ``Directory.hold``); failed reads leave the directory."""
        tier = self._tiers[name]
        if tier.is_shared:
            return await tier.get(keys)
        self.directory.hold(name, keys)
        try:
            values = await tier.get(keys)
        finally:
            self.directory.unpin(name, keys)
        failed = [k for k, v in zip(keys, values, strict=True) if v is None]
        if failed:
            self.directory.remove(name, failed)
        return values

    async def put(self, items: Sequence[tuple[Key, torch.Tensor]], tiers: Sequence[str] | None = None,
                  parents: Sequence[Key | None] | None = None) -> int:
        """Store chunks following the write policy (kvtier.control.planner: a chunk the first tier refuses goes down the
        chain, one no tier takes is counted ``unplaced``); return how many the first tier of the chain stored.
        Invalid items (see the module docstring) raise ``TypeError`` / ``ValueError`` before anything is stored."""
        items, chain = check_items(items, parents), self._chain(tiers)
        done = await self._store(items, chain, parents, self.write_policy)
        return done.get(chain[0], 0) if chain else 0

    async def _store(self, items: Sequence[tuple[Key, torch.Tensor]], chain: list[str],
                     parents: Sequence[Key | None] | None, write: WritePolicy) -> dict[str, int]:
        if not chain or not items:
            return {}
        parents = parents if parents is not None else [None, *[k for k, _ in items[:-1]]]
        payloads = {k: v for k, v in items}
        entries = [(k, v.nbytes, p) for (k, v), p in zip(items, parents, strict=True)]
        placement = place(self.directory, chain, entries, write, self._stored_size)
        return await self.execute(placement.plans, payloads)

    async def _promote(self, items: Sequence[tuple[Key, torch.Tensor]], chain: list[str]) -> None:
        """Copy chunks read from slower tiers into the first tier (its victims demoted); what it refuses stays
        where it was read from (planner.promote)."""
        entries = [(k, v.nbytes, None) for k, v in items]
        await self.execute(promote(self.directory, chain, entries, self._stored_size), dict(items))

    def _stored_size(self, tier: str, nbytes: int) -> int:
        return self._tiers[tier].stored_size(nbytes)

    # ---- data plane ---------------------------------------------------------------------------------------
    async def read(self, tier: str, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        return await self._tiers[self._tier_name(tier)].get(check_keys(keys))

    async def read_into(self, tier: str, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Copy records into caller buffers (contiguous, the record's byte size); False for a miss."""
        return await self._tiers[tier].get_into(items)

    def borrow(self, tier: str, keys: Sequence[Key], wait_s: float | None = None) -> list[torch.Tensor | None] | None:
        """Records to read without copying them first, on the caller's thread (no I/O loop): a memory tier lends
        zero-copy views, pinned (their bytes stay valid) until ``release``; None for a miss. None for a tier that
        lends nothing: ``read`` it. Pair every list returned with ``release(tier, keys)``. ``wait_s``: the longest
        wait for another thread's call on the tier (``TimeoutError`` past it, nothing pinned)."""
        target = self._tiers[tier]
        return target.borrow(keys, wait_s) if isinstance(target, Borrowing) else None

    def release(self, tier: str, keys: Sequence[Key]) -> None:
        """End a ``borrow``: the views it lent may be overwritten from now on."""
        target = self._tiers[tier]
        if isinstance(target, Borrowing):
            target.release(keys)

    async def write(self, tier: str, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """Store records in one tier, bypassing the directory (checked as ``put`` checks them)."""
        return await self._tiers[self._tier_name(tier)].put(check_items(items))

    async def delete(self, tier: str, keys: Sequence[Key]) -> int:
        return await self._tiers[self._tier_name(tier)].delete(check_keys(keys))

    async def move(self, src: str, dst: str, keys: Sequence[Key]) -> list[bool]:
        """Copy records from ``src`` to ``dst`` (write-back demotion); the caller drops them from ``src``."""
        values = await self._tiers[src].get(keys)
        present = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
        written = iter(await self._tiers[dst].put(present)) if present else iter(())
        return [next(written) if v is not None else False for v in values]

    async def execute(self, plans: Sequence[StorePlan], payloads: Mapping[Key, torch.Tensor],
                      failed: list[tuple[str, Key]] | None = None, *, skip_writes: bool = False) -> dict[str, int]:
        """Run store plans in order (each drops ``plan.evicted`` from its tier, then writes ``plan.store``, or moves
        it from ``plan.source``), completing each in the directory; return stored counts per tier, and add every
        (tier, key) not stored to ``failed`` when given.

        Every plan runs: one that raises (a failing medium, a failed ``source`` move) is logged and completed
        as failed, so its keys never stay PENDING, and the next plans still run; cancelled, it completes this and
        every later plan as failed (and adds them to ``failed``) before the cancellation propagates.
        ``skip_writes``: the plans' writes of ``payloads`` are completed as not stored (a save the worker chose to
        drop); their evictions still run (the directory has already counted their room as free), and so do the
        moves (another chunk's demotion: leaving it out would drop that chunk from the tier it leaves)."""
        stored: dict[str, int] = {}
        with self._busy():
            for i, plan in enumerate(plans):
                try:
                    if plan.evicted:  # the directory counted the evictions it chose; the tier counts its deletes
                        await self._tiers[plan.tier].delete(plan.evicted)
                    if plan.source is not None:
                        ok = await self.move(plan.source, plan.tier, plan.store)
                    elif skip_writes:
                        ok = [False] * len(plan.store)
                    else:
                        ok = await self._tiers[plan.tier].put([(k, payloads[k]) for k in plan.store])
                except Exception:
                    logger.exception("store plan for tier %s failed (%d keys)", plan.tier, len(plan.store))
                    ok = [False] * len(plan.store)
                except BaseException:  # cancelled (a bounded wait gave up): no key of this or later plans stays PENDING
                    for rest in plans[i:]:
                        self._complete(rest, [False] * len(rest.store), failed)
                    raise
                else:
                    stored[plan.tier] = stored.get(plan.tier, 0) + sum(ok)
                self._complete(plan, ok, failed)
        return stored

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Count an ``execute`` in flight, for ``quiet``."""
        self._executing += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self._executing -= 1
            if not self._executing:
                self._quiet.set()

    async def quiet(self) -> None:
        """Wait until no ``execute`` is in flight (on the store's event loop)."""
        await self._quiet.wait()

    def _complete(self, plan: StorePlan, ok: Sequence[bool], failed: list[tuple[str, Key]] | None) -> None:
        """Mark the plan's writes done in the directory, when this process holds it (a worker reports instead), and
        add the ones not stored to ``failed``."""
        if self._directory is not None:
            self._directory.complete_store(plan.tier, plan.store, ok)
        if failed is not None:
            failed.extend((plan.tier, k) for k, done in zip(plan.store, ok, strict=True) if not done)

# -- persisting at close: kvtier.control.persist plans the copies; here a one-process store runs them

PERSIST_BATCH = 64  # chunks read and written per round of ``persist_memory`` (the budget is checked between rounds)


async def persist_memory(store: TieredStore, budget_s: float, clock: Callable[[], float] = time.monotonic) -> int:
    """Copy the READY chunks each memory tier of ``store`` (one holding its directory) alone holds into the first
    persistent local tier after it, in the order they were stored, until all are copied or ``budget_s`` has passed
    (a round already started finishes: at most ``PERSIST_BATCH`` chunks past it); return how many were copied."""
    deadline, copied = clock() + budget_s, 0
    directory, order = store.directory, store.tier_names
    for name in order:
        target = copy_target(order, name, lambda n: _persistent(store, n)) if store.tier(name).is_memory else None
        if target is None:
            continue
        keys = [k for k in directory.ready_keys(name) if not directory.holds(target[0], k)]
        for i in range(0, len(keys), PERSIST_BATCH):
            if clock() >= deadline:
                left = len(keys) - i
                logger.warning("tier %s: %d chunk(s) not persisted to %s: the %.1fs budget ran out (%d copied)",
                               name, left, target[0], budget_s, copied)
                return copied
            copied += await _copy_round(store, name, target, keys[i:i + PERSIST_BATCH])
    return copied


def _persistent(store: TieredStore, name: str) -> bool:
    tier = store.tier(name)
    return not tier.is_memory and not tier.is_shared


async def _copy_round(store: TieredStore, source: str, target: tuple[str, list[str]], keys: list[Key]) -> int:
    """Read ``keys`` from ``source`` (pinned meanwhile) and store them in the target through the directory."""
    directory = store.directory
    directory.pin(source, keys)
    try:
        values = await store.read(source, keys)
    finally:
        directory.unpin(source, keys)
    items = {k: v for k, v in zip(keys, values, strict=True) if v is not None}
    name, below = target
    size = store.tier(name).stored_size
    entries = [(k, size(v.numel() * v.element_size()), directory.parent(source, k)) for k, v in items.items()]
    plans = directory.prepare_store(name, entries, below)
    return (await store.execute(plans, items)).get(name, 0)
