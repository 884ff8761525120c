"""The ``KVTIER_*`` environment layer's warnings: unknown variables (with a did-you-mean), the project's own
non-config variables left alone, and a password written in a Redis URL of the config."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import load_config
from kvtier.config.layers import NON_CONFIG_VARS

BASE: dict[str, Any] = {"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}]}


def _warnings(caplog: pytest.LogCaptureFixture, source: Any = None, env: dict[str, str] | None = None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        load_config(BASE if source is None else source, env=env or {})
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_misspelt_section_warns_with_a_did_you_mean(caplog: pytest.LogCaptureFixture) -> None:
    assert _warnings(caplog, env={"KVTIER_POLYCY__EVICTION": "lru"}) == [
        "KVTIER_POLYCY__EVICTION is not a kvtier setting and is ignored (did you mean KVTIER_POLICY__EVICTION?)"]
    assert _warnings(caplog, env={"KVTIER_CHUNKSIZE": "5"}) == [
        "KVTIER_CHUNKSIZE is not a kvtier setting and is ignored (did you mean KVTIER_CHUNK_SIZE?)"]
    assert _warnings(caplog, env={"KVTIER_REDIS_PASWORD": "x"}) == [
        "KVTIER_REDIS_PASWORD is not a kvtier setting and is ignored (did you mean KVTIER_REDIS_PASSWORD?)"]
    [far] = _warnings(caplog, env={"KVTIER_ZZZ": "1"})
    assert far.startswith("KVTIER_ZZZ is not a kvtier setting and is ignored (config variables are KVTIER_<SECTION>")


def test_the_projects_own_variables_and_the_hmac_key_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    env = {**dict.fromkeys(NON_CONFIG_VARS, "1"), "KVTIER_CACHE_DIR": "/tmp/kvt", "KVTIER_CONFIG": "",
           "KVTIER_MY_KEY": "k", "KVTIER_CHUNK_SIZE": "64", "PATH": "/bin"}
    assert _warnings(caplog, {**BASE, "security": {"hmac_key_env": "KVTIER_MY_KEY"}}, env) == []


def test_every_kvtier_variable_the_project_reads_is_listed() -> None:
    """The scripts' and tests' own variables are in the one list (a new one must be added there)."""
    root = Path(__file__).resolve().parents[2]
    texts = [p.read_text() for d in ("scripts", "kvtier", "tests") for p in (root / d).rglob("*")
             if p.suffix in (".py", ".sh") and p.is_file()]
    used = {m for t in texts for m in re.findall(r"(?:environ(?:\.get)?\(|\[|\$\{?)\"?(KVTIER_[A-Z0-9_]+)", t)}
    config_like = {v for v in used if v.split("__")[0].removeprefix("KVTIER_").lower() in
                   ("chunk_size", "tiers", "policy", "namespace", "placement", "security")}
    assert used - config_like - {"KVTIER_TEST_HMAC", "KVTIER_TEST_WRITER_KEY"} <= NON_CONFIG_VARS


def test_a_password_in_a_redis_url_warns_without_showing_it(caplog: pytest.LogCaptureFixture) -> None:
    tier = {"name": "r", "kind": "redis", "capacity": "1GiB", "url": "redis://:hunter2@host:6379/0"}
    [line] = _warnings(caplog, {"tiers": [tier]})
    assert "hunter2" not in line
    assert line.startswith("tiers[0].url: the URL holds a password") and "$KVTIER_REDIS_PASSWORD" in line
    assert _warnings(caplog, {"tiers": [{**tier, "url": "redis://bob@host:6379/0"}]}) == []
    # from the environment it is not in a file: no warning
    assert _warnings(caplog, {"tiers": [{**tier, "url": "redis://host:6379/0"}]},
                     {"KVTIER_TIERS__R__URL": "redis://:hunter2@host:6379/0"}) == []
