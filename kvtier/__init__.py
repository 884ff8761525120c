"""kvtier: a multi-tier KV cache for LLM inference engines.

Importing kvtier is cheap: torch, redis and vllm are imported only by the modules that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["ConfigError", "CorruptRecord", "KvtierError", "TieredStore", "__version__", "load_config"]

if TYPE_CHECKING:
    from kvtier.config import load_config
    from kvtier.errors import ConfigError, CorruptRecord, KvtierError
    from kvtier.store.tiered import TieredStore


def __getattr__(name: str) -> Any:
    if name == "load_config":
        from kvtier.config import load_config

        return load_config
    if name == "TieredStore":
        from kvtier.store.tiered import TieredStore

        return TieredStore
    if name in ("ConfigError", "CorruptRecord", "KvtierError"):
        from kvtier import errors

        return getattr(errors, name)
    raise AttributeError(name)
