"""A circuit breaker: stop calling a server that keeps failing, probe it again after a back-off.

States: CLOSED (calls go through; ``failures`` consecutive failures open it) -> OPEN (calls are refused at once
for ``backoff`` seconds) -> HALF_OPEN (exactly one probe call goes through: success closes the breaker and resets
the back-off, failure reopens it with the back-off doubled, up to ``max_backoff``). The clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Consecutive-failure breaker with exponential back-off. Not thread-safe: use it from one event loop."""

    def __init__(self, failures: int = 3, backoff: float = 1.0, max_backoff: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = max(1, failures)
        self.base_backoff = backoff
        self.max_backoff = max(backoff, max_backoff)
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.backoff = backoff
        self.consecutive = 0
        self.opens = 0
        self.rejected = 0
        self._opened_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        """May a call go to the server now? When OPEN and the back-off has passed, lets one probe through."""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN and self._clock() - self._opened_at >= self.backoff:
            self.state = BreakerState.HALF_OPEN
        if self.state == BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        self.rejected += 1
        return False

    def success(self) -> None:
        """The call that ``allow`` let through worked."""
        self.consecutive = 0
        self._probing = False
        if self.state != BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self.backoff = self.base_backoff

    def failure(self) -> None:
        """The call that ``allow`` let through failed (error or timeout)."""
        self.consecutive += 1
        if self.state == BreakerState.HALF_OPEN:
            self.backoff = min(self.backoff * 2, self.max_backoff)
            self._open()
        elif self.state == BreakerState.CLOSED and self.consecutive >= self.threshold:
            self._open()
        self._probing = False

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = self._clock()
        self.opens += 1
