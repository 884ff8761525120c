"""Memory pools take host memory as records arrive, not their whole capacity at start (issue 19).

Resident memory is measured in a fresh subprocess (``VmRSS`` and ``ru_maxrss``), so that nothing else this test
process holds counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from contract import assert_same, key, rand

from kvtier.config import CpuTierConfig
from kvtier.errors import TierUnavailable
from kvtier.tiers.memory.arena import HUGE_PAGE, Arena
from kvtier.tiers.memory.cpu import CpuTier
from kvtier.tiers.memory.free_runs import FreeRuns
from kvtier.tiers.memory.slots import SlotPool

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GiB = 1 << 30

PRELUDE = """
import asyncio, json, resource, sys
import torch

def vm_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""


def run_child(body: str, tmp_path: Path, timeout: float = 120) -> dict[str, Any]:
    """Run ``PRELUDE + body`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVTIER_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_default_config_store_with_one_4k_tensor_stays_near_the_import_baseline(tmp_path: Path) -> None:
    """README's snippet: ``configs/default.yaml`` (a 2 GiB cpu tier and a disk tier), one 4 KiB tensor."""
    got = run_child("""
        from kvtier import TieredStore, load_config
        base = peak()
        async def main() -> bool:
            store = TieredStore.from_config(load_config("configs/default.yaml"))
            await store.start()
            key = bytes(range(32))
            await store.put([(key, torch.arange(1024, dtype=torch.float32))])  # 4 KiB
            [back] = await store.get([key])
            await store.close()
            return back is not None and torch.equal(back, torch.arange(1024, dtype=torch.float32))
        ok = asyncio.run(main())
        print(json.dumps({"ok": ok, "base": base, "peak": peak()}))
    """, tmp_path)
    assert got["ok"]
    assert got["peak"] - got["base"] < 64 * MiB, got  # was 2.1 GiB: the whole pool touched at start


def test_cpu_pool_of_gigabytes_filled_with_64_mib_holds_about_64_mib(tmp_path: Path) -> None:
    got = run_child("""
        from kvtier.config import CpuTierConfig
        from kvtier.tiers.memory.cpu import CpuTier
        chunk, n = 256 << 10, 256  # 64 MiB in 256 KiB records
        src = torch.randint(0, 255, (chunk * n,), dtype=torch.uint8)  # resident before the baseline
        keys = [i.to_bytes(32, "little") for i in range(2 * n)]
        async def main() -> dict[str, int | bool]:
            tier = CpuTier(CpuTierConfig(name="cpu", capacity=4 << 30, pin_memory=False))
            base = vm_rss()
            await tier.start()
            started = vm_rss()
            items = [(keys[i], src[i * chunk:(i + 1) * chunk]) for i in range(n)]
            ok = all(await tier.put(items))
            arena = tier.pool._arena
            ok = ok and arena is not None and arena.prefault is not None and arena.prefault.settle(30.0)
            filled, committed = vm_rss(), tier.committed_bytes()
            for _ in range(4):  # churn: the freed slots are reused, the pool does not grow
                await tier.delete(keys[:n // 2])
                ok = ok and all(await tier.put(items[:n // 2]))
            [back] = await tier.get([keys[n - 1]])
            ok = ok and back is not None and torch.equal(back, src[(n - 1) * chunk:])
            del back
            churned, churned_committed = vm_rss(), tier.committed_bytes()
            await tier.close()
            return {"ok": ok, "base": base, "started": started, "filled": filled, "committed": committed,
                    "churned": churned, "churned_committed": churned_committed}
        print(json.dumps(asyncio.run(main())))
    """, tmp_path)
    assert got["ok"]
    assert got["started"] - got["base"] < 4 * MiB, got  # reserving 4 GiB commits nothing
    assert got["committed"] == got["churned_committed"] == 64 * MiB
    # the written 64 MiB, and at most as much again backed ahead of the next puts (kvtier.tiers.memory.prefault)
    assert 60 * MiB <= got["filled"] - got["base"] <= 2 * 64 * MiB + 8 * MiB, got
    assert got["churned"] - got["filled"] <= 8 * MiB, got  # the get's result buffer, nothing more


def test_demo_with_the_16_gib_cpu_config_stays_under_1_gib(tmp_path: Path) -> None:
    """``kvtier demo --config configs/cpu.yaml`` (a 16 GiB cpu tier) peaked at 17.1 GB RSS."""
    got = run_child("""
        import subprocess
        cmd = [sys.executable, "-m", "kvtier", "demo", "--config", "configs/cpu.yaml", "--users", "2",
               "--turns", "2", "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(json.dumps({"rc": proc.returncode, "peak": child, "out": proc.stdout[-400:], "err": proc.stderr[-800:]}))
    """, tmp_path, timeout=330)
    assert got["rc"] == 0, got
    assert "outputs identical with and without the cache: yes" in got["out"]
    assert got["peak"] < 1 * GiB, got


def test_arena_reserves_aligned_address_space_and_tracks_the_written_mark() -> None:
    arena = Arena(1 * GiB, torch.device("cpu"), pin_memory=False)
    assert arena.on_demand and arena.committed == 0
    assert arena.buf.numel() == 1 * GiB and arena.buf.data_ptr() % HUGE_PAGE == 0
    arena.commit(4096)
    assert arena.committed == HUGE_PAGE
    arena.commit(1000)
    assert arena.committed == HUGE_PAGE  # never goes down
    arena.commit(2 * GiB)
    assert arena.committed == 1 * GiB  # capped at the capacity
    arena.close()
    assert arena.committed == 0


def test_arena_on_a_device_is_allocated_whole() -> None:
    """The gpu tier's path (pinned memory takes it too), on the ``meta`` device: no CUDA here."""
    arena = Arena(3 * 4096, torch.device("meta"), pin_memory=False)
    assert not arena.on_demand and arena.committed == 3 * 4096
    assert arena.buf.device.type == "meta" and arena.buf.numel() == 3 * 4096
    arena.zero()
    arena.commit(1 << 40)
    assert arena.committed == 3 * 4096


def test_pool_commits_only_what_records_take() -> None:
    pool = SlotPool(256 * MiB, slot_bytes=1 * MiB)
    pool.allocate()
    assert pool.committed_bytes() == 0 and pool.used_bytes() == 0
    tensors = [rand((256 * 1024,), seed=i) for i in range(3)]  # 1 MiB each
    assert pool.put_many([(key(i), t) for i, t in enumerate(tensors)]) == [True] * 3
    assert pool.committed_bytes() == 4 * MiB  # 3 MiB written, rounded up to a huge page
    for i, t in enumerate(tensors):
        assert_same(pool.get(key(i)), t)
    pool.release()
    assert pool.committed_bytes() == 0


def test_free_runs_reuse_slots_below_the_high_water_mark_first() -> None:
    runs = FreeRuns(100)
    for i in range(10):
        assert runs.take(1) == [(i, 1)]
    assert runs.high == 10
    runs.give(3, 1)  # a hole below the mark
    runs.give(9, 1)  # merges with the never-used tail: the newest run now starts at 9
    assert runs.take(1) == [(9, 1)]
    assert runs.take(1) == [(3, 1)]  # the older hole, not slot 10: the mark stays
    assert runs.high == 10
    assert runs.take(1) == [(10, 1)]  # only now, with no hole left
    assert runs.high == 11


def test_uniform_records_under_churn_never_raise_the_mark_above_the_peak() -> None:
    """Records of one size, deleted and stored in a shuffled order: the pool keeps reusing the same slots."""
    pool = SlotPool(64 * MiB, slot_bytes=64 << 10)
    pool.allocate()
    t = torch.zeros(16 * 1024)  # 64 KiB: one slot
    live: list[int] = []
    peak = 0
    gen = torch.Generator().manual_seed(7)
    for step in range(2000):
        if len(live) >= 40 or (live and torch.rand(1, generator=gen).item() < 0.45):
            victim = live.pop(int(torch.randint(len(live), (1,), generator=gen)))
            assert pool.delete(key(victim))
        else:
            assert pool.put(key(step), t)
            live.append(step)
            peak = max(peak, len(live))
    assert peak == 40
    assert pool._free is not None and pool._free.high == peak  # no slot above the peak was ever used
    assert pool.committed_bytes() == HUGE_PAGE * 2  # 40 slots of 64 KiB = 2.5 MiB, rounded up to 2 MiB
    assert len(pool) == len(live)


async def test_a_capacity_beyond_the_address_space_is_unavailable_with_the_fix() -> None:
    tier = CpuTier(CpuTierConfig(name="cpu", capacity=1 << 50, pin_memory=False))  # 1 PiB
    with pytest.raises(TierUnavailable, match=r"tier 'cpu': cannot reserve 1125899906842624 bytes .*lower its"):
        await tier.start()


async def test_cpu_tier_reports_its_committed_bytes() -> None:
    tier = CpuTier(CpuTierConfig(name="cpu", capacity=1 * GiB, pin_memory=False))
    await tier.start()
    assert tier.committed_bytes() == 0
    assert await tier.put([(key(0), rand((1024,)))]) == [True]
    assert tier.committed_bytes() == HUGE_PAGE and tier.used_bytes() == 4096
    await tier.close()


def resident(buf: torch.Tensor, start: int, end: int) -> list[bool]:
    """Whether each 4 KiB page of bytes ``start .. end`` of ``buf`` is backed (``mincore``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (end - start) // 4096
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(buf.data_ptr() + start, end - start, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_pages_past_the_written_mark_are_backed_ahead_and_keep_their_bytes() -> None:
    arena = Arena(256 * MiB, torch.device("cpu"), pin_memory=False)
    assert arena.prefault is not None
    pattern = torch.randint(0, 255, (MiB,), dtype=torch.uint8)
    arena.buf[5 * MiB:6 * MiB].copy_(pattern)  # bytes already in the window: backing must not change them
    assert not any(resident(arena.buf, 6 * MiB, 8 * MiB))
    arena.commit(3 * MiB)  # the mark: 4 MiB (2 MiB pages); backed ahead: 4 MiB more
    assert arena.prefault.settle(30.0)
    if arena.prefault.backed < 8 * MiB or not all(resident(arena.buf, 4 * MiB, 8 * MiB)):
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE (Linux 5.14+)")
    assert torch.equal(arena.buf[5 * MiB:6 * MiB], pattern)
    assert not arena.buf[4 * MiB:5 * MiB].any() and not arena.buf[6 * MiB:8 * MiB].any()
    assert not any(resident(arena.buf, 8 * MiB, 16 * MiB))  # at most the mark's size ahead
    arena.commit(200 * MiB)  # the mark: 200 MiB; ahead: capped at 64 MiB, then at the capacity
    assert arena.prefault.settle(30.0)
    assert all(resident(arena.buf, 200 * MiB, 256 * MiB)) and arena.prefault.backed == 256 * MiB
    arena.close()
    assert arena.prefault is None


def test_a_pool_dropped_without_close_frees_its_memory_and_its_prefault_thread_ends() -> None:
    """The background thread holds the pool's memory only while it backs pages: a pool nobody closed is freed,
    and the thread sees it and stops."""
    import gc

    from kvtier.tiers.memory.arena import Arena
    from kvtier.tiers.memory.prefault import IDLE_CHECK_S

    arena = Arena(64 << 20, torch.device("cpu"), False)
    arena.commit(4 << 20)
    assert arena.prefault is not None and arena.prefault.settle(10.0)
    thread = arena.prefault._thread
    assert thread is not None and thread.is_alive()
    del arena
    gc.collect()
    thread.join(3 * IDLE_CHECK_S + 5.0)
    assert not thread.is_alive()


def test_close_waits_for_a_call_in_progress_so_no_thread_is_in_madvise_at_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon thread still inside ``madvise`` when the interpreter exits can abort the process; close() returns
    only once the thread has ended (bounded by CLOSE_JOIN_S)."""
    import threading

    from kvtier.tiers.memory import prefault

    entered = threading.Event()

    def slow_madvise(address: int, length: int, advice: int) -> int:
        entered.set()
        time.sleep(0.5)
        return 0

    monkeypatch.setattr(prefault, "populate_call", lambda: slow_madvise)
    buf = torch.zeros(16 << 20, dtype=torch.uint8)
    backer = prefault.Prefaulter(buf)
    backer.want(4 << 20)
    assert entered.wait(10.0)
    thread = backer._thread
    backer.close()
    assert thread is not None and not thread.is_alive()


def test_backing_ahead_retries_an_interrupted_call_and_stops_where_the_kernel_refuses() -> None:
    """EINTR / EAGAIN (a signal, a transient shortage) is tried again; EINVAL (no MADV_POPULATE_WRITE) stops."""
    import ctypes
    import errno

    from kvtier.tiers.memory.prefault import MADV_POPULATE_WRITE, _populate

    def kernel(answers: list[int]) -> tuple[list[int], Any]:
        calls: list[int] = []

        def madvise(address: int, length: int, advice: int) -> int:
            calls.append(advice)
            code = answers[len(calls) - 1]
            ctypes.set_errno(code)
            return 0 if code == 0 else -1
        return calls, madvise

    calls, madvise = kernel([errno.EINTR, errno.EAGAIN, 0])
    assert _populate(madvise, 4096, 4096) and calls == [MADV_POPULATE_WRITE] * 3
    calls, madvise = kernel([errno.EINVAL, 0])
    assert not _populate(madvise, 4096, 4096) and len(calls) == 1
