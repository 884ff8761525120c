"""Connector factory: built-in names, loading by module path, legacy-constructor compatibility.

Resolution of ``config.kv_transfer_config`` (``kv_connector``, ``kv_connector_module_path``):

1. A non-empty ``kv_connector_module_path``: import the module and take the class named ``kv_connector``
   (the module path wins over the registry, as in vLLM >= 0.21). An empty string is an error.
2. Otherwise ``kv_connector`` is looked up in the registry (``name -> "module:Class"``, imported lazily, so only
   the chosen connector's module is imported), then in the optional fallback (for vLLM: vLLM's own registry).

The class must derive from one of the factory's connector base classes. Construction:

- registry and fallback classes are built-ins and are never probed: ``cls(config, role, kv_cache_config)``;
- a module-path class is probed with vLLM's ``supports_kw`` rule
  (:func:`kvtier.connector.legacy.accepts_kv_cache_config`): an explicit ``kv_cache_config`` parameter ->
  three positional arguments; only ``**kwargs`` ->
  ``cls(config, role, kv_cache_config=...)``; neither -> legacy: a logged deprecation warning and
  ``cls(config, role)``, through the adapter of :mod:`kvtier.connector.legacy` when the base class requires
  ``kv_cache_config`` (so the legacy class ends with ``_kv_cache_config is None``).

``DEFAULT_FACTORY`` builds kvtier's engine-neutral connectors; ``kvtier.integrations.vllm`` builds its own
factory over vLLM's base class and registry.
"""

from __future__ import annotations

import enum
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.connector.base import KVConnectorBase
from kvtier.connector.legacy import accepts_kv_cache_config, legacy_class, names_kv_cache_config
from kvtier.errors import ConnectorError

logger = logging.getLogger(__name__)

BUILTIN_CONNECTORS: dict[str, str] = {
    "KVTierConnector": "kvtier.connector.tiered:TieredConnector",
    "MultiConnector": "kvtier.connector.multi:MultiConnector",
    "KVTierMultiConnector": "kvtier.connector.multi:MultiConnector",
}


class ConstructorStyle(enum.StrEnum):
    """How a resolved connector class is called."""

    BUILTIN = "builtin"  # registry class, never probed: (config, role, kv_cache_config)
    POSITIONAL = "positional"  # explicit kv_cache_config parameter: (config, role, kv_cache_config)
    KEYWORD = "keyword"  # **kwargs only: (config, role, kv_cache_config=kv_cache_config)
    LEGACY = "legacy"  # neither: (config, role), with a deprecation warning


@dataclass(frozen=True)
class ResolvedConnector:
    """A connector class and how to construct it."""

    cls: type
    style: ConstructorStyle
    base: type


def import_target(target: str) -> type:
    """Import ``"module:Class"``."""
    module_name, _, class_name = target.partition(":")
    return _class_from_module(module_name, class_name)


def _class_from_module(module_name: str, class_name: str) -> type:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConnectorError(f"cannot import connector module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConnectorError(f"class {class_name!r} not found in module {module_name!r}")
    if not isinstance(cls, type):
        raise ConnectorError(f"{module_name}.{class_name} is not a class")
    return cls


class ConnectorFactory:
    """Resolves and constructs connectors; see the module docstring for the rules."""

    def __init__(self, registry: Mapping[str, str], bases: tuple[type, ...],
                 fallback: Callable[[str], type] | None = None) -> None:
        self._registry = dict(registry)
        self._bases = bases
        self._fallback = fallback

    @property
    def names(self) -> tuple[str, ...]:
        """Registered built-in names."""
        return tuple(self._registry)

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Add a built-in name (imported lazily). Duplicate names are an error."""
        if name in self._registry:
            raise ConnectorError(f"connector {name!r} is already registered")
        self._registry[name] = f"{module_path}:{class_name}"

    def resolve(self, kv_transfer_config: Any) -> ResolvedConnector:
        """The class named by ``kv_transfer_config`` and its constructor style."""
        if kv_transfer_config is None:
            raise ConnectorError("kv_transfer_config must be set to create a connector")
        name = getattr(kv_transfer_config, "kv_connector", None)
        if not name:
            raise ConnectorError("kv_transfer_config.kv_connector is not set: name the connector class")
        module_path = getattr(kv_transfer_config, "kv_connector_module_path", None)
        if module_path is not None and not module_path.strip():
            raise ConnectorError(
                f"kv_connector_module_path is empty for connector {name!r}: give the module that defines the "
                f"class, or leave it unset to use a built-in ({', '.join(self._registry)})")
        if module_path:
            cls = self._check_connector(_class_from_module(module_path, name), f"{module_path}.{name}")
            return ResolvedConnector(cls, _probe(cls), self._base_of(cls))
        cls = self._check_connector(self._builtin(name), name)
        return ResolvedConnector(cls, ConstructorStyle.BUILTIN, self._base_of(cls))

    def create(self, config: Any, role: Any, kv_cache_config: Any = None) -> Any:
        """Build the connector named by ``config.kv_transfer_config`` for ``role``."""
        ktc = getattr(config, "kv_transfer_config", None)
        resolved = self.resolve(ktc)
        cls = resolved.cls
        logger.info("Creating connector %s (engine_id %s, %s constructor)", cls.__name__,
                    getattr(ktc, "engine_id", None), resolved.style.value)
        if resolved.style is ConstructorStyle.LEGACY:
            logger.warning(
                "Connector %s uses the deprecated two-argument constructor (vllm_config, role); it is built "
                "without kv_cache_config. Accept kv_cache_config as the third argument and pass it to "
                "super().__init__().", cls.__name__)
            return legacy_class(cls, resolved.base)(config, role)
        if resolved.style is ConstructorStyle.KEYWORD:
            return cls(config, role, kv_cache_config=kv_cache_config)
        return cls(config, role, kv_cache_config)

    def _builtin(self, name: str) -> type:
        target = self._registry.get(name)
        if target is not None:
            return import_target(target)
        if self._fallback is not None:
            try:
                return self._fallback(name)
            except (ValueError, KeyError):
                pass
        raise ConnectorError(
            f"unknown connector {name!r}: not a built-in name ({', '.join(self._registry)}); set "
            "kv_connector_module_path to the module that defines it")

    def _check_connector(self, cls: type, where: str) -> type:
        if not issubclass(cls, self._bases):
            expected = " or ".join(b.__name__ for b in self._bases)
            raise ConnectorError(f"{where} is not a KV connector: it does not derive from {expected}")
        return cls

    def _base_of(self, cls: type) -> type:
        return next(b for b in self._bases if issubclass(cls, b))


def _probe(cls: type) -> ConstructorStyle:
    if not accepts_kv_cache_config(cls):
        return ConstructorStyle.LEGACY
    return ConstructorStyle.POSITIONAL if names_kv_cache_config(cls) else ConstructorStyle.KEYWORD


DEFAULT_FACTORY = ConnectorFactory(BUILTIN_CONNECTORS, bases=(KVConnectorBase,))


def create_connector(config: Any, role: Any, kv_cache_config: Any = None) -> Any:
    """Build kvtier's engine-neutral connector named by ``config.kv_transfer_config``."""
    return DEFAULT_FACTORY.create(config, role, kv_cache_config)

