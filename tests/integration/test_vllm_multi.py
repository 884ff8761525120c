"""KVTierMultiConnector under vLLM 0.33: a connector written for vLLM <= 0.11 runs as a child of it."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from test_vllm_scheduler import PREFIX, Engine
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.outputs import KVConnectorOutput

from kvtier.connector.multi import MultiConnectorMetadata
from kvtier.errors import ConnectorError
from kvtier.integrations.vllm import (
    KVTierConnector,
    KVTierMultiConnector,
    KVTierMultiStats,
    KVTierMultiWorkerMetadata,
    LegacyConnectorBase,
)

MODULE = __name__
ROLES = [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER]


class OldStyleMetadata(KVConnectorMetadata):
    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids


class _Recorder:
    """The abstract methods of vLLM's base, recording every call (shared by the test connectors)."""

    calls: list[tuple[Any, ...]]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc", request.request_id, blocks.get_block_ids(),
                           num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.calls.append(("build_connector_meta",))
        return OldStyleMetadata([r.req_id for r in scheduler_output.scheduled_new_reqs])

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, list(block_ids)))
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()  # type: ignore[attr-defined]  (vLLM's base, later in the MRO)
        assert isinstance(meta, OldStyleMetadata)
        self.calls.append(("start_load_kv", tuple(meta.req_ids)))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.calls.append(("save_kv_layer", layer_name))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))


class OldStyleConnector(_Recorder, KVConnectorBase_V1):
    """Written for vLLM <= 0.11: ``(vllm_config, role)``, one KV-cache group, not SupportsHMA."""

    instances: ClassVar[list[OldStyleConnector]] = []

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self.calls = []
        OldStyleConnector.instances.append(self)


@dataclass
class CountMeta(KVConnectorWorkerMetadata):
    count: int

    def aggregate(self, other: Any) -> Any:
        return CountMeta(self.count + other.count)


class WorkerMetaConnector(_Recorder, KVConnectorBase_V1):
    """A vLLM 0.33 connector that sends worker metadata back to its scheduler half."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.calls = []

    def build_connector_worker_meta(self) -> Any:
        return CountMeta(1)

    def update_connector_output(self, connector_output: Any) -> None:
        self.calls.append(("update_connector_output", connector_output.kv_connector_worker_meta))


def old_style_child() -> dict[str, Any]:
    return {"kv_connector": "OldStyleConnector", "kv_connector_module_path": MODULE, "kv_role": "kv_both"}


def multi_transfer(kit: Any, config_file: str, *children: dict[str, Any]) -> dict[str, Any]:
    # vLLM's prefix cache is off in these tests so that the second request's hit comes from kvtier: by choice
    kvtier_child = kit.kvtier_transfer(config_file, serve_without_prefix_caching=True)
    return {"kv_connector": "KVTierMultiConnector", "kv_connector_module_path": kit.KVTIER_MODULE,
            "kv_role": "kv_both", "kv_buffer_device": "cpu", "engine_id": "engine-1",
            "kv_connector_extra_config": {"connectors": [kvtier_child, *children]}}


def test_vllm_alone_rejects_the_legacy_connector(kit: Any, make_vllm_config: Any, kvtier_config_file: Any) -> None:
    top_level = {**old_style_child(), "kv_buffer_device": "cpu"}
    with pytest.raises(ValueError, match="deprecated 2-argument constructor"):
        make_vllm_config(top_level)
    vllm_multi = {**multi_transfer(kit, kvtier_config_file(), old_style_child()), "kv_connector": "MultiConnector"}
    vllm_multi.pop("kv_connector_module_path")
    with pytest.raises(ValueError, match="deprecated 2-argument constructor"):
        make_vllm_config(vllm_multi)
    # kvtier's composite is accepted, and vLLM keeps the hybrid KV-cache manager on.
    cfg = make_vllm_config(multi_transfer(kit, kvtier_config_file(), old_style_child()))
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config) is True


@pytest.mark.parametrize("role", ROLES)
def test_legacy_child_is_built_for_both_roles(role: Any, kit: Any, make_vllm_config: Any, kvtier_config_file: Any,
                                              caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_vllm_config(multi_transfer(kit, kvtier_config_file(), old_style_child()))
    kcc = kit.make_kv_cache_config(hybrid=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.connector.factory"):
        multi = KVConnectorFactory.create_connector(cfg, role, kcc)
    try:
        assert type(multi) is KVTierMultiConnector and multi._kv_cache_config is kcc and multi.role is role
        tiered, old = multi.sub_connectors
        assert type(tiered) is KVTierConnector and tiered._kv_cache_config is kcc
        assert isinstance(old, OldStyleConnector) and isinstance(old, LegacyConnectorBase)
        assert type(old).__name__ == "OldStyleConnector"
        assert old._kv_cache_config is None and old.role is role
        assert [c._kv_transfer_config.engine_id for c in (tiered, old)] == ["engine-1", "engine-1"]
        assert any("OldStyleConnector" in r.getMessage() for r in caplog.records)
    finally:
        multi.shutdown()


def test_real_scheduler_steps_with_a_legacy_child(kit: Any, make_vllm_config: Any, kvtier_config_file: Any) -> None:
    cfg = make_vllm_config(multi_transfer(kit, kvtier_config_file(), old_style_child()), prefix_caching=False)
    kcc = kit.planned_kv_cache_config(hybrid=False)
    OldStyleConnector.instances.clear()
    engine = Engine(cfg, kcc, kit)
    try:
        assert isinstance(engine.scheduler.connector, KVTierMultiConnector)
        old_sched, old_worker = OldStyleConnector.instances
        engine.add("r1", PREFIX)
        list(engine.run())
        engine.add("r2", [*PREFIX, 1, 2, 3])
        steps = list(engine.run())
        assert next(s for s in steps if "r2" in s.num_scheduled_tokens).num_scheduled_tokens == {"r2": 3}
        assert all(isinstance(m, MultiConnectorMetadata) for m in engine.metadata)

        names = [c[0] for c in old_sched.calls]
        assert names[:3] == ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"]
        r1_alloc = next(c for c in old_sched.calls if c[:2] == ("update_state_after_alloc", "r1"))
        r2_alloc = next(c for c in old_sched.calls if c[:2] == ("update_state_after_alloc", "r2"))
        # kvtier's child loads r2: the other child gets r2's blocks (as vLLM 0.33's chain gives them) and no tokens
        assert r1_alloc[3] == 0 and r2_alloc[:2] == ("update_state_after_alloc", "r2") and r2_alloc[3] == 0
        assert len(r2_alloc[2][0]) == 5
        finished = [c for c in old_sched.calls if c[0] == "request_finished"]
        assert [(c[1], len(c[2])) for c in finished] == [("r1", 4), ("r2", 5)]  # group 0 block ids
        assert ("start_load_kv", ("r1",)) in old_worker.calls and ("wait_for_save",) in old_worker.calls

        stats = engine.stats[0]  # as the scheduler received them
        assert isinstance(stats, KVTierMultiStats) and "KVTierConnector" in stats.data
        rebuilt = KVTierMultiConnector.build_kv_connector_stats(stats.to_dict())
        assert rebuilt.to_dict() == stats.to_dict()
    finally:
        engine.close()


def test_hybrid_groups_with_a_legacy_child_say_what_to_change(kit: Any, make_vllm_config: Any,
                                                             kvtier_config_file: Any) -> None:
    cfg = make_vllm_config(multi_transfer(kit, kvtier_config_file(), old_style_child()))
    with pytest.raises(ConnectorError, match="--disable-hybrid-kv-cache-manager") as info:
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kit.make_kv_cache_config(hybrid=True))
    assert "OldStyleConnector" in str(info.value)
    # As the message says: with the hybrid manager off vLLM plans one group, and the chain runs.
    cfg = make_vllm_config(multi_transfer(kit, kvtier_config_file(), old_style_child()), disable_hma=True)
    multi = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kit.make_kv_cache_config(hybrid=False))
    multi.shutdown()


def _owner(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in c.__dict__)


def test_vllm_only_hooks_are_forwarded() -> None:
    """Every call of vLLM's API is kvtier's own (one hop from the children), not vLLM's default, except the
    Prometheus hook (not forwarded, said in the module docstring)."""
    public = {name for name, _ in inspect.getmembers(KVConnectorBase_V1) if not name.startswith("_")}
    vllm_defaults = {name for name in public if _owner(KVTierMultiConnector, name) is KVConnectorBase_V1}
    assert vllm_defaults == {"build_prom_metrics"}


def test_one_connector_class_per_role_one_hop_from_the_halves() -> None:
    """vLLM's classes are kvtier's engine-neutral connectors with vLLM's base: no forwarding layer between."""
    from kvtier.connector.multi import MultiConnector
    from kvtier.connector.tiered import TieredConnector

    assert KVTierConnector.__mro__[1] is TieredConnector and KVTierMultiConnector.__mro__[1] is MultiConnector
    for name in ("get_num_new_matched_tokens", "build_connector_meta", "start_load_kv", "wait_for_save",
                 "get_finished", "build_connector_worker_meta", "request_finished_all_groups"):
        assert _owner(KVTierConnector, name) is TieredConnector, name
        assert _owner(KVTierMultiConnector, name) is MultiConnector, name


def test_worker_metadata_reaches_its_own_child(kit: Any, make_vllm_config: Any, kvtier_config_file: Any) -> None:
    child = {"kv_connector": "WorkerMetaConnector", "kv_connector_module_path": MODULE, "kv_role": "kv_both"}
    cfg = make_vllm_config(multi_transfer(kit, kvtier_config_file(), old_style_child(), child))
    kcc = kit.make_kv_cache_config(hybrid=False)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, kcc)
    try:
        meta = worker.build_connector_worker_meta()
        assert meta == KVTierMultiWorkerMetadata((None, None, CountMeta(1)))
        merged = meta.aggregate(worker.build_connector_worker_meta())  # two workers
        output = KVConnectorOutput(kv_connector_worker_meta=merged)
        sched.update_connector_output(output)
        assert sched.sub_connectors[2].calls == [("update_connector_output", CountMeta(2))]
        assert output.kv_connector_worker_meta is merged
        assert KVTierMultiConnector.supports_sleep_mode(cfg.kv_transfer_config) is True
        assert KVTierMultiConnector.requires_piecewise_for_cudagraph(
            cfg.kv_transfer_config.kv_connector_extra_config) is False
        assert worker.get_mem_pool_context() is None
        assert KVTierMultiConnector.supports_lookahead_block_hashes(cfg.kv_transfer_config) is False
        if hasattr(KVConnectorBase_V1, "kv_cache_access"):  # vLLM 0.34: no child registers the KV cache
            assert KVTierMultiConnector.kv_cache_access(cfg.kv_transfer_config) == 0
    finally:
        worker.shutdown()
        sched.shutdown()
