"""Exception hierarchy. Every error kvtier raises on purpose derives from KvtierError."""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of kvtier's errors."""


class ConfigError(KvtierError, ValueError):
    """An invalid configuration. The message names the key path and how to fix it."""

    def __init__(self, path: str, message: str, hint: str | None = None) -> None:
        self.path = path
        self.message = message
        self.hint = hint
        text = f"{path}: {message}" if path else message
        if hint:
            text = f"{text} ({hint})"
        super().__init__(text)


class CorruptRecord(KvtierError):
    """A record read from a tier failed validation; the store treats it as a miss and deletes it."""


class TierUnavailable(KvtierError):
    """A tier cannot be reached (dead server, timeout, open circuit breaker)."""


class ConnectorError(KvtierError):
    """A connector could not be resolved or constructed."""
