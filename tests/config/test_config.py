"""Config loading: sizes and durations, precedence of file < env < overrides, validation errors naming the key
path, the shipped configs, and round trip through to_dict (checks against an engine's layout: test_fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import (
    DEFAULT_CONFIG,
    CpuTierConfig,
    DiskTierConfig,
    KvtierConfig,
    RedisTierConfig,
    WritePolicy,
    load_config,
)
from kvtier.config.parse import format_duration, format_size, parse_duration, parse_size
from kvtier.errors import ConfigError
from kvtier.layout import GroupKind, simple_config
from kvtier.records.fit import check_fit

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
GiB = 1024**3


def base(**extra: Any) -> dict[str, Any]:
    """A small valid config dict."""
    cfg: dict[str, Any] = {"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"},
                                     {"name": "disk", "kind": "disk", "capacity": "4GiB", "path": "/tmp/kvt"}],
                           "policy": {"eviction": "lru"}}
    cfg.update(extra)
    return cfg


def write(tmp_path: Path, data: Any, name: str = "kvtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def error_of(source: Any = None, **kwargs: Any) -> ConfigError:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    return info.value


# ---- sizes and durations ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    (123, 123), ("123", 123), ("512MiB", 512 * 1024**2), ("2GiB", 2 * GiB), ("1.5GB", 1_500_000_000),
    ("64KiB", 65536), ("100MB", 100_000_000), ("10kB", 10_000), ("1TiB", 1024**4), ("4Gi", 4 * GiB),
    ("2G", 2_000_000_000), ("1.5KiB", 1536), (" 8 GiB ", 8 * GiB), ("7B", 7), (2.0 * GiB, 2 * GiB),
])
def test_parse_size(text: Any, expected: int) -> None:
    assert parse_size(text, "x") == expected


@pytest.mark.parametrize("text", ["2gib", "2 GIB", "GiB", "-1GiB", "1e9", "2XB", "", "1.2.3MB", True, None, [1]])
def test_parse_size_rejects(text: Any) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.capacity: "):
        parse_size(text, "tiers[0].capacity")


@pytest.mark.parametrize(("text", "expected"), [
    (2, 2.0), (0.5, 0.5), ("50ms", 0.05), ("2s", 2.0), ("1h", 3600.0), ("5m", 300.0), ("100us", 1e-4),
    ("1h30m", 5400.0), ("1.5s", 1.5), ("3", 3.0), ("2d", 172800.0), ("10min", 600.0),
])
def test_parse_duration(text: Any, expected: float) -> None:
    assert parse_duration(text, "x") == pytest.approx(expected)


@pytest.mark.parametrize("text", ["50 parsecs", "ms", "-1s", "1h-5m", float("inf"), True, "5M", [1]])
def test_parse_duration_rejects(text: Any) -> None:
    with pytest.raises(ConfigError, match=r"^tiers\[3\]\.ttl: "):
        parse_duration(text, "tiers[3].ttl")


def test_format_helpers_read_back() -> None:
    assert format_size(2 * GiB) == "2 GiB"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(100) == "100 B"
    for seconds in (0.05, 1.0, 90.0, 3600.0, 1.5, 0.0001):
        assert parse_duration(format_duration(seconds), "x") == pytest.approx(seconds)


# ---- the shipped configs ----------------------------------------------------------------------------------

def test_configs_directory_has_the_documented_files() -> None:
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "cpu.yaml", "cpu-disk-redis.yaml", "hybrid.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path: Path) -> None:
    cfg = load_config(path, env={"HOME": "/home/op"})
    assert cfg.tiers and cfg.chunk_size % 16 == 0
    check_fit(cfg, simple_config(32, 8, 128, block_size=16))
    assert load_config(cfg.to_dict(), env={}) == cfg
    # the dict survives YAML, as an operator would save it
    assert load_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict())), env={}) == cfg


def test_default_file_matches_embedded_default(tmp_path: Path) -> None:
    env = {"KVTIER_CACHE_DIR": str(tmp_path)}
    from_file = load_config(Path(__file__).resolve().parents[2] / "configs" / "default.yaml", env=env)
    embedded = load_config(None, env=env)
    assert embedded.tiers == from_file.tiers
    assert [t.name for t in embedded.tiers] == [t["name"] for t in DEFAULT_CONFIG["tiers"]]
    assert embedded.tier("disk") == DiskTierConfig("disk", 8 * GiB, path=str(tmp_path / "disk"))


def test_hybrid_placement_per_group_kind() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "hybrid.yaml", env={})
    assert cfg.tiers_for(GroupKind.FULL_ATTENTION) == ("gpu", "cpu", "disk")
    assert cfg.tiers_for(GroupKind.SLIDING_WINDOW) == ("gpu", "cpu")
    assert cfg.tiers_for(GroupKind.MAMBA) == ("cpu",)
    assert cfg.tiers_for(GroupKind.MLA) == ()


def test_redis_example_of_design(tmp_path: Path) -> None:
    text = """
chunk_size: 256
namespace: {model: meta-llama/Llama-3.1-8B, revision: main}
tiers:
  - {name: gpu,   kind: gpu,   capacity: 2GiB,   device: cuda:0}
  - {name: cpu,   kind: cpu,   capacity: 16GiB}
  - {name: disk,  kind: disk,  capacity: 200GiB, path: /var/cache/kvtier}
  - {name: redis, kind: redis, capacity: 64GiB,  url: redis://127.0.0.1:6379/0, ttl: 1h, timeout_ms: 50}
policy: {eviction: prefix_lru, write: write_back, promote_on_hit: true}
placement: {full_attention: [gpu, cpu, disk, redis], sliding_window: [gpu, cpu]}
"""
    cfg = load_config(write(tmp_path, text), env={})
    redis = cfg.tier("redis")
    assert isinstance(redis, RedisTierConfig)
    assert (redis.ttl, redis.timeout, redis.capacity, redis.cluster) == (3600.0, 0.05, 64 * GiB, False)
    assert cfg.tier("disk") == DiskTierConfig("disk", 200 * GiB, path="/var/cache/kvtier")
    assert cfg.policy.write is WritePolicy.WRITE_BACK
    assert cfg.namespace.model == "meta-llama/Llama-3.1-8B"


# ---- precedence -------------------------------------------------------------------------------------------

def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, base(chunk_size=64, namespace={"model": "m", "revision": "r1"}))
    env = {"KVTIER_CHUNK_SIZE": "128", "KVTIER_POLICY__EVICTION": "arc", "KVTIER_TIERS__CPU__CAPACITY": "4GiB",
           "KVTIER_NAMESPACE__REVISION": "0123"}
    over = {"chunk_size": 512, "tiers": [{"name": "disk", "capacity": "16GiB"},
                                         {"name": "redis", "kind": "redis", "capacity": "1GiB"}],
            "connectors": [{"kv_connector": "x"}]}
    only_file = load_config(path, env={})
    assert (only_file.chunk_size, only_file.policy.eviction, only_file.tier("cpu").capacity) == (64, "lru", GiB)
    with_env = load_config(path, env=env)
    assert (with_env.chunk_size, with_env.policy.eviction, with_env.tier("cpu").capacity) == (128, "arc", 4 * GiB)
    assert with_env.namespace == type(with_env.namespace)(model="m", revision="0123")  # raw text for strings
    full = load_config(path, env=env, overrides=over)
    assert full.chunk_size == 512 and full.policy.eviction == "arc"
    assert [t.name for t in full.tiers] == ["cpu", "disk", "redis"]
    assert full.tier("disk") == DiskTierConfig("disk", 16 * GiB, path="/tmp/kvt")  # merged by name
    assert full.tier("cpu").capacity == 4 * GiB


def test_kvtier_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, base(chunk_size=32))
    assert load_config(env={"KVTIER_CONFIG": str(path)}).chunk_size == 32
    other = write(tmp_path, base(chunk_size=48), "other.yaml")
    # the engine's config_file wins over the environment; an explicit source wins over both
    assert load_config(env={"KVTIER_CONFIG": str(path)}, overrides={"config_file": str(other)}).chunk_size == 48
    assert load_config(other, env={"KVTIER_CONFIG": str(path)}).chunk_size == 48


def test_env_none_reads_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CHUNK_SIZE", "96")
    assert load_config(write(tmp_path, base())).chunk_size == 96


def test_unrelated_env_variables_are_ignored(tmp_path: Path) -> None:
    env = {"KVTIER_REDIS_PASSWORD": "s3cret", "KVTIER_HMAC_KEY": "k", "KVTIER_LOG_LEVEL": "DEBUG", "PATH": "/bin"}
    assert load_config(base(), env=env) == load_config(base(), env={})


def test_env_placement_list_and_bool(tmp_path: Path) -> None:
    env = {"KVTIER_PLACEMENT__SLIDING_WINDOW": "[cpu]", "KVTIER_SAVE_PARTIAL_CHUNKS": "true",
           "KVTIER_TIERS__DISK__FSYNC": "yes"}
    cfg = load_config(base(), env=env)
    assert cfg.placement == {GroupKind.SLIDING_WINDOW: ("cpu",)}
    assert cfg.save_partial_chunks is True
    disk = cfg.tier("disk")
    assert isinstance(disk, DiskTierConfig) and disk.fsync is True


def test_overrides_without_file_replace_default_tiers() -> None:
    cfg = load_config(env={}, overrides={"tiers": [{"name": "mem", "kind": "cpu", "capacity": "1KiB"}]})
    assert [t.name for t in cfg.tiers] == ["mem"]


def test_disk_path_defaults_and_expansion(tmp_path: Path) -> None:
    tiers = [{"name": "d1", "kind": "disk", "capacity": "1GiB"},
             {"name": "d2", "kind": "disk", "capacity": "1GiB", "path": "$DATA/kv"},
             {"name": "d3", "kind": "disk", "capacity": "1GiB", "path": "~/kv"}]
    cfg = load_config({"tiers": tiers}, env={"XDG_CACHE_HOME": "/xdg", "DATA": "/data", "HOME": "/home/u"})
    assert [t.path for t in cfg.tiers] == ["/xdg/kvtier/d1", "/data/kv", "/home/u/kv"]  # type: ignore[attr-defined]
    cfg = load_config({"tiers": tiers[:1]}, env={"KVTIER_CACHE_DIR": str(tmp_path), "XDG_CACHE_HOME": "/xdg"})
    assert cfg.tiers[0] == DiskTierConfig("d1", GiB, path=str(tmp_path / "d1"))
    cfg = load_config({"tiers": tiers[:1]}, env={"HOME": "/home/u"})
    assert cfg.tiers[0].path == "/home/u/.cache/kvtier/d1"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("url", "cluster"), [
    ("redis://127.0.0.1:6379/0", False), ("rediss://user:pw@cache.example:6380/2", False),
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001", True), ("unix:///run/redis.sock", False),
])
def test_redis_urls(url: str, cluster: bool) -> None:
    cfg = load_config({"tiers": [{"name": "r", "kind": "redis", "capacity": "1GiB", "url": url}]}, env={})
    assert cfg.tiers[0] == RedisTierConfig("r", GiB, url=url, cluster=cluster)


def test_tier_kinds_and_compression() -> None:
    cfg = load_config({"tiers": [{"name": "c", "kind": "cpu", "capacity": "10B", "compression": "none"},
                                 {"name": "d", "kind": "disk", "capacity": "10B", "path": "/x", "compression": "zstd"}]},
                      env={})
    assert cfg.tiers == (CpuTierConfig("c", 10), DiskTierConfig("d", 10, compression="zstd", path="/x"))


# ---- validation errors name the key path ------------------------------------------------------------------

@pytest.mark.parametrize(("yaml_text", "env", "path", "words"), [
    ("policy: {save_backlog: 256}", {}, "policy.save_backlog", "256 has no unit (did you mean 256MiB or 256GiB? "
                                                                "256B is bytes)"),
    ("tiers: [{name: cpu, kind: cpu, capacity: 1073741824}]", {}, "tiers[0].capacity",
     "1073741824 has no unit (did you mean 1073741824B (1 GiB)?)"),
    ("policy: {persist_after_idle: 1000}", {}, "policy.persist_after_idle",
     "1000 has no unit (did you mean 1000ms? 1000s is seconds)"),
    ("tiers: [{name: r, kind: redis, capacity: 1GiB, url: 'redis://h/0', timeout: 1.5}]", {}, "tiers[0].timeout",
     "1.5 has no unit (did you mean 1.5s or 1.5ms?)"),
    ("policy: {}", {"KVTIER_POLICY__PERSIST_MAX_LAG": "2"}, "policy.persist_max_lag", "2 has no unit (did you mean "
                                                                                     "2s or 2ms?)"),
    ("policy: {}", {"KVTIER_POLICY__SAVE_BACKLOG": "64"}, "policy.save_backlog", "64 has no unit (did you mean "
                                                                                 "64MiB or 64GiB? 64B is bytes)"),
    ("policy: {persist_max_lag: '7'}", {}, "policy.persist_max_lag", "7 has no unit (did you mean 7s or 7ms?)"),
    ("policy: {}", {"KVTIER_POLICY__SAVE_BACKLOG": "0x100"}, "policy.save_backlog",
     "256 has no unit (did you mean 256MiB or 256GiB? 256B is bytes)"),  # a YAML hex number
    ("policy: {}", {"KVTIER_POLICY__PERSIST_MAX_LAG": "+2"}, "policy.persist_max_lag",
     "2 has no unit (did you mean 2s or 2ms?)"),
    ("policy: {save_backlog: 1.5}", {}, "policy.save_backlog", "1.5 has no unit (did you mean 1.5MiB or 1.5GiB?)"),
    ("policy: {}", {"KVTIER_POLICY": "{save_backlog: 256}"}, "policy.save_backlog",
     "256 has no unit (did you mean 256MiB or 256GiB? 256B is bytes)"),  # a whole section from one variable
    ("policy: {}", {"KVTIER_TIERS": "[{name: c, kind: cpu, capacity: 1GiB}, {name: r, kind: redis, "
                                    "url: 'redis://h/0', capacity: 1GiB, ttl: 60}]"}, "tiers[1].ttl",
     "60 has no unit (did you mean 60s or 60ms?)"),
])
def test_a_bare_number_for_a_size_or_a_duration_is_refused_with_a_guess(
        tmp_path: Path, yaml_text: str, env: dict[str, str], path: str, words: str) -> None:
    """YAML, a quoted YAML number and the environment alike: a number without a unit was read as bytes or seconds
    without a word (``save_backlog: 256`` was 256 bytes, ``persist_after_idle: 1000`` 1000 s)."""
    file = tmp_path / "kvtier.yaml"
    file.write_text(("tiers: [{name: cpu, kind: cpu, capacity: 1GiB}]\n" if "tiers" not in yaml_text else "")
                    + yaml_text + "\n")
    err = error_of(file, env=env)
    assert err.path == path and str(err) == f"{path}: {words}"


def test_a_whole_section_from_one_variable_reads_its_units() -> None:
    cfg = load_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}]},
                      env={"KVTIER_POLICY": "{save_backlog: 64MiB, persist_max_lag: 500ms, store_threshold: 2}",
                           "KVTIER_TIERS": "[{name: cpu, kind: cpu, capacity: 2GiB}]"})
    assert (cfg.policy.save_backlog, cfg.policy.persist_max_lag, cfg.policy.store_threshold) == (64 << 20, 0.5, 2)
    assert cfg.tiers[0].capacity == 2 << 30


def test_zero_needs_no_unit_and_units_read_as_written() -> None:
    cfg = load_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "4096B"}],
                       "policy": {"persist_after_idle": 0, "persist_max_lag": "0", "persist_at_close": "250ms"}},
                      env={})
    assert cfg.tiers[0].capacity == 4096
    assert (cfg.policy.persist_after_idle, cfg.policy.persist_max_lag, cfg.policy.persist_at_close) == (0, 0, 0.25)

def tier(**fields: Any) -> dict[str, Any]:
    return {"name": "t", "kind": "cpu", "capacity": "1GiB", **fields}


@pytest.mark.parametrize(("config", "path", "words"), [
    ({"tiers": [tier(capcity=1)]}, "tiers[0].capcity", "did you mean 'capacity'?"),
    ({**base(), "chunk_sise": 256}, "chunk_sise", "did you mean 'chunk_size'?"),
    ({**base(), "policy": {"evicton": "lru"}}, "policy.evicton", "did you mean 'eviction'?"),
    ({**base(), "chunk_size": "many"}, "chunk_size", "expected an integer"),
    ({**base(), "chunk_size": 0}, "chunk_size", "at least 1"),
    ({**base(), "chunk_size": -16}, "chunk_size", "at least 1"),
    ({**base(), "chunk_size": True}, "chunk_size", "expected an integer"),
    ({"tiers": [tier(), tier(name="x", capacity="12 parsecs")]}, "tiers[1].capacity", "bad size"),
    ({"tiers": [tier(capacity=0)]}, "tiers[0].capacity", "must be positive"),
    ({"tiers": [tier(capacity=-5)]}, "tiers[0].capacity", "must be positive"),
    ({"tiers": [tier(), tier()]}, "tiers[1].name", "duplicate tier name 't'"),
    ({"tiers": [tier(kind="tape")]}, "tiers[0].kind", "unknown tier kind 'tape'"),
    ({"tiers": [{"name": "t", "capacity": 1}]}, "tiers[0].kind", "missing"),
    ({"tiers": [{"kind": "cpu", "capacity": 1}]}, "tiers[0].name", "missing"),
    ({"tiers": [{"name": "t", "kind": "cpu"}]}, "tiers[0].capacity", "missing"),
    ({"tiers": [tier(compression="lz4")]}, "tiers[0].compression", "uncompressed"),
    ({"tiers": [tier(kind="gpu", compression="zstd")]}, "tiers[0].compression", "uncompressed"),
    ({"tiers": [tier(kind="disk", path="/x", compression="gzip")]}, "tiers[0].compression", "unknown compression"),
    ({"tiers": [tier(eviction="fifo")]}, "tiers[0].eviction", "unknown eviction policy"),
    ({**base(), "policy": {"eviction": "lur"}}, "policy.eviction", "did you mean 'lru'?"),
    ({**base(), "policy": {"write": "write_around"}}, "policy.write", "unknown write policy"),
    ({**base(), "policy": {"promote_on_hit": "sometimes"}}, "policy.promote_on_hit", "true or false"),
    ({**base(), "policy": {"store_threshold": 0}}, "policy.store_threshold", "at least 1"),
    ({**base(), "policy": {"save_backlog": "lots"}}, "policy.save_backlog", "size"),
    ({**base(), "placement": {"sliding_windows": ["cpu"]}}, "placement.sliding_windows", "did you mean 'sliding_window'?"),
    ({**base(), "placement": {"sliding_window": ["gpu"]}}, "placement.sliding_window[0]", "no tier named 'gpu'"),
    ({**base(), "placement": {"mamba": ["cpu", "cpu"]}}, "placement.mamba[1]", "listed twice"),
    ({**base(), "placement": {"mamba": ["disk", "cpu"]}}, "placement.mamba", "fastest first"),
    ({**base(), "placement": {"mamba": {"cpu": 1}}}, "placement.mamba", "expected a list"),
    ({"tiers": []}, "tiers", "no tiers"),
    ({"tiers": None}, "tiers", "no tiers"),
    ({"chunk_size": 256}, "tiers", "no tiers"),
    ({"tiers": {"name": "cpu"}}, "tiers", "expected a list"),
    ({"tiers": ["cpu"]}, "tiers[0]", "expected a mapping"),
    ({"tiers": [tier(kind="redis", password="hunter2")]}, "tiers[0].password", "KVTIER_REDIS_PASSWORD"),
    ({"tiers": [tier(kind="redis", url="http://x:1")]}, "tiers[0].url", "unsupported Redis URL scheme"),
    ({"tiers": [tier(kind="redis", url="redis://x:99999/0")]}, "tiers[0].url", "bad port"),
    ({"tiers": [tier(kind="redis", url="redis://x:\u00b96379/0")]}, "tiers[0].url", "bad port"),  # a digit to str
    ({"tiers": [tier(kind="redis", url="redis://x:6379/\u00b2")]}, "tiers[0].url", "bad database"),
    ({"tiers": [tier(kind="redis", url="redis://a:1,b:2")]}, "tiers[0].url", "redis+cluster"),
    ({"tiers": [tier(kind="redis", url="redis+cluster://a:1", cluster=False)]}, "tiers[0].cluster", "redis+cluster"),
    ({"tiers": [tier(kind="redis", timeout="fast")]}, "tiers[0].timeout", "bad duration"),
    ({"tiers": [tier(kind="redis", timeout=0)]}, "tiers[0].timeout", "must be positive"),
    ({"tiers": [tier(kind="redis", timeout_ms=-3)]}, "tiers[0].timeout_ms", "milliseconds"),
    ({"tiers": [tier(kind="redis", timeout_ms=5, timeout="5ms")]}, "tiers[0].timeout_ms", "conflicts"),
    ({"tiers": [tier(kind="redis", ttl="forever")]}, "tiers[0].ttl", "bad duration"),
    ({"tiers": [tier(kind="redis", pool_size=0)]}, "tiers[0].pool_size", "at least 1"),
    ({"tiers": [tier(kind="disk", path="$NOPE/kv")]}, "tiers[0].path", "$NOPE"),
    ({"tiers": [tier(kind="disk", path=5)]}, "tiers[0].path", "expected a string"),
    ({"tiers": [tier(kind="disk", name="a", path="/x"), tier(kind="disk", name="b", path="/x/")]},
     "tiers[1].path", "share"),
    ({"tiers": [tier(kind="disk", path="/x", timeout_ms=5)]}, "tiers[0].timeout_ms", "unknown key"),
    ({"tiers": [tier(name="")]}, "tiers[0].name", "empty"),
    ({"tiers": [tier(name="my tier")]}, "tiers[0].name", "bad tier name"),
    ({**base(), "namespace": {"model": 7}}, "namespace.model", "expected a string"),
    ({**base(), "namespace": "llama"}, "namespace", "expected a mapping"),
    ({**base(), "security": {"hmac_key": "x"}}, "security.hmac_key", "did you mean 'hmac_key_env'?"),
    (dict[Any, Any]({**base()}) | {7: 1}, "7", "keys must be strings"),
])
def test_invalid_config_names_the_path(config: dict[str, Any], path: str, words: str) -> None:
    err = error_of(config)
    assert err.path == path
    assert str(err).startswith(f"{path}: ")
    assert words in str(err)


def test_invalid_file_names_the_path(tmp_path: Path) -> None:
    err = error_of(write(tmp_path, "tiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB, evictoin: lru}\n"))
    assert err.path == "tiers[0].evictoin" and "did you mean 'eviction'?" in str(err)


@pytest.mark.parametrize(("text", "words"), [
    ("tiers: [", "invalid YAML"), ("- a\n- b\n", "top level must be a mapping"), ("", "no tiers"),
    ("a: &x [*x]", "unknown key"),
])
def test_malformed_files(tmp_path: Path, text: str, words: str) -> None:
    assert words in str(error_of(write(tmp_path, text)))


def test_a_yaml_syntax_error_is_one_line_naming_the_file_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 256\ntiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB\n")
    text = str(error_of(path))
    assert "\n" not in text and "<unicode string>" not in text
    assert text.startswith(f"{path}: invalid YAML: line 4, column 1: ")


def test_missing_file_and_bad_source(tmp_path: Path) -> None:
    assert "not found" in str(error_of(tmp_path / "absent.yaml"))
    assert "not found" in str(error_of(env={"KVTIER_CONFIG": str(tmp_path / "absent.yaml")}))
    assert "cannot read" in str(error_of(tmp_path))
    assert "file path or a mapping" in str(error_of(42))
    (tmp_path / "latin1.yaml").write_bytes(b"chunk_size: 256 # \xe9t\xe9\n")
    assert "cannot read" in str(error_of(tmp_path / "latin1.yaml"))


@pytest.mark.parametrize(("env", "path", "words"), [
    ({"KVTIER_CHUNK_SIZE": "abc"}, "chunk_size", "expected an integer"),
    ({"KVTIER_POLICY__EVICTON": "lru"}, "policy.evicton", "did you mean 'eviction'?"),
    ({"KVTIER_TIERS__GPU__CAPACITY": "4GiB"}, "tiers", "no tier named 'gpu'"),
    ({"KVTIER_TIERS__CPU__CAPACITY": "lots"}, "tiers[0].capacity", "bad size"),
    ({"KVTIER_TIERS": "7"}, "tiers", "expected a list"),
    ({"KVTIER_TIERS__CPU": "1"}, "tiers.cpu", "inside a tier"),
])
def test_invalid_env_names_the_path(env: dict[str, str], path: str, words: str) -> None:
    err = error_of(base(), env=env)
    assert err.path == path and words in str(err)


def test_invalid_overrides_name_the_path() -> None:
    err = error_of(base(), overrides={"tiers": [{"kind": "cpu", "capacity": 1}]})
    assert err.path == "tiers[0].name" and "merged by name" in str(err)
    err = error_of(base(), overrides={"tiers": [{"name": "cpu", "capacity": "0B"}]})
    assert err.path == "tiers[0].capacity"
    assert error_of(base(), overrides={"polcy": {}}).path == "polcy"


# ---- round trip -------------------------------------------------------------------------------------------

def test_to_dict_round_trip_of_every_option() -> None:
    cfg = load_config({
        "chunk_size": 128, "namespace": {"model": "m", "revision": "abc", "tenant": "t1"},
        "tiers": [{"name": "g", "kind": "gpu", "capacity": "1GiB", "device": "cpu", "slot_bytes": "1MiB"},
                  {"name": "c", "kind": "cpu", "capacity": "2GiB", "pin_memory": False, "eviction": "s3fifo"},
                  {"name": "d", "kind": "disk", "capacity": "3GiB", "path": "/p", "fsync": True, "shard_depth": 0,
                   "compression": "lz4"},
                  {"name": "r", "kind": "redis", "capacity": "4GiB", "url": "rediss://h:1/3", "ttl": "90m",
                   "timeout_ms": 25, "connect_timeout": "2s", "username": "u", "tls_ca": "/ca.pem"}],
        "policy": {"eviction": "arc", "write": "write_through", "promote_on_hit": False, "store_threshold": 2,
                   "admission": "learned", "admission_min_reuse": 0.25, "save_at": "evict", "save_backlog": "64MiB",
                   "persist_after_idle": 0, "persist_max_lag": "3s", "persist_at_close": "500ms"},
        "placement": {"full_attention": ["g", "c", "d", "r"], "mla": ["c"]},
        "save_partial_chunks": True, "security": {"hmac_key_env": "KVTIER_HMAC_KEY"},
    }, env={})
    plain = cfg.to_dict()
    assert plain["tiers"][3]["timeout"] == "0.025s" and plain["tiers"][3]["ttl"] == "5400.0s"
    assert plain["policy"] == {"eviction": "arc", "write": "write_through", "promote_on_hit": False,
                               "store_threshold": 2, "admission": "learned", "admission_min_reuse": 0.25, "save_at": "evict",
                               "save_backlog": f"{64 << 20}B", "persist_after_idle": "0.0s",
                               "persist_max_lag": "3.0s", "persist_at_close": "0.5s"}
    again = load_config(yaml.safe_load(yaml.safe_dump(plain)), env={})
    assert again == cfg and isinstance(again, KvtierConfig)


def test_a_redis_tiers_private_key_defaults_to_false_and_is_read_from_the_file_and_the_environment() -> None:
    """``private: true``: no other engine reads this Redis (the save admission judges it, kvtier.connector.scheduler
    .half); a value that is not a boolean is one line naming the key."""
    tiers = [{"name": "redis", "kind": "redis", "capacity": "1GiB"}]
    assert load_config({"chunk_size": 16, "tiers": tiers}, env={}).tier("redis") == RedisTierConfig("redis", 1 << 30)
    for raw, env in (({**tiers[0], "private": True}, {}), (tiers[0], {"KVTIER_TIERS__REDIS__PRIVATE": "true"})):
        tier = load_config({"chunk_size": 16, "tiers": [raw]}, env=env).tier("redis")
        assert isinstance(tier, RedisTierConfig) and tier.private
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.private: expected true or false"):
        load_config({"chunk_size": 16, "tiers": [{**tiers[0], "private": "yes"}]}, env={})
