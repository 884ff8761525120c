"""The README's examples and facts stay true: its YAML validates (and the full example in docs/configuration.md),
its vLLM examples parse and match docs/vllm.md, CI runs its test command, the files and behaviours its set-up
section names exist, its headline figures are those of the benchmark pages it links, and it stays one screen.
tests/test_docs.py checks every page's links, snippets and commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvtier.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def _section(title: str, text: str = README) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_a_first_screen_and_the_rest_is_in_docs() -> None:
    assert len(README.splitlines()) <= 170, "README.md is the first screen: move details into docs/"
    for title in ("Set up", "Use it in vLLM", "Configure", "Results", "Guarantees", "Documentation"):
        assert f"\n## {title}\n" in README
    for page in ("configuration", "vllm", "operating", "guarantees", "architecture"):
        assert f"(docs/{page}.md)" in _section("Documentation")


def test_configuration_examples_are_valid_configs() -> None:
    (short,) = [b for b in _blocks("yaml") if "tiers:" in b]
    cfg = load_config(yaml.safe_load(short), env={})
    assert [t.name for t in cfg.tiers] == ["cpu", "disk", "redis"]
    assert cfg.tier("redis").timeout == 0.05 and cfg.tier("disk").path == "/var/cache/kvtier"
    (full,) = [b for b in _blocks("yaml", (DOCS / "configuration.md").read_text()) if "tiers:" in b]
    cfg = load_config(yaml.safe_load(full), env={})
    assert [t.name for t in cfg.tiers] == ["gpu", "cpu", "disk", "redis"]
    assert cfg.tier("redis").timeout == 0.05


def test_vllm_examples_parse_and_name_the_integration_module() -> None:
    serve = next(b for b in _blocks("bash") if "vllm serve" in b)
    transfer = json.loads(serve.split("--kv-transfer-config", 1)[1].strip().strip("'"))
    assert transfer["kv_connector_module_path"] == "kvtier.integrations.vllm"
    (chained,) = [json.loads(b) for b in _blocks("json")]
    assert chained["kv_connector"] == "KVTierMultiConnector" and len(chained["kv_connector_extra_config"]["connectors"]) == 2
    vllm_page = (DOCS / "vllm.md").read_text()
    assert serve in _blocks("bash", vllm_page) and _blocks("json")[0] in _blocks("json", vllm_page)


def test_ci_runs_the_readme_test_command() -> None:
    test_command = next(b for b in _blocks("bash") if "scripts/test.sh" in b).strip()
    assert test_command == "bash scripts/bootstrap.sh --vllm --e2e && bash scripts/test.sh"
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci


def test_the_set_up_section_states_what_the_scripts_do() -> None:
    setup = _section("Set up")
    assert (ROOT / "requirements" / "vllm-0.33-cpu.lock.txt").is_file() and "requirements/vllm-0.33-cpu.lock.txt" in setup
    assert (ROOT / "kvtier" / "bench" / "traces" / "mooncake_conversation_trace.jsonl").is_file()
    assert "kvtier/bench/traces/" in setup
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "--ignore=tests/integration" in test_sh and "no .venv-e2e: the end-to-end tests (tests/e2e) are skipped" in test_sh
    for var in ("KVTIER_REQUIRE_ALL", "KVTIER_SKIP_E2E", "KVTIER_FULL"):
        assert var in test_sh and var in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert "KVTIER_REQUIRE_ALL=1 bash scripts/test.sh" in ci and "(CI sets it)" in setup
    assert 'mktemp -d' in ci and "git clone" in ci and "../shared" in ci  # a clone alone in a temporary directory
    assert "in a clone of the checkout in a fresh temporary directory, with nothing beside it" in setup


def test_the_default_disk_location_is_the_one_the_code_uses() -> None:
    tier = {"tiers": [{"name": "disk", "kind": "disk", "capacity": "1GiB"}]}
    assert load_config(tier, env={"KVTIER_CACHE_DIR": "/c", "XDG_CACHE_HOME": "/x"}).tier("disk").path == "/c/disk"
    assert load_config(tier, env={"XDG_CACHE_HOME": "/x", "HOME": "/h"}).tier("disk").path == "/x/kvtier/disk"
    assert load_config(tier, env={"HOME": "/h"}).tier("disk").path == "/h/.cache/kvtier/disk"
    rule = _section("Where the disk tier lives by default", (DOCS / "configuration.md").read_text())
    for text in ("`$KVTIER_CACHE_DIR/<tier name>`", "`$XDG_CACHE_HOME/kvtier/<tier name>`", "`~/.cache/kvtier/<tier name>`"):
        assert text in rule


def _table(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_each_headline_figure_is_on_the_benchmark_page_it_links_with_its_result_file() -> None:
    rows = _table(_section("Results"))
    assert len(rows) >= 12
    for benchmark, figures, page, result in rows:
        (target,) = re.findall(r"\]\((docs/benchmarks/[\w-]+\.md)\)", page)
        text = (ROOT / target).read_text()
        (json_file,) = re.findall(r"`(benchmarks/results/\w+\.json)`", result)
        assert (ROOT / json_file).is_file() and json_file in text, f"{benchmark}: {json_file} not on {target}"
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", figures):
            assert number in text, f"{benchmark}: {number} is not on {target}"


def test_the_guarantees_summary_links_the_sections_of_the_guarantees_page() -> None:
    """Each row links one section (tests/test_docs.py checks that the anchors exist)."""
    rows = _table(_section("Guarantees"))
    assert len(rows) >= 8
    anchors = [re.findall(r"\]\(docs/guarantees\.md#([\w-]+)\)", section) for _promise, section in rows]
    assert all(len(a) == 1 for a in anchors) and len({a[0] for a in anchors}) == len(rows)
    assert {"a-load-that-fails-an-io-loop-that-stalls", "isolation-and-security"} <= {a[0] for a in anchors}
