"""Running connectors written for the two-argument constructor on engines whose base class requires three.

A *legacy* connector has ``__init__(self, vllm_config, role)``: it takes neither ``kv_cache_config`` nor
``**kwargs`` (the rule of vLLM's ``supports_kw``, see :func:`accepts_kv_cache_config`). kvtier's factory builds it
with two positional arguments and a deprecation warning. That alone is not enough on an engine whose base
``__init__`` *requires* ``kv_cache_config`` (vLLM >= ~0.21, including 0.33): the legacy class calls
``super().__init__(vllm_config=vllm_config, role=role)`` and the base raises ``TypeError``.

Mechanism: :func:`legacy_class` returns a subclass ``C'(C, Adapter)`` of the legacy class ``C``, where
``Adapter`` derives from the engine's base and its ``__init__`` takes ``kv_cache_config=None``. By Python's
method resolution order the adapter sits *between* ``C`` and the engine's base, so ``C``'s
``super().__init__(vllm_config=..., role=...)`` reaches the adapter, which calls the base with
``kv_cache_config=None``. ``C`` itself is not modified; ``isinstance(obj, C)`` holds and ``type(obj).__name__``
is ``C``'s name (stats keyed by class name keep working); the connector sees ``_kv_cache_config is None``.

Covered:
- vLLM <= 0.11 style connectors ``(vllm_config, role)`` that reach the engine base through ``super().__init__``
  (directly or via intermediate classes that also forward to ``super()``), on every vLLM version: 0.11
  (base takes two arguments), 0.12-0.20 (base default ``None``) and >= 0.21 / 0.33 (base requires it).
- kvtier's engine-neutral base (``kv_cache_config`` defaults to ``None``): no adapter is needed.
Not covered: a legacy class that calls ``BaseClass.__init__(self, vllm_config, role)`` by name, or that derives
from a concrete three-argument connector which requires ``kv_cache_config`` (that parent fails first).
On vLLM 0.33 a legacy class cannot be the *top-level* connector (vLLM rejects it before kvtier runs); run it as
a child of ``KVTierMultiConnector``, whose children are built by kvtier's factory.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

KV_CACHE_CONFIG = "kv_cache_config"


def accepts_kv_cache_config(cls: type) -> bool:
    """vLLM's ``supports_kw(cls, "kv_cache_config")``: a named parameter, or ``**kwargs`` as the last one."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    param = params.get(KV_CACHE_CONFIG)
    if param is not None and param.kind is not inspect.Parameter.VAR_POSITIONAL \
            and param.kind is not inspect.Parameter.VAR_KEYWORD:
        return True
    last = params[next(reversed(params))]
    return last.kind is inspect.Parameter.VAR_KEYWORD and last.name != KV_CACHE_CONFIG


def names_kv_cache_config(cls: type) -> bool:
    """True when ``kv_cache_config`` is an explicit parameter (else only ``**kwargs`` accepts it)."""
    try:
        return KV_CACHE_CONFIG in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def requires_kv_cache_config(base: type) -> bool:
    """True when ``base.__init__`` has a ``kv_cache_config`` parameter without a default."""
    try:
        param = inspect.signature(base).parameters.get(KV_CACHE_CONFIG)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


@functools.cache
def adapter_base(base: type) -> type:
    """The adapter class placed between a legacy connector and ``base``: supplies ``kv_cache_config=None``.

    Connector authors may also derive from it directly instead of the engine's base.
    """

    base_init: Callable[..., None] = getattr(base, "__init__")  # noqa: B009 (mypy rejects type.__init__ access)

    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any = None, **kwargs: Any) -> None:
        base_init(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config, **kwargs)

    namespace = {
        "__init__": __init__,
        "__module__": __name__,
        "__doc__": f"{base.__name__} whose constructor accepts the legacy two-argument form.",
    }
    return types.new_class(f"Legacy{base.__name__}", (base,), exec_body=lambda ns: ns.update(namespace))


@functools.cache
def legacy_class(cls: type, base: type) -> type:
    """``cls`` itself when ``base`` accepts a missing ``kv_cache_config``; else ``cls`` with the adapter below it."""
    if not requires_kv_cache_config(base) or not issubclass(cls, base):
        return cls
    adapter = adapter_base(base)
    if issubclass(cls, adapter):
        return cls
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "_kvtier_legacy_of": cls}
    return types.new_class(cls.__name__, (cls, adapter), exec_body=lambda ns: ns.update(namespace))
