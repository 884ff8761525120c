"""The worker half's counters (thread-safe: loads run on the engine's thread, saves on the I/O loop), the chunks
of one group gathered for one scatter (they count as loaded only once the scatter completed), and the scheduler
half's reading of the control rows workers put in their stats (kvtier disabled, saves not stored)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvtier.connector.plans import DISABLED, FAILED_SAVES
from kvtier.keys import Key

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class WorkerCounters:
    """Thread-safe counters and failed-save rows (loads run on the caller's thread, saves on the I/O loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}
        self._totals: dict[str, float] = {}  # since start, never taken
        self._failed: list[list[str]] = []

    def add(self, **values: float) -> None:
        with self._lock:
            for name, value in values.items():
                self._data[name] = self._data.get(name, 0) + value
                self._totals[name] = self._totals.get(name, 0) + value

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def fail(self, rows: Iterable[list[str]]) -> None:
        with self._lock:
            self._failed.extend(rows)

    def take(self) -> dict[str, Any]:
        with self._lock:
            data: dict[str, Any] = dict(self._data)
            if self._failed:
                data[FAILED_SAVES] = self._failed
            self._data, self._failed = {}, []
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


def worker_disabled(stats: Any) -> bool:
    """Whether a worker reported (``kvtier_disabled`` in its stats, also inside a MultiConnector's) that it could not
    read the engine's KV tensors."""
    data = getattr(stats, "data", None)
    if not isinstance(data, dict):
        return False
    if data.get(DISABLED):
        return True
    return any(worker_disabled(child) for child in data.values() if hasattr(child, "data"))


def failed_saves(stats: Any) -> list[tuple[str, str, Key, str]]:
    """(request id, tier, key, rank) of every chunk the workers reported not stored (``failed_saves`` rows of
    the stats; a MultiConnector's stats hold each child's stats by class name)."""
    data = getattr(stats, "data", None)
    if not isinstance(data, dict):
        return []
    rows = data.get(FAILED_SAVES)
    if rows is None:
        return [row for child in data.values() if hasattr(child, "data") for row in failed_saves(child)]
    out: list[tuple[str, str, Key, str]] = []
    for row in rows:
        try:
            req_id, tier, key, rank = row
            out.append((str(req_id), str(tier), bytes.fromhex(key), str(rank)))
        except (TypeError, ValueError):
            logger.warning("ignoring a malformed failed-save row %r", row)
    return out
