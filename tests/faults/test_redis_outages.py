"""Redis killed, restarted, frozen, paused and slowed under the REAL reference engine with KVTierConnector.

Each test runs four waves (``faultkit.fault_waves``): wave 0 stores, wave 1 runs while the fault is on, wave 2
stores after recovery, wave 3 repeats earlier prefixes. Every time: no exception reaches the engine (the run
would raise), outputs equal the no-connector run exactly, no block leaks, the slowest engine step stays under
a guard bound derived from the configured timeouts (not a benchmark), and hits come back after recovery.
The tier-level versions (every operation, the breaker's states, a kill mid-transfer) are in
tests/tiers/test_redis_faults.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from faultkit import (
    FaultRun,
    assert_clean,
    assert_identical,
    fault_waves,
    make_config,
    run_faulted,
    tier_section,
    wait_breaker_closed,
)

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import KvtierConfig
from kvtier.connector.scheduler.half import LOOKUP_TIMEOUT_S
from kvtier.engine import KVTierPair

TIMEOUT = 0.2
FAILURES = 3
# A step blocks at most on the scheduler's Redis lookups: each ends within max(timeout, the lookup's own bound)
# and the breaker opens after FAILURES of them (one more for a half-open probe). 3x that, plus a second for a
# loaded CI machine: a server answering nothing without these bounds would block the engine until TCP gives up.
STEP_GUARD = 3 * (FAILURES + 1) * max(TIMEOUT, 2 * LOOKUP_TIMEOUT_S) + 1.0
WAVES = fault_waves()


def redis_config(server: RedisServer, timeout: float = TIMEOUT) -> KvtierConfig:
    return make_config([tier_section("redis", url=server.url, timeout=timeout, connect_timeout=timeout,
                                     breaker_failures=FAILURES, breaker_backoff=0.3)])


def check_run(run: FaultRun, *, during_hits: bool | None = None) -> None:
    """The checks every scenario shares; ``during_hits``: whether wave 1 (under the fault) may load."""
    assert_identical(run, WAVES)
    assert_clean(run)
    assert run.max_step < STEP_GUARD, (run.max_step, run.wave_step_max)
    assert run.wave_hits("w0-") == 0  # nothing stored yet
    assert run.wave_hits("w3-c") > 0, "hits did not resume after recovery"
    if during_hits is False:
        assert run.wave_hits("w1-") == 0
    if during_hits is True:
        assert run.wave_hits("w1-") > 0


def test_killed_then_restarted(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    recovery: list[float] = []

    def between(i: int, pair: KVTierPair) -> None:
        if i == 0:
            server.kill()
        elif i == 1:
            server.start()  # same port, empty
            recovery.append(wait_breaker_closed(pair))

    run = run_faulted(redis_config(server), WAVES, between_waves=between)
    check_run(run, during_hits=False)
    assert recovery[0] < 31  # within the breaker's longest back-off
    stats = run.tier_stats("redis")
    assert stats.errors + stats.timeouts > 0 and stats.extra["breaker_opens"] >= 1
    assert stats.extra["breaker_state"] == 0  # closed again after recovery
    assert run.wave_hits("w3-a") == 0  # the restarted server is empty: wave 0's records are gone, not wrong


def test_frozen_with_sigstop(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()

    def between(i: int, pair: KVTierPair) -> None:
        if i == 0:
            server.pause()
        elif i == 1:
            server.resume()
            wait_breaker_closed(pair)

    try:
        run = run_faulted(redis_config(server), WAVES, between_waves=between)
    finally:
        server.resume()
    check_run(run, during_hits=False)
    assert run.tier_stats("redis").timeouts > 0
    assert run.wave_hits("w3-a") > 0  # the records survived the freeze


def test_client_pause_longer_than_the_timeout(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()

    def between(i: int, pair: KVTierPair) -> None:
        if i == 0:
            server.client_pause(2.0)
        elif i == 1:
            wait_breaker_closed(pair)

    run = run_faulted(redis_config(server), WAVES, between_waves=between)
    check_run(run)
    assert run.tier_stats("redis").timeouts > 0


@contextmanager
def slowed(server: RedisServer, sleep: float, every: float) -> Iterator[list[int]]:
    """Block the whole server for ``sleep`` seconds every ``every`` seconds (``DEBUG SLEEP``) while inside."""
    stop, sent = threading.Event(), threading.Event()
    count = [0]
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)

    def loop() -> None:
        while True:
            count[0] += 1
            sent.set()
            client.execute_command("DEBUG", "SLEEP", str(sleep))
            if stop.wait(every):
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    sent.wait(5)
    time.sleep(0.02)  # the first stall has begun when the caller goes on
    try:
        yield count
    finally:
        stop.set()
        thread.join()
        client.close()


def test_slowed_below_the_timeout_keeps_serving_hits(debug_redis: RedisServer) -> None:
    """A server stalling 60 ms at a time is slow, not down: with a 1 s timeout loads still succeed."""
    with slowed(debug_redis, 0.06, 0.03) as sleeps:
        run = run_faulted(redis_config(debug_redis, timeout=1.0), WAVES)
    assert sleeps[0] > 0
    check_run(run, during_hits=True)
    assert run.wave_hits("w3-a") > 0
    assert run.load_failures() == 0


def test_slowed_above_the_timeout_degrades_to_misses(debug_redis: RedisServer) -> None:
    """Stalls of 0.5 s against a 0.2 s timeout: some calls time out (misses), the engine never waits long."""
    stalls: dict[int, Callable[[], None]] = {}

    def between(i: int, pair: KVTierPair) -> None:
        if i == 0:
            ctx = slowed(debug_redis, 0.5, 0.05)
            ctx.__enter__()
            stalls[1] = lambda: ctx.__exit__(None, None, None)
        elif i in stalls:
            stalls.pop(i)()
            wait_breaker_closed(pair)

    try:
        run = run_faulted(redis_config(debug_redis), WAVES, between_waves=between)
    finally:
        for stop in stalls.values():
            stop()
    check_run(run)
    assert run.tier_stats("redis").timeouts > 0
