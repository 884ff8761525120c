"""kvtier's connector factory: built-in names, module paths, legacy constructors, errors."""

from __future__ import annotations

import logging
from typing import Any

import fixtures_connectors as fx
import pytest

from kvtier.connector.base import KVConnectorBase, KVConnectorRole
from kvtier.connector.factory import (
    BUILTIN_CONNECTORS,
    DEFAULT_FACTORY,
    ConnectorFactory,
    ConstructorStyle,
    create_connector,
)
from kvtier.connector.legacy import accepts_kv_cache_config, adapter_base, legacy_class
from kvtier.engine.types import EngineConfig, KVTransferConfig
from kvtier.errors import ConnectorError
from kvtier.layout import simple_config

MODULE = fx.__name__
ROLES = [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER]
KCC = simple_config(num_layers=2, num_kv_heads=2, head_size=8, num_blocks=32)


def engine_config(name: str | None, module: str | None = MODULE, **extra: Any) -> EngineConfig:
    return EngineConfig(KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
                                         kv_connector_extra_config=extra))


@pytest.mark.parametrize("role", ROLES)
def test_new_style_connector_gets_the_kv_cache_config(role: KVConnectorRole) -> None:
    conn = create_connector(engine_config("NewConnector"), role, KCC)
    assert type(conn) is fx.NewConnector
    assert conn.role is role
    assert conn._kv_cache_config is KCC


@pytest.mark.parametrize("role", ROLES)
def test_legacy_connector_is_built_with_two_arguments_and_a_warning(
        role: KVConnectorRole, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.factory"):
        conn = create_connector(engine_config("LegacyConnector"), role, KCC)
    assert isinstance(conn, fx.LegacyConnector)
    assert conn.role is role
    assert conn._kv_cache_config is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "LegacyConnector" in warnings[0].getMessage()
    assert "deprecated two-argument constructor" in warnings[0].getMessage()


@pytest.mark.parametrize("role", ROLES)
def test_kwargs_constructor_counts_as_new_style(role: KVConnectorRole, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.factory"):
        conn = create_connector(engine_config("KwargsConnector"), role, KCC)
    assert conn.received_kwargs == {"kv_cache_config": KCC}
    assert conn._kv_cache_config is KCC
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_probe_styles() -> None:
    def style(name: str) -> ConstructorStyle:
        return DEFAULT_FACTORY.resolve(engine_config(name).kv_transfer_config).style

    assert style("NewConnector") is ConstructorStyle.POSITIONAL
    assert style("StorageConnector") is ConstructorStyle.POSITIONAL  # kv_cache_config=None default
    assert style("KwargsConnector") is ConstructorStyle.KEYWORD
    assert style("LegacyConnector") is ConstructorStyle.LEGACY
    assert not accepts_kv_cache_config(fx.LegacyConnector)
    assert accepts_kv_cache_config(fx.KwargsConnector)


def test_builtins_are_never_probed() -> None:
    # Its third parameter is not called kv_cache_config: probing would build it with two arguments -> TypeError.
    factory = ConnectorFactory({"BuiltinLike": f"{MODULE}:BuiltinLikeConnector"}, bases=(KVConnectorBase,))
    resolved = factory.resolve(engine_config("BuiltinLike", module=None).kv_transfer_config)
    assert resolved.style is ConstructorStyle.BUILTIN
    conn = factory.create(engine_config("BuiltinLike", module=None), KVConnectorRole.WORKER, KCC)
    assert conn._kv_cache_config is KCC
    # The same class by module path IS probed, judged legacy, and fails exactly as probing would.
    with pytest.raises(TypeError):
        factory.create(engine_config("BuiltinLikeConnector"), KVConnectorRole.WORKER, KCC)


def test_builtin_registry_is_lazy_and_complete() -> None:
    assert set(BUILTIN_CONNECTORS) >= {"KVTierConnector", "MultiConnector", "KVTierMultiConnector"}
    assert all(":" in target for target in BUILTIN_CONNECTORS.values())
    factory = ConnectorFactory({}, bases=(KVConnectorBase,))
    factory.register("X", MODULE, "NewConnector")
    with pytest.raises(ConnectorError, match="already registered"):
        factory.register("X", MODULE, "NewConnector")
    assert factory.names == ("X",)


def test_legacy_class_on_a_base_that_requires_kv_cache_config() -> None:
    # Like vLLM 0.33's base: the adapter goes between the legacy class and the strict base.
    factory = ConnectorFactory({}, bases=(fx.StrictBase,))
    for role in ROLES:
        conn = factory.create(engine_config("StrictLegacyConnector"), role, KCC)
        assert isinstance(conn, fx.StrictLegacyConnector)
        assert isinstance(conn, adapter_base(fx.StrictBase))
        assert type(conn).__name__ == "StrictLegacyConnector"
        assert conn.legacy_init_ran and conn.role is role
        assert conn._kv_cache_config is None
    with pytest.raises(TypeError):  # without the adapter the strict base rejects the legacy call
        fx.StrictLegacyConnector(engine_config(None), KVConnectorRole.WORKER)
    assert legacy_class(fx.StrictLegacyConnector, fx.StrictBase) is legacy_class(fx.StrictLegacyConnector,
                                                                                fx.StrictBase)
    assert legacy_class(fx.LegacyConnector, KVConnectorBase) is fx.LegacyConnector  # base default None: no shim


@pytest.mark.parametrize(("name", "module", "message"), [
    ("NewConnector", "", "kv_connector_module_path is empty"),
    ("NewConnector", "   ", "kv_connector_module_path is empty"),
    ("Missing", MODULE, f"class 'Missing' not found in module '{MODULE}'"),
    ("NewConnector", "no_such_module_kvtier", "cannot import connector module 'no_such_module_kvtier'"),
    ("NotAConnector", MODULE, f"{MODULE}.NotAConnector is not a KV connector: it does not derive from "
                              "KVConnectorBase"),
    ("NOT_A_CLASS", MODULE, "is not a class"),
    ("NoSuchBuiltin", None, "unknown connector 'NoSuchBuiltin': not a built-in name"),
    (None, MODULE, "kv_connector is not set"),
])
def test_resolution_errors(name: str | None, module: str | None, message: str) -> None:
    with pytest.raises(ConnectorError) as info:
        create_connector(engine_config(name, module), KVConnectorRole.SCHEDULER, KCC)
    assert message in str(info.value)


def test_missing_kv_transfer_config() -> None:
    with pytest.raises(ConnectorError, match="kv_transfer_config must be set"):
        create_connector(EngineConfig(), KVConnectorRole.SCHEDULER, KCC)


def test_fallback_registry_is_consulted_and_not_probed() -> None:
    seen: list[str] = []

    def fallback(name: str) -> type:
        seen.append(name)
        if name != "Outer":
            raise ValueError(f"Connector '{name}' is not registered.")
        return fx.BuiltinLikeConnector

    factory = ConnectorFactory({}, bases=(KVConnectorBase,), fallback=fallback)
    conn = factory.create(engine_config("Outer", module=None), KVConnectorRole.SCHEDULER, KCC)
    assert conn._kv_cache_config is KCC and seen == ["Outer"]
    with pytest.raises(ConnectorError, match="unknown connector 'Other'"):
        factory.create(engine_config("Other", module=None), KVConnectorRole.SCHEDULER, KCC)


def test_builtin_names_resolve_to_kvtier_classes() -> None:
    from kvtier.connector.multi import MultiConnector
    from kvtier.connector.tiered import TieredConnector

    for name, cls in [("KVTierConnector", TieredConnector), ("MultiConnector", MultiConnector),
                      ("KVTierMultiConnector", MultiConnector)]:
        resolved = DEFAULT_FACTORY.resolve(engine_config(name, module=None).kv_transfer_config)
        assert resolved.cls is cls and resolved.style is ConstructorStyle.BUILTIN
