"""KVTierConnector through the reference engine: every tier, both write policies, full and hybrid models.

Each run is checked by the conformance harness against the same workload without a connector: later waves
share prefixes with earlier ones (longer than the sliding window), so they load chunks (external hits > 0),
and every logit must equal the recomputed one (exactly in float32; bfloat16 within BF16_TOLERANCE, and in
practice exactly too).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.engine import EngineArgs, KVTierPair, ModelConfig, RequestStatus, run_conformance
from kvtier.engine.core import Engine
from kvtier.engine.harness import BF16_TOLERANCE
from kvtier.engine.types import KVTransferConfig

FULL, HYBRID = ModelConfig(), ModelConfig(sliding_window=48)
BF16_HYBRID = ModelConfig(sliding_window=48, dtype="bfloat16")
_prefix = itertools.count()


def tier_section(kind: str, tmp_path: Path, redis_url: str | None = None, capacity: str = "32MiB") -> dict[str, Any]:
    section: dict[str, Any] = {"name": kind, "kind": kind, "capacity": capacity}
    if kind == "gpu":
        section["device"] = "cpu"
    elif kind == "disk":
        section["path"] = str(tmp_path / "disk")
    elif kind == "redis":
        section.update(url=redis_url, key_prefix=f"kvtier-engine-{next(_prefix)}", timeout="500ms")
    return section


def make_config(tiers: list[dict[str, Any]], write: str = "write_back") -> KvtierConfig:
    return load_config({"chunk_size": 32, "tiers": tiers,
                        "policy": {"write": write, "eviction": "prefix_lru", "promote_on_hit": True}}, env={})


@pytest.fixture
def tier_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[[str], dict[str, Any]]:
    def make(kind: str) -> dict[str, Any]:
        url = request.getfixturevalue("redis_server").url if kind == "redis" else None
        return tier_section(kind, tmp_path, url)

    return make


@pytest.mark.parametrize("model", [FULL, HYBRID], ids=["full", "hybrid"])
@pytest.mark.parametrize("write", ["write_through", "write_back"])
@pytest.mark.parametrize("kind", ["gpu", "cpu", "disk", "redis"])
def test_loaded_kv_equals_recomputed_kv(kind: str, write: str, model: ModelConfig,
                                        tier_factory: Callable[[str], dict[str, Any]]) -> None:
    cfg = make_config([tier_factory(kind)], write)
    result = run_conformance(KVTierPair(cfg), args=EngineArgs(model=model))
    assert result.passed, result.summary()
    assert result.logits_identical and result.max_logit_diff == 0.0
    assert result.external_hit_tokens > 0 and result.requests_with_hits >= 3
    assert result.stats.get(f"hits_{kind}", 0) > 0


@pytest.mark.parametrize("kind", ["gpu", "cpu", "disk", "redis"])
def test_bfloat16_hybrid_within_tolerance(kind: str, tier_factory: Callable[[str], dict[str, Any]]) -> None:
    result = run_conformance(KVTierPair(make_config([tier_factory(kind)])), args=EngineArgs(model=BF16_HYBRID))
    assert result.passed, result.summary()
    assert result.tolerance == BF16_TOLERANCE and result.max_logit_diff <= BF16_TOLERANCE
    assert result.external_hit_tokens > 0


def test_write_back_demotes_to_disk_and_loads_from_both_tiers(tmp_path: Path) -> None:
    cfg = make_config([tier_section("cpu", tmp_path, capacity="160KiB"), tier_section("disk", tmp_path)])
    result = run_conformance(KVTierPair(cfg), args=EngineArgs(model=FULL))
    assert result.passed, result.summary()
    assert result.stats.get("hits_cpu", 0) > 0 and result.stats.get("hits_disk", 0) > 0


def _corrupt_files(root: Path) -> int:
    count = 0
    for path in root.rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            count += 1
    return count


@pytest.mark.parametrize("model", [FULL, HYBRID], ids=["full", "hybrid"])
def test_corrupted_disk_records_are_recomputed(tmp_path: Path, model: ModelConfig) -> None:
    corrupted: list[int] = []
    cfg = make_config([tier_section("disk", tmp_path)])
    result = run_conformance(KVTierPair(cfg), args=EngineArgs(model=model), expect_hits=False,
                             expect_load_failures=True,
                             between_waves=lambda i: corrupted.append(_corrupt_files(tmp_path / "disk")))
    assert corrupted[0] > 0
    assert result.passed, result.summary()


def test_corrupted_redis_records_are_recomputed(tmp_path: Path, redis_server: Any) -> None:
    section = tier_section("redis", tmp_path, redis_server.url)

    def corrupt(_wave: int) -> None:
        for key in redis_server.cli("--scan", "--pattern", f"{section['key_prefix']}*").split():
            redis_server.cli("SETRANGE", key, "100", "garbage")

    result = run_conformance(KVTierPair(make_config([section])), args=EngineArgs(model=HYBRID), expect_hits=False,
                             expect_load_failures=True, between_waves=corrupt)
    assert result.passed, result.summary()


def test_redis_killed_between_waves(tmp_path: Path, redis_factory: Any) -> None:
    server = redis_factory()
    cfg = make_config([tier_section("redis", tmp_path, server.url)])
    result = run_conformance(KVTierPair(cfg), args=EngineArgs(model=HYBRID), expect_hits=False,
                             between_waves=lambda i: server.kill() if i == 0 else None)
    assert result.passed, result.summary()


def test_redis_killed_while_a_load_is_in_flight(tmp_path: Path, redis_factory: Any) -> None:
    server = redis_factory()
    killed: list[bool] = []

    def kill_when_parked(engine: Engine) -> None:
        parked = any(r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in engine.scheduler.requests.values())
        if parked and not killed:
            server.kill()
            killed.append(True)

    cfg = make_config([tier_section("redis", tmp_path, server.url)])
    result = run_conformance(KVTierPair(cfg), args=EngineArgs(model=FULL), expect_hits=False,
                             on_step=kill_when_parked)
    assert killed, "no load was ever parked waiting for Redis"
    assert result.passed, result.summary()


def _ktc(name: str, extra: dict[str, Any], **fields: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=extra, **fields)


def _overrides(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"chunk_size": 32, "tiers": tiers, "policy": {"write": "write_back"}}


def test_separate_halves_built_by_the_factory(tmp_path: Path) -> None:
    """As in vLLM: each role builds its own KVTierConnector from the extra config (no shared store)."""
    ktc = _ktc("KVTierConnector", _overrides([tier_section("cpu", tmp_path), tier_section("disk", tmp_path)]))
    result = run_conformance(None, args=EngineArgs(model=HYBRID), kv_transfer_config=ktc)
    assert result.passed, result.summary()
    assert result.external_hit_tokens > 0


def test_multi_connector_with_two_kvtier_children(tmp_path: Path) -> None:
    children = [{"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": _overrides([tier_section("cpu", tmp_path)])},
                {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": _overrides([tier_section("disk", tmp_path)])}]
    result = run_conformance(None, args=EngineArgs(model=HYBRID),
                             kv_transfer_config=_ktc("MultiConnector", {"connectors": children}))
    assert result.passed, result.summary()
    assert result.external_hit_tokens > 0


def test_multi_connector_with_a_legacy_child(tmp_path: Path) -> None:
    children = [{"kv_connector": "LegacyDictConnector", "kv_connector_module_path": "dict_connector",
                 "kv_role": "kv_both", "kv_connector_extra_config": {"store": f"legacy-{next(_prefix)}"}},
                {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": _overrides([tier_section("cpu", tmp_path)])}]
    result = run_conformance(None, args=EngineArgs(model=FULL),
                             kv_transfer_config=_ktc("MultiConnector", {"connectors": children}))
    assert result.passed, result.summary()
    assert result.external_hit_tokens > 0


def _exists_calls(server: Any) -> int:
    stats = server.cli("INFO", "commandstats")
    line = next((ln for ln in stats.splitlines() if ln.startswith("cmdstat_exists:")), "")
    return int(line.split("calls=")[1].split(",")[0]) if line else 0


@pytest.mark.parametrize("halves", ["pair", "factory"])
@pytest.mark.parametrize("private", [True, False], ids=["private", "shared"])
def test_a_private_redis_hits_with_no_lookup_on_the_server(tmp_path: Path, redis_factory: Any, private: bool,
                                                           halves: str) -> None:
    """``private: true``: the scheduler's directory tracks the tier as it does a local one, so no lookup asks the
    server; the same run on a shared tier asks it (EXISTS, counted by the server itself). ``factory``: each role
    builds its own connector, as in vLLM, so the saves that fill the tier run on another instance than the
    lookups."""
    server = redis_factory()
    section = {**tier_section("redis", tmp_path, server.url), "private": private}
    if halves == "pair":
        result = run_conformance(KVTierPair(make_config([section])), args=EngineArgs(model=FULL))
    else:
        result = run_conformance(None, args=EngineArgs(model=FULL),
                                 kv_transfer_config=_ktc("KVTierConnector", _overrides([section])))
    assert result.passed, result.summary()
    assert result.logits_identical and result.external_hit_tokens > 0 and result.requests_with_hits >= 3
    assert (_exists_calls(server) == 0) == private


def test_records_a_private_redis_dropped_behind_kvtier_are_recomputed(tmp_path: Path, redis_factory: Any) -> None:
    """What ``maxmemory`` eviction or a flush does to a private tier: kvtier still says present, the loads
    fail, and the engine recomputes those tokens with the same logits."""
    server = redis_factory()
    section = {**tier_section("redis", tmp_path, server.url), "private": True}
    flushed: list[bool] = []

    def flush(_wave: int) -> None:
        server.cli("FLUSHALL")
        flushed.append(True)

    result = run_conformance(KVTierPair(make_config([section])), args=EngineArgs(model=FULL), expect_hits=False,
                             expect_load_failures=True, between_waves=flush)
    assert flushed and result.passed, result.summary()
    assert result.load_failures > 0
