"""kvtier's MultiConnector: children built through the factory, vLLM's routing rules, HMA check."""

from __future__ import annotations

import inspect
import logging
import pickle
from pathlib import Path
from typing import Any

import fixtures_connectors as fx
import pytest

from kvtier.connector.base import KVConnectorBase, KVConnectorRole
from kvtier.connector.factory import BUILTIN_CONNECTORS, ConnectorFactory, create_connector
from kvtier.connector.multi import MultiConnector, MultiConnectorMetadata, MultiConnectorStats
from kvtier.engine.types import (
    EngineConfig,
    KVCacheBlocks,
    KVTransferConfig,
    NewRequestData,
    Request,
    SchedulerOutput,
)
from kvtier.errors import ConnectorError
from kvtier.layout import simple_config

MODULE = fx.__name__
KCC = simple_config(num_layers=2, num_kv_heads=2, head_size=8, num_blocks=64)
KCC_HYBRID = simple_config(num_layers=4, num_kv_heads=2, head_size=8, num_blocks=64, sliding_window=8,
                           swa_layers=(1, 3))
PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4 are storable


def child(name: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": name, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def storage(path: Path, **extra: Any) -> dict[str, Any]:
    return child("StorageConnector", path=str(path), block_size=4, **extra)


def multi_config(*children: dict[str, Any], engine_id: str = "engine-7") -> EngineConfig:
    return EngineConfig(KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", engine_id=engine_id,
                                         kv_connector_extra_config={"connectors": list(children)}))


def pair(*children: dict[str, Any], kcc: Any = KCC) -> tuple[Any, Any]:
    cfg = multi_config(*children)
    return (create_connector(cfg, KVConnectorRole.SCHEDULER, kcc), create_connector(cfg, KVConnectorRole.WORKER, kcc))


def block_file(root: Path, tokens: list[int], index: int) -> Path:
    return root / fx._block_digest(tokens, index, 4)


def blocks_for(first: int, count: int = 5) -> KVCacheBlocks:
    return KVCacheBlocks((list(range(first, first + count)),))


def schedule(sched: Any, requests: list[tuple[Request, KVCacheBlocks]]) -> tuple[MultiConnectorMetadata, list[int]]:
    """One scheduler step for new requests: lookup, allocation, metadata."""
    hits, new = [], []
    for req, blocks in requests:
        n, load_async = sched.get_num_new_matched_tokens(req, 0)
        assert load_async is False
        sched.update_state_after_alloc(req, blocks, n)
        hits.append(n)
        new.append(NewRequestData(req.request_id, req.prompt_token_ids, blocks.block_ids, n))
    meta = sched.build_connector_meta(SchedulerOutput(scheduled_new_reqs=new))
    assert isinstance(meta, MultiConnectorMetadata)
    return pickle.loads(pickle.dumps(meta)), hits  # crosses a process boundary in vLLM


def work(worker: Any, meta: MultiConnectorMetadata, finished: frozenset[str] = frozenset()) -> Any:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_layer_load("model.layers.0.self_attn")
    worker.save_kv_layer("model.layers.0.self_attn", None, None)
    worker.wait_for_save()
    out = worker.get_finished(set(finished)), worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return out


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_legacy_child_and_new_child(role: KVConnectorRole, caplog: pytest.LogCaptureFixture) -> None:
    cfg = multi_config(child("LegacyConnector"), child("NewConnector"))
    with caplog.at_level(logging.WARNING):
        multi = create_connector(cfg, role, KCC)
    assert type(multi) is MultiConnector
    legacy, new = multi.sub_connectors
    assert isinstance(legacy, fx.LegacyConnector) and legacy._kv_cache_config is None
    assert type(new) is fx.NewConnector and new._kv_cache_config is KCC
    assert legacy.role is role and new.role is role
    assert [c._kv_transfer_config.kv_connector for c in multi.sub_connectors] == ["LegacyConnector", "NewConnector"]
    assert {c._kv_transfer_config.engine_id for c in multi.sub_connectors} == {"engine-7"}
    assert cfg.kv_transfer_config.kv_connector == "MultiConnector"  # children got copies
    assert any("LegacyConnector" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_child_engine_id_can_be_set() -> None:
    multi = create_connector(multi_config(child("NewConnector"), {**child("NewConnector"), "engine_id": "own"}),
                             KVConnectorRole.SCHEDULER, KCC)
    assert [c._kv_transfer_config.engine_id for c in multi.sub_connectors] == ["engine-7", "own"]


def test_saves_go_to_all_children_and_the_first_hit_loads(tmp_path: Path) -> None:
    sched, worker = pair(storage(tmp_path / "a"), storage(tmp_path / "b"))
    a, b = sched.sub_connectors
    meta, hits = schedule(sched, [(Request("r1", PROMPT), blocks_for(1))])
    assert hits == [0]
    work(worker, meta)
    files_a = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(files_a) == 4 and files_a == sorted(p.name for p in (tmp_path / "b").iterdir())

    meta, hits = schedule(sched, [(Request("r2", [*PROMPT[:16], 7, 7, 7]), blocks_for(10))])
    assert hits == [16]
    assert a.calls[-2] == ("update_state_after_alloc", "r2", ([10, 11, 12, 13, 14],), 16)
    assert b.calls[-2] == ("update_state_after_alloc", "r2", ([10, 11, 12, 13, 14],), 0)  # its blocks, no load
    work(worker, meta)
    wa, wb = worker.sub_connectors
    assert wa.loaded_blocks == [10, 11, 12, 13] and wb.loaded_blocks == []

    for f in (tmp_path / "a").iterdir():  # the first child lost its data: the second one loads
        f.unlink()
    meta, hits = schedule(sched, [(Request("r3", PROMPT), blocks_for(20))])
    assert hits == [16]
    assert a.calls[-2] == ("update_state_after_alloc", "r3", ([20, 21, 22, 23, 24],), 0)
    assert b.calls[-2][-1] == 16
    work(worker, meta)
    assert wb.loaded_blocks == [20, 21, 22, 23]
    stats = worker.get_kv_connector_stats()
    assert isinstance(stats, MultiConnectorStats) and set(stats.data) == {"StorageConnector"}
    assert stats.reduce() == {"StorageConnector.loads": 8}


def test_a_child_still_looking_up_defers_the_request(tmp_path: Path) -> None:
    sched, _ = pair(storage(tmp_path / "a"), storage(tmp_path / "b", lookup_pending=True))
    assert sched.get_num_new_matched_tokens(Request("r", PROMPT), 0) == (None, False)


def test_finished_sending_waits_for_every_saving_child(tmp_path: Path) -> None:
    sched, worker = pair(storage(tmp_path / "a", async_save=True, hold_saves=True),
                         storage(tmp_path / "b", async_save=True, hold_saves=True), storage(tmp_path / "c"))
    req = Request("r1", PROMPT)
    meta, _ = schedule(sched, [(req, blocks_for(1))])
    assert work(worker, meta) == ((None, None), set())
    assert sched.request_finished_all_groups(req, ([1, 2, 3, 4, 5],)) == (True, None)
    meta, _ = schedule(sched, [])
    assert meta.extra_async_saves == {"r1": 1}
    wa, wb, _ = worker.sub_connectors
    wa.flush()
    assert work(worker, meta, finished=frozenset({"r1"})) == ((None, None), set())  # only one of two saving children done
    wb.flush()
    meta, _ = schedule(sched, [])
    assert work(worker, meta) == (({"r1"}, None), set())
    meta, _ = schedule(sched, [])
    assert work(worker, meta) == ((None, None), set())  # reported once


def test_load_errors_are_the_union(tmp_path: Path) -> None:
    sched, worker = pair(storage(tmp_path / "a"), storage(tmp_path / "b"))
    x_tokens, y_tokens = PROMPT, [5] * 18
    meta, _ = schedule(sched, [(Request("x", x_tokens), blocks_for(1)), (Request("y", y_tokens), blocks_for(6))])
    work(worker, meta)
    for i in range(4):  # y only in b, so y loads from b and x from a
        block_file(tmp_path / "a", y_tokens, i).unlink()
    block_file(tmp_path / "a", x_tokens, 1).write_text("0,0,0,0")  # corrupt in a
    block_file(tmp_path / "b", y_tokens, 2).write_text("9")  # corrupt in b
    meta, hits = schedule(sched, [(Request("x2", x_tokens), blocks_for(20)), (Request("y2", y_tokens), blocks_for(30))])
    assert hits == [16, 16]
    _, errors = work(worker, meta)
    assert errors == {21, 32}
    wa, wb = worker.sub_connectors
    assert wa.loaded_blocks == [20, 22, 23] and wb.loaded_blocks == [30, 31, 33]


def test_shutdown_reaches_every_child_and_reraises_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    multi = create_connector(multi_config(storage(tmp_path / "a", fail_shutdown=True), storage(tmp_path / "b"),
                                          storage(tmp_path / "c", fail_shutdown=True)), KVConnectorRole.WORKER, KCC)
    with caplog.at_level(logging.ERROR, logger="kvtier.connector.multi"), \
            pytest.raises(RuntimeError, match="shutdown failed for a"):
        multi.shutdown()
    assert [c.shut_down for c in multi.sub_connectors] == [True, True, True]
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2


def test_every_public_base_method_is_overridden() -> None:
    public = {name for name, _ in inspect.getmembers(KVConnectorBase) if not name.startswith("_")}
    inherited = {name for name in public if name not in MultiConnector.__dict__}
    assert inherited == {"role", "has_connector_metadata"}


def test_hybrid_config_needs_hma_children(tmp_path: Path) -> None:
    children = (storage(tmp_path / "a"), child("NonHMAStorageConnector"))
    with pytest.raises(ConnectorError) as info:
        create_connector(multi_config(*children), KVConnectorRole.SCHEDULER, KCC_HYBRID)
    message = str(info.value)
    assert "2 groups" in message and "NonHMAStorageConnector" in message and "StorageConnector," not in message
    assert "SupportsHMA" in message and "--disable-hybrid-kv-cache-manager" in message
    # One group: fine; the non-HMA child is finished through request_finished with group 0's ids.
    multi = create_connector(multi_config(*children), KVConnectorRole.SCHEDULER, KCC)
    assert multi.request_finished_all_groups(Request("r", PROMPT), ([3, 4],)) == (False, None)
    hma, plain = multi.sub_connectors
    assert hma.calls[-1] == ("request_finished_all_groups", "r", ([3, 4],))
    assert plain.calls == []  # _Minimal.request_finished is the base default: no call record
    hybrid_ok = create_connector(multi_config(storage(tmp_path / "a"), storage(tmp_path / "b")),
                                 KVConnectorRole.WORKER, KCC_HYBRID)
    assert all(c._kv_cache_config is KCC_HYBRID for c in hybrid_ok.sub_connectors)


def test_configuration_errors() -> None:
    with pytest.raises(ConnectorError, match=r"kv_connector_extra_config\['connectors'\]"):
        create_connector(multi_config(), KVConnectorRole.SCHEDULER, KCC)
    with pytest.raises(ConnectorError, match=r"\[0\]"):
        create_connector(multi_config({"kv_connector": "NewConnector", "bogus": 1}), KVConnectorRole.SCHEDULER, KCC)
    with pytest.raises(ConnectorError, match="not found in module"):
        create_connector(multi_config(child("Nope")), KVConnectorRole.SCHEDULER, KCC)


def test_stats_and_metadata_shapes(tmp_path: Path) -> None:
    empty = MultiConnector.build_kv_connector_stats(None)
    assert isinstance(empty, MultiConnectorStats) and empty.is_empty()
    rebuilt = MultiConnector.build_kv_connector_stats({"StorageConnector": {"loads": 2}, "Gone": None})
    assert isinstance(rebuilt, MultiConnectorStats) and rebuilt.reduce() == {"StorageConnector.loads": 2}
    rebuilt.aggregate(MultiConnector.build_kv_connector_stats({"StorageConnector": {"loads": 3}}))
    assert rebuilt.to_dict() == {"StorageConnector": {"loads": 5}}
    rebuilt.reset()
    assert rebuilt.is_empty()
    _, worker = pair(storage(tmp_path / "a"), child("NewConnector"))
    with pytest.raises(ConnectorError, match="MultiConnectorMetadata"):
        worker.bind_connector_metadata(fx.StorageMetadata())
    assert worker.prefer_cross_layer_blocks is False
    assert worker.reset_cache() is True and worker.get_finished_count() is None


class RecordingFactory(ConnectorFactory):
    """The default factory, keeping every connector it built."""

    def __init__(self) -> None:
        super().__init__(BUILTIN_CONNECTORS, bases=(KVConnectorBase,))
        self.built: list[Any] = []

    def create(self, config: Any, role: Any, kv_cache_config: Any = None) -> Any:
        made = super().create(config, role, kv_cache_config)
        self.built.append(made)
        return made


def test_a_failing_child_constructor_shuts_down_the_built_ones(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    factory = RecordingFactory()
    cfg = multi_config(storage(tmp_path / "a"), storage(tmp_path / "b", fail_shutdown=True), child("Nope"))
    with caplog.at_level(logging.ERROR, logger="kvtier.connector.multi"), \
            pytest.raises(ConnectorError, match="not found in module"):
        MultiConnector(cfg, KVConnectorRole.WORKER, KCC, factory=factory)
    assert [c.shut_down for c in factory.built] == [True, True]
    assert any("shutdown of connector StorageConnector failed" in r.getMessage() for r in caplog.records)


def test_a_later_miss_clears_the_loading_child(tmp_path: Path) -> None:
    sched = create_connector(multi_config(storage(tmp_path / "a"), storage(tmp_path / "b")),
                             KVConnectorRole.SCHEDULER, KCC)
    a, _ = sched.sub_connectors
    (tmp_path / "a").mkdir(exist_ok=True)
    for i in range(4):
        block_file(tmp_path / "a", PROMPT, i).write_text(",".join(map(str, PROMPT[i * 4:(i + 1) * 4])))
    req = Request("r", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    assert sched.loading_connector("r") is a
    for f in (tmp_path / "a").iterdir():  # evicted before the request could be allocated
        f.unlink()
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.loading_connector("r") is None
    sched.update_state_after_alloc(req, blocks_for(1), 0)
    assert a.calls[-1] == ("update_state_after_alloc", "r", (blocks_for(1).get_block_ids()[0],), 0)


def test_may_load_async_is_any_childs_and_no_for_a_child_without_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34's ``may_load_async``: the chain may load a request asynchronously when a child may; children
    written before the hook existed never say so."""
    multi = create_connector(multi_config(child("NewConnector"), child("LegacyConnector")), KVConnectorRole.SCHEDULER,
                             KCC)
    assert not any(hasattr(c, "may_load_async") for c in multi.sub_connectors)
    assert multi.may_load_async(Request("r", PROMPT)) is False
    asked: list[str] = []

    def may(request: Request) -> bool:
        asked.append(request.request_id)
        return True

    monkeypatch.setattr(multi.sub_connectors[1], "may_load_async", may, raising=False)
    assert multi.may_load_async(Request("r", PROMPT)) is True and asked == ["r"]
