"""The worker half's counters (thread-safe: loads run on the engine's thread, saves on the I/O loop), and the chunks
of one group gathered for one scatter (they count as loaded only once the scatter completed). Counters only
count: what the scheduler must act on travels in the worker report (kvtier.connector.report)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

class WorkerCounters:
    """Thread-safe counters (loads run on the caller's thread, saves on the I/O loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}
        self._totals: dict[str, float] = {}  # since start, never taken

    def add(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                self._data[name] = self._data.get(name, 0) + value
                self._totals[name] = self._totals.get(name, 0) + value

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def take(self) -> dict[str, Any]:
        with self._lock:
            data: dict[str, Any] = dict(self._data)
            self._data = {}
        return data


class GroupLoad:
    """The chunks of one group read for one scatter: their blocks, payloads and tiers."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, ...]] = []
        self.payloads: list[torch.Tensor] = []
        self.per_tier: dict[str, int] = {}
        self.nbytes = 0

    def add(self, tier: str, ids: tuple[int, ...], payload: torch.Tensor) -> None:
        self.blocks.append(ids)
        self.payloads.append(payload)
        self.per_tier[tier] = self.per_tier.get(tier, 0) + 1
        self.nbytes += payload.numel() * payload.element_size()
