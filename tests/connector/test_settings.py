"""The one reader of engine settings (kvtier.connector.settings): what it reads, its defaults, its errors."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvtier.connector.settings import EngineSettings, child_configs, child_fields, read_settings
from kvtier.errors import ConnectorError


def vllm_like(extra: dict[str, object] | None = None) -> NS:
    return NS(kv_transfer_config=NS(kv_connector_extra_config=extra, engine_id="e0"),
              cache_config=NS(enable_prefix_caching=False, kv_cache_layout="NHD", cache_dtype="auto"),
              scheduler_config=NS(enable_chunked_prefill=True),
              parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=4, rank=6),
              model_config=NS(model="org/tiny", revision="r1", hf_config=None, dtype="float32", quantization=None),
              device_config=NS(device_type="cpu"))


def test_an_engine_that_says_nothing_gets_the_defaults() -> None:
    assert read_settings(None) == EngineSettings()
    bare = read_settings(NS())
    assert (bare.extra, bare.prefix_caching, bare.tp_size, bare.rank, bare.model) == ({}, None, 1, 0, None)
    assert bare.model_facts() is None


def test_a_vllm_config_is_read_once_into_plain_values() -> None:
    engine = read_settings(vllm_like({"config_file": "k.yaml", "chunk_size": 64}))
    assert engine.extra == {"config_file": "k.yaml", "chunk_size": 64}
    assert (engine.prefix_caching, engine.chunked_prefill) == (False, True)
    assert (engine.pipeline_size, engine.tp_size, engine.rank) == (1, 4, 6)
    assert (engine.model, engine.kv_cache_layout, engine.device_type) == ("org/tiny", "NHD", "cpu")
    facts = engine.model_facts()
    assert facts is not None and (facts.model, facts.revision, facts.dtype) == ("org/tiny", "r1", "float32")


def test_children_inherit_the_engine_id_and_get_their_own_transfer_config() -> None:
    parent = vllm_like({"connectors": [{"kv_connector": "A"}, {"kv_connector": "B", "engine_id": "x"}]})
    assert [f["engine_id"] for f in child_fields(parent.kv_transfer_config)] == ["e0", "x"]

    class Transfer(NS):
        pass

    parent.kv_transfer_config = Transfer(**vars(parent.kv_transfer_config))
    subs = child_configs(parent)
    assert [type(s.kv_transfer_config) for s in subs] == [Transfer, Transfer]
    assert [s.kv_transfer_config.kv_connector for s in subs] == ["A", "B"]
    assert all(s.model_config is parent.model_config for s in subs)  # shallow copies of the engine's config


@pytest.mark.parametrize("extra, message", [
    (None, "needs kv_connector_extra_config\\['connectors'\\]"),
    ({"connectors": []}, "a non-empty list"),
    ({"connectors": ["KVTierConnector"]}, r"\['connectors'\]\[0\] must be a dict"),
])
def test_a_malformed_child_list_is_one_clear_error(extra: dict[str, object] | None, message: str) -> None:
    with pytest.raises(ConnectorError, match=message):
        child_fields(vllm_like(extra).kv_transfer_config)


def test_a_hybrid_model_is_served_only_where_the_engine_keeps_states_at_block_boundaries() -> None:
    from kvtier.connector.capability import state_blocker
    from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    hybrid = KVCacheConfig((KVCacheGroupSpec(("a",), FullAttentionSpec(16, 1, 8, "float32")),
                            KVCacheGroupSpec(("m",), MambaSpec(16, ((4,),), ("float32",)))))
    attention_only = KVCacheConfig(hybrid.kv_cache_groups[:1])
    engine = vllm_like()
    engine.cache_config.mamba_cache_mode = "none"
    blocked = state_blocker(read_settings(engine), hybrid)
    assert blocked is not None and "mamba_cache_mode='none'" in blocked and "--mamba-cache-mode align" in blocked
    assert state_blocker(read_settings(engine), attention_only) is None
    engine.cache_config.mamba_cache_mode = "align"
    assert state_blocker(read_settings(engine), hybrid) is None
    assert state_blocker(read_settings(None), hybrid) is None  # the reference engine keeps states per block


def test_sizes_and_durations_the_engine_gives_as_numbers_warn_and_are_read_as_bytes_and_seconds(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's ``--kv-transfer-config`` JSON carries numbers: kept working (bytes, seconds), each one warned of;
    the same numbers in a YAML file are refused (tests/config/test_config.py)."""
    from kvtier.connector.tiered import config_from_engine

    extra = {"tiers": [{"name": "cpu", "kind": "cpu", "capacity": 1 << 20}],
             "policy": {"persist_max_lag": 3, "persist_after_idle": 0, "save_backlog": "64MiB"}}
    with caplog.at_level("WARNING", logger="kvtier"):
        cfg = config_from_engine(read_settings(vllm_like(extra)))
    assert cfg.tiers[0].capacity == 1 << 20 and cfg.policy.persist_max_lag == 3.0
    assert [r.getMessage() for r in caplog.records] == [
        "kvtier: kv_connector_extra_config: policy.persist_max_lag: 3 has no unit: read as seconds (write 3s, or "
        "another unit)",
        "kvtier: kv_connector_extra_config: tiers[0].capacity: 1048576 has no unit: read as bytes (write 1048576B, "
        "or another unit)"]
