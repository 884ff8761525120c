"""``SlotPool``: records as raw bytes in fixed-size slots of one buffer, in host or device memory. The buffer
(:mod:`kvtier.tiers.memory.arena`) reserves the capacity; pageable host memory is backed only where records are
written. The slot rules (sizes, runs, pins and deferred frees) are described in
:mod:`kvtier.tiers.memory.pool`, whose ``PoolTier`` owns a pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvtier.records.codec import slot_aligned, stored_size
from kvtier.records.keys import Key
from kvtier.tiers.memory.arena import Arena
from kvtier.tiers.memory.copies import Piece, copy_pieces
from kvtier.tiers.memory.free_runs import FreeRuns, Run
from kvtier.tiers.memory.recycle import DEFAULT_MAX_IDLE, Recycler


@dataclass(frozen=True, slots=True)
class Slotted:
    """Where a record lives in the pool and how to rebuild its tensor."""

    runs: tuple[Run, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class SlotPool:
    """Records as raw bytes in fixed-size slots of one buffer. Synchronous; the owning tier adds stats."""

    def __init__(self, capacity: int, device: str | torch.device = "cpu", slot_bytes: int | None = None,
                 pin_memory: bool = False) -> None:
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self._slot = slot_aligned(slot_bytes) if slot_bytes else 0
        self._buf: torch.Tensor | None = None
        self._arena: Arena | None = None
        self._free: FreeRuns | None = None
        self._map: dict[Key, Slotted] = {}
        self._pins: dict[Key, int] = {}
        self._deferred: dict[Key, list[tuple[Run, ...]]] = {}
        self._used_slots = 0
        # pageable host results reuse memory their callers dropped (pinned ones: CUDA's caching host allocator)
        self._recycler = Recycler(min(self.capacity, DEFAULT_MAX_IDLE)) if self.device.type == "cpu" else None

    def allocate(self) -> None:
        """Reserve the buffer (pinned and device memory: allocate it whole and zero it)."""
        if self._buf is not None:
            return
        self._arena = Arena(self.capacity, self.device, self.pin_memory and self.device.type == "cpu")
        self._arena.zero()
        self._buf = self._arena.buf
        if self._slot:
            self._free = FreeRuns(self.capacity // self._slot)

    def release(self) -> None:
        """Drop the buffer and every record."""
        self._buf = self._free = None
        if self._arena is not None:
            self._arena.close()  # a mapping is unmapped when the last tensor view of it is gone
            self._arena = None
        self._map.clear()
        self._pins.clear()
        self._deferred.clear()
        self._used_slots = 0
        if self._recycler is not None:
            self._recycler.clear()

    @property
    def slot_bytes(self) -> int:
        """Slot size in bytes (0 until the first record fixes it)."""
        return self._slot

    def cost(self, nbytes: int) -> int:
        """Bytes a record of ``nbytes`` occupies: whole slots (kvtier.records.codec.stored_size)."""
        return stored_size(nbytes, signed=False, memory=True, slot_bytes=self._slot or None)

    def used_bytes(self) -> int:
        return self._used_slots * self._slot

    def committed_bytes(self) -> int:
        """High-water mark of the bytes written, rounded up to 2 MiB (pinned and device pools: the capacity)."""
        return self._arena.committed if self._arena is not None else 0

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def keys(self) -> Iterable[Key]:
        return self._map.keys()

    def nbytes(self, key: Key) -> int | None:
        rec = self._map.get(key)
        return None if rec is None else rec.nbytes

    def put(self, key: Key, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` in; False when it does not fit (an older record of the key is then kept)."""
        return self.put_many([(key, tensor)])[0]

    def put_many(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """``put`` of every item, the bookkeeping first and then every copy in one call (no per-record op
        dispatch: at 256 KiB records that was a third of the time). A key twice in ``items`` takes the
        one-by-one path, so that a later record never lands in slots an earlier copy still writes. If anything
        raises, every key placed by this call is dropped before the error propagates: its slots may hold another
        record's old bytes, and a miss is the only safe answer."""
        if len({k for k, _ in items}) != len(items):
            return [self.put(k, t) for k, t in items]
        pieces: list[Piece] = []
        done: list[bool] = []
        try:
            for k, t in items:
                done.append(self._place(k, t, pieces))
            if pieces:
                assert self._buf is not None
                copy_pieces(self._buf, pieces, into_pool=True)
        except BaseException:
            for (k, _), placed in zip(items, done, strict=False):
                if placed:
                    self._drop(k)
            raise
        return done

    def _place(self, key: Key, tensor: torch.Tensor, pieces: list[Piece]) -> bool:
        """Reserve slots for ``tensor`` under ``key`` and append the pieces to copy in."""
        if self._buf is None:
            raise RuntimeError("pool not started")
        src = tensor.contiguous()  # itself when already contiguous; else a copy the piece keeps alive
        n = src.numel() * src.element_size()
        if n and not self._slot:
            if slot_aligned(n) > self.capacity:
                return False
            self._slot = slot_aligned(n)
            self._free = FreeRuns(self.capacity // self._slot)
        need = math.ceil(n / self._slot) if n else 0
        old = self._map.get(key)
        if old is not None and key not in self._pins:
            # replacing: free the old slots first, so that the likely cache-hot ones are reused
            if need and (self._free is None or need > self._free.free + sum(c for _, c in old.runs)):
                return False
            self._drop(key)
        runs = self._take(need)
        if runs is None:
            return False
        if runs and self._free is not None and self._arena is not None:  # bookkeeping: pages are backed on write
            self._arena.commit(self._free.high * self._slot)
        self._used_slots += need
        self._pieces(runs, src, n, pieces)
        self._drop(key)
        self._map[key] = Slotted(tuple(runs), tensor.dtype, tuple(tensor.shape), n)
        return True

    def _take(self, need: int) -> list[Run] | None:
        if not need:
            return []
        return self._free.take(need) if self._free is not None else None

    def _pieces(self, runs: Sequence[Run], tensor: torch.Tensor, nbytes: int, pieces: list[Piece],
                offset: int = 0) -> None:
        """The pieces moving a record's ``nbytes`` between its slot ``runs`` and the bytes of ``tensor``
        (contiguous) from byte ``offset`` on."""
        done, slot = 0, self._slot
        for start, count in runs:
            take = min(count * slot, nbytes - done)
            pieces.append((start * slot, tensor, offset + done, take))
            done += take

    def get(self, key: Key) -> torch.Tensor | None:
        """A new tensor (same dtype and shape, on the pool's device) with the record's bytes."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[Key]) -> list[torch.Tensor | None]:
        """``get`` of every key, all copies in one call. Small pageable results of one call share recycled
        buffers (``Recycler.take_many``): one that is kept keeps its group's memory (at most 8 MiB)."""
        recs = [self._map.get(key) for key in keys]
        found = [rec for rec in recs if rec is not None]
        places = iter(self._result_places([rec.nbytes for rec in found]))
        pieces: list[Piece] = []
        out: list[torch.Tensor | None] = []
        typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (id of a buffer, dtype) -> the buffer so typed
        strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        for rec in recs:
            if rec is None:
                out.append(None)
                continue
            buf, offset = next(places)
            if not rec.nbytes:
                out.append(torch.empty(rec.shape, dtype=rec.dtype, device=self.device,
                                       pin_memory=self.pin_memory and self.device.type == "cpu"))
                continue
            self._pieces(rec.runs, buf, rec.nbytes, pieces, offset)
            view = typed.get((id(buf), rec.dtype))
            if view is None:
                view = typed[(id(buf), rec.dtype)] = buf.view(rec.dtype)
            stride = strides.get(rec.shape)
            if stride is None:
                stride = strides[rec.shape] = _contiguous_strides(rec.shape)
            out.append(view.as_strided(rec.shape, stride, offset // view.element_size()))
        if pieces:
            assert self._buf is not None
            copy_pieces(self._buf, pieces, into_pool=False)
        return out

    def _result_places(self, sizes: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        """For each ``get_many`` result, a flat ``uint8`` tensor (storage offset 0) and the byte offset of the
        result in it. Pageable host results come from the recycler, small ones sharing a buffer."""
        if self._recycler is None or self.pin_memory:
            # device results; or pinned ones (cached by CUDA's host allocator): host-to-device copies stay fast
            return [(torch.empty(n, dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory), 0)
                    for n in sizes]
        out: list[tuple[torch.Tensor, int]] = []
        last: tuple[object, torch.Tensor] | None = None
        for array, offset in self._recycler.take_many(sizes):
            if last is None or last[0] is not array:
                last = (array, torch.from_numpy(array))
            out.append((last[1], offset))
        return out

    def read_into(self, key: Key, out: torch.Tensor) -> bool:
        """Copy the record into ``out`` (contiguous, any device, same byte size); False on a miss."""
        return self.read_many([(key, out)])[0]

    def read_many(self, items: Sequence[tuple[Key, torch.Tensor]]) -> list[bool]:
        """``read_into`` of every item, all copies in one call; sizes are checked before anything is copied."""
        pieces: list[Piece] = []
        found: list[bool] = []
        for key, out in items:
            rec = self._map.get(key)
            found.append(rec is not None)
            if rec is None:
                continue
            nbytes = out.numel() * out.element_size()
            if nbytes != rec.nbytes:
                raise ValueError(f"out has {nbytes} bytes, the record {rec.nbytes}")
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
            self._pieces(rec.runs, out, rec.nbytes, pieces)
        if pieces:
            assert self._buf is not None
            copy_pieces(self._buf, pieces, into_pool=False)
        return found

    def view(self, key: Key) -> torch.Tensor | None:
        """A zero-copy view of a record stored in one run (None otherwise). Pin the key while using it."""
        rec = self._map.get(key)
        if rec is None or len(rec.runs) > 1 or self._buf is None:
            return None
        start = rec.runs[0][0] * self._slot if rec.runs else 0
        return self._buf[start:start + rec.nbytes].view(rec.dtype).reshape(rec.shape)

    def delete(self, key: Key) -> bool:
        """Remove a record; its slots return at once, or at the last unpin when pinned."""
        if key not in self._map:
            return False
        self._drop(key)
        return True

    def _drop(self, key: Key) -> None:
        rec = self._map.pop(key, None)
        if rec is None:
            return
        if key in self._pins:
            self._deferred.setdefault(key, []).append(rec.runs)
        else:
            self._free_runs(rec.runs)

    def _free_runs(self, runs: Iterable[Run]) -> None:
        for start, count in runs:
            if self._free is not None:
                self._free.give(start, count)
                self._used_slots -= count

    def pin(self, keys: Iterable[Key]) -> None:
        """Protect the slots of these keys from being reused until unpinned (counted)."""
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
                continue
            self._pins.pop(key, None)
            for runs in self._deferred.pop(key, []):
                self._free_runs(runs)

    def pinned(self) -> int:
        """Number of pinned keys (tests check for leaks)."""
        return len(self._pins)
