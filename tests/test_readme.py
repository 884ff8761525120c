"""The README's examples stay true: its YAML validates, its vLLM JSON parses, CI runs its test command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvtier.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_configuration_example_is_a_valid_config() -> None:
    (example,) = [b for b in _blocks("yaml") if "tiers:" in b]
    cfg = load_config(yaml.safe_load(example), env={})
    assert [t.name for t in cfg.tiers] == ["gpu", "cpu", "disk", "redis"]
    assert cfg.tier("redis").timeout == 0.05


def test_vllm_examples_parse_and_name_the_integration_module() -> None:
    serve = next(b for b in _blocks("bash") if "vllm serve" in b)
    transfer = json.loads(serve.split("--kv-transfer-config", 1)[1].strip().strip("'"))
    assert transfer["kv_connector_module_path"] == "kvtier.integrations.vllm"
    (chained,) = [json.loads(b) for b in _blocks("json")]
    assert chained["kv_connector"] == "KVTierMultiConnector" and len(chained["kv_connector_extra_config"]["connectors"]) == 2


def test_ci_runs_the_readme_test_command() -> None:
    test_command = next(b for b in _blocks("bash") if "scripts/test.sh" in b).strip()
    assert test_command == "bash scripts/bootstrap.sh --vllm --e2e && bash scripts/test.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci
