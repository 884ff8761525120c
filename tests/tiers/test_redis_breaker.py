"""The circuit breaker's state machine, driven by an injected clock."""

from __future__ import annotations

from kvtier.tiers.redis.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(failures=3, backoff=1.0, clock=Clock())
    for _ in range(2):
        assert b.allow()
        b.failure()
    b.success()  # resets the count
    for _ in range(2):
        b.failure()
    assert b.state == BreakerState.CLOSED and b.allow()
    b.failure()
    assert b.state == BreakerState.OPEN and b.opens == 1
    assert not b.allow() and b.rejected == 1


def test_half_open_probe_and_exponential_backoff() -> None:
    clock = Clock()
    b = CircuitBreaker(failures=1, backoff=1.0, max_backoff=3.0, clock=clock)
    b.failure()
    clock.now += 0.99
    assert not b.allow()
    clock.now += 0.02
    assert b.allow() and b.state == BreakerState.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure()
    assert b.state == BreakerState.OPEN and b.backoff == 2.0
    clock.now += 1.5
    assert not b.allow()
    clock.now += 0.6
    assert b.allow()
    b.failure()
    assert b.backoff == 3.0  # capped
    clock.now += 3.0
    assert b.allow()
    b.success()
    assert b.state == BreakerState.CLOSED and b.backoff == 1.0 and b.allow() and b.opens == 3
