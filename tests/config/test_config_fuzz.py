"""Property tests: whatever dict, YAML text, environment or overrides load_config is fed, the only exception
that escapes is ConfigError, and every config it accepts round-trips through to_dict."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError

VALID: dict[str, Any] = {
    "chunk_size": 256,
    "namespace": {"model": "m", "revision": "main", "tenant": ""},
    "tiers": [
        {"name": "gpu", "kind": "gpu", "capacity": "1GiB", "device": "cpu"},
        {"name": "cpu", "kind": "cpu", "capacity": "2GiB"},
        {"name": "disk", "kind": "disk", "capacity": "8GiB", "path": "/tmp/kvtier-fuzz", "compression": "lz4"},
        {"name": "redis", "kind": "redis", "capacity": "4GiB", "url": "redis://127.0.0.1:6379/0", "ttl": "1h",
         "timeout_ms": 50},
    ],
    "policy": {"eviction": "lru", "write": "write_back", "promote_on_hit": True},
    "placement": {"full_attention": ["gpu", "cpu", "disk", "redis"], "sliding_window": ["gpu", "cpu"]},
    "save_partial_chunks": False,
    "security": {"hmac_key_env": None},
}
KEYS = sorted({"chunk_size", "namespace", "tiers", "policy", "placement", "name", "kind", "capacity", "path",
               "url", "ttl", "timeout", "timeout_ms", "eviction", "write", "compression", "device", "model",
               "full_attention", "mamba", "password", "cluster", "fsync", "shard_depth", "config_file", "connectors"})
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["2GiB", "0B", "-1MiB", "1.5GB", "50ms", "1h", "lru", "arc", "cpu", "disk",
                                          "redis", "gpu", "lz4", "none", "write_through", "redis+cluster://a:1,b:2",
                                          "unix://", "redis://:@:0/x", "$HOME/x", "~", "${}", "1e400"]),
)
KEY = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(KEY, inner, max_size=5)), max_leaves=20)
ENV = st.dictionaries(st.sampled_from(["KVTIER_CHUNK_SIZE", "KVTIER_TIERS__CPU__CAPACITY", "KVTIER_POLICY__EVICTION",
                                       "KVTIER_TIERS", "KVTIER_PLACEMENT__MAMBA", "KVTIER_NAMESPACE", "KVTIER_X",
                                       "KVTIER_TIERS__DISK__PATH", "KVTIER_CONFIG", "KVTIER_TIERS__REDIS__TTL",
                                       "KVTIER_CACHE_DIR", "KVTIER_POLICY", "HOME", "KVTIER_SECURITY__HMAC_KEY_ENV"]),
                      st.text(max_size=16) | st.sampled_from(["[cpu]", "{a: 1}", "4GiB", "lru", "[", "null"]),
                      max_size=4)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def only_config_errors(source: Any, env: dict[str, str] | None = None, overrides: Any = None) -> None:
    """load_config either returns a config that round-trips, or raises ConfigError: nothing else."""
    try:
        cfg = load_config(source, env=env or {}, overrides=overrides)
    except ConfigError as exc:
        assert str(exc)
        return
    assert isinstance(cfg, KvtierConfig)
    assert load_config(cfg.to_dict(), env={}) == cfg


def set_path(data: Any, path: list[Any], value: Any) -> Any:
    """Replace (or add) the value at path inside nested dicts/lists."""
    node = data
    for step in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(step if isinstance(step, str) else "x", {})
        elif isinstance(node, list) and node:
            node = node[step % len(node)] if isinstance(step, int) else node[0]
        else:
            return data
    if isinstance(node, dict):
        node[path[-1] if isinstance(path[-1], str) else "x"] = value
    elif isinstance(node, list) and node and isinstance(path[-1], int):
        node[path[-1] % len(node)] = value
    return data


PATHS = st.lists(st.one_of(st.sampled_from(KEYS), st.integers(0, 5)), min_size=1, max_size=4)


@FUZZ
@given(data=st.dictionaries(KEY, VALUES, max_size=8))
def test_random_dicts(data: dict[str, Any]) -> None:
    only_config_errors(data)


@FUZZ
@given(mutations=st.lists(st.tuples(PATHS, VALUES), min_size=1, max_size=3), env=ENV)
def test_mutated_valid_config(mutations: list[tuple[list[Any], Any]], env: dict[str, str]) -> None:
    data = copy.deepcopy(VALID)
    for path, value in mutations:
        set_path(data, path, value)
    only_config_errors(data, env=env)


@FUZZ
@given(over=st.dictionaries(KEY, VALUES, max_size=5), env=ENV)
def test_random_overrides_and_env(over: dict[str, Any], env: dict[str, str]) -> None:
    only_config_errors(copy.deepcopy(VALID), env=env, overrides=over)
    only_config_errors(None, env=env, overrides=over)


def _yaml_texts() -> st.SearchStrategy[str]:
    dumped = yaml.safe_dump(VALID)
    mutated = st.tuples(st.integers(0, len(dumped)), st.integers(0, 40), st.text(max_size=20)).map(
        lambda t: dumped[: t[0]] + t[2] + dumped[t[0] + t[1]:])
    return st.one_of(st.text(max_size=200), mutated)


@FUZZ
@given(text=_yaml_texts())
def test_random_yaml_files(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvtier.yaml"
        path.write_text(text, encoding="utf-8")
        only_config_errors(path)
        only_config_errors(None, env={"KVTIER_CONFIG": str(path)})


def test_valid_seed_loads() -> None:
    """The seed of the mutations is itself valid (else the fuzz would only exercise errors)."""
    cfg = load_config(copy.deepcopy(VALID), env={})
    assert [t.name for t in cfg.tiers] == ["gpu", "cpu", "disk", "redis"]
