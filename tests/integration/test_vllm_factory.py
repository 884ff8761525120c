"""vLLM 0.33's own KVConnectorFactory builds kvtier's connectors from the module path, HMA stays on."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.integrations.vllm import KVTierConnector, KVTierStats
from kvtier.layout import GroupKind, from_vllm

ROLES = [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER]


@pytest.mark.parametrize("role", ROLES)
def test_vllm_factory_builds_kvtier_connector(role: Any, kit: Any, make_vllm_config: Any,
                                              kvtier_config_file: Any) -> None:
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file()))
    kcc = kit.make_kv_cache_config(hybrid=False)
    conn = KVConnectorFactory.create_connector(cfg, role, kcc)
    try:
        assert type(conn) is KVTierConnector
        assert isinstance(conn, KVConnectorBase_V1) and isinstance(conn, SupportsHMA)
        assert conn.role is role
        assert conn._kv_cache_config is kcc
        half = conn._scheduler if role == KVConnectorRole.SCHEDULER else conn._worker
        assert half is not None  # the half is one hop away: kvtier's connector is vLLM's connector
        layout = half.kcc  # vLLM's config converted to kvtier's model
        assert layout == from_vllm(kcc) and layout.num_blocks == kcc.num_blocks
        assert layout.kv_cache_groups[0].layer_names == tuple(kit.layer_name(i) for i in range(4))
    finally:
        conn.shutdown()


@pytest.mark.parametrize("disable_hma", [None, False])
def test_hma_stays_on_for_kvtier(disable_hma: bool | None, kit: Any, make_vllm_config: Any,
                                 kvtier_config_file: Any) -> None:
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file()), disable_hma=disable_hma)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config) is True
    kcc = kit.make_kv_cache_config(hybrid=True)
    assert kcc.transfer_group_ids == (0, 1)
    for role in ROLES:
        conn = KVConnectorFactory.create_connector(cfg, role, kcc)
        try:
            assert conn._kv_cache_config is kcc
            half = conn._scheduler if role == KVConnectorRole.SCHEDULER else conn._worker
            groups = half.kcc.kv_cache_groups
            assert [g.kv_cache_spec.kind for g in groups] == [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW]
        finally:
            conn.shutdown()


def test_stats_are_vllm_stats() -> None:
    stats = KVTierConnector.build_kv_connector_stats({"load_chunks": 2})
    assert isinstance(stats, KVConnectorStats) and isinstance(stats, KVTierStats)
    stats.aggregate(KVTierConnector.build_kv_connector_stats({"load_chunks": 3, "save_bytes": 10}))
    assert stats.to_dict() == {"load_chunks": 5, "save_bytes": 10}
    assert stats.reduce() == {"load_chunks": 5, "save_bytes": 10} and not stats.is_empty()
    stats.reset()
    assert stats.is_empty()
