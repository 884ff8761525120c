"""README.md and docs/ stay true: links resolve, every snippet runs or parses as written, the commands they name
exist with the options they pass, and the tests and files they cite are there."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvtier.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.S | re.M)
LANGUAGES = {"python", "yaml", "bash", "json", ""}  # "": program output, diagrams, the module map


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _text(page: Path) -> str:
    return page.read_text()


def _blocks(lang: str) -> Iterator[tuple[Path, str]]:
    for page in PAGES:
        for found, body in FENCE.findall(_text(page)):
            if found == lang:
                yield page, body


def _prose(text: str) -> str:
    """``text`` without its fenced blocks (links and references are read from the prose)."""
    return FENCE.sub("", text)


# ---- links ------------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(_text(page)), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(_text(page)))


def test_docs_exist_where_the_readme_says() -> None:
    names = {_rel(p) for p in PAGES}
    for page in ("configuration", "vllm", "operating", "guarantees", "architecture"):
        assert f"docs/{page}.md" in names
    for bench in ("hit-rate", "throughput", "redis", "overhead", "fingerprint", "ttft", "vllm", "vllm-hybrid",
                  "vllm-overhead", "vllm-contention", "vllm-replay", "serve", "soak"):
        assert f"docs/benchmarks/{bench}.md" in names


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_points_to_a_file_and_anchor_that_exist(page: Path) -> None:
    bad = []
    for target in _links(page):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(page)}: " + "; ".join(bad)


def test_nothing_links_the_directory_beside_the_checkout() -> None:
    for page in PAGES:
        assert not [t for t in _links(page) if "shared" in t.split("/")], _rel(page)


def test_code_blocks_are_of_a_language_the_tests_check() -> None:
    for page in PAGES:
        langs = {lang for lang, _ in FENCE.findall(_text(page))}
        assert langs <= LANGUAGES, f"{_rel(page)}: blocks in {sorted(langs - LANGUAGES)} are not checked here"
        assert _text(page).count("```") % 2 == 0, f"{_rel(page)}: an unclosed code block"


# ---- snippets ---------------------------------------------------------------------------------------------

PYTHON = list(_blocks("python"))
# what a program prints, by a line of its source
PRINTS = {
    "chunk_keys(namespace, tokens, CHUNK)": ["stored 4 chunks in cpu", "lookup: 4 chunks",
                                             "another prompt: 0 chunks"],
    "serve_store(store, 0)": ['kvtier_stored_chunks_total{tier="cpu"} 2.0'],
}


def test_the_docs_have_python_programs() -> None:
    assert {marker for marker in PRINTS if any(marker in code for _, code in PYTHON)} == set(PRINTS)


@pytest.mark.parametrize(("page", "code"), PYTHON, ids=[f"{_rel(p)}-{i}" for i, (p, _) in enumerate(PYTHON)])
def test_python_snippets_run_as_written(page: Path, code: str, tmp_path: Path) -> None:
    """Each runs as a program of its own in an empty working directory (what it writes stays there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"{_rel(page)}:\n{code}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    for marker, lines in PRINTS.items():
        if marker in code:
            for line in lines:
                assert line in done.stdout, f"{_rel(page)}: printed {done.stdout!r}, not {line!r}"
    if '"path": "kvtier-cache"' in code:
        assert (tmp_path / "kvtier-cache").is_dir()  # a relative disk path is the working directory's


def test_yaml_snippets_are_valid_configs() -> None:
    found = list(_blocks("yaml"))
    assert len(found) >= 2
    for page, body in found:
        cfg = load_config(yaml.safe_load(body), env={})
        assert cfg.tiers, _rel(page)


def test_json_snippets_are_connector_configs_that_name_real_classes() -> None:
    integration = (ROOT / "kvtier" / "integrations" / "vllm.py").read_text()
    found = list(_blocks("json"))
    assert found
    for page, body in found:
        transfer = json.loads(body)
        assert transfer["kv_connector_module_path"] == "kvtier.integrations.vllm", _rel(page)
        assert f"class {transfer['kv_connector']}(" in integration


# ---- commands in bash blocks ------------------------------------------------------------------------------

def _commands(block: str) -> Iterator[list[str]]:
    """Each simple command of a bash block as argv (lines joined while a quote is open or a line ends in \\)."""
    pending = ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        pending = ""
        argv: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                    argv.pop(0)
                if argv:
                    yield argv
                argv = []
            else:
                argv.append(word)
    assert not pending, f"unclosed quote in {block!r}"


def _check_kvtier(argv: list[str]) -> None:
    from kvtier.bench.cli import build_parser as bench_parser
    from kvtier.ops.cli import SUBCOMMANDS, build_parser

    command = next((a for a in argv if not a.startswith("-")), None)
    assert command in SUBCOMMANDS, f"kvtier has no subcommand {command!r}"
    try:
        args = build_parser(command).parse_args(argv)
        if command == "bench":
            bench_parser(args.benchmark)[0].parse_args(args.bench_args)
    except SystemExit as exc:
        raise AssertionError(f"kvtier {shlex.join(argv)}: refused by its parser (exit {exc.code})") from None


def _check_script(script: Path, args: list[str]) -> None:
    text = script.read_text()
    if "--cost" in text and args == ["--cost"]:
        return
    wrapped = re.search(r'main\(\["bench", "([\w-]+)"', text)
    if wrapped or "hitrate_cli.add_arguments" in text:
        _check_kvtier(["bench", wrapped.group(1) if wrapped else "hit-rate", *args])
        return
    for arg in args:
        if arg.startswith("--"):
            assert f'"{arg}"' in text, f"{script.name} takes no {arg}"


def _check(argv: list[str]) -> None:
    exe, *args = argv
    if exe == "bash":
        script = ROOT / args[0]
        assert script.is_file(), f"no {args[0]}"
        usage = script.read_text()
        for flag in args[1:]:
            assert flag in usage, f"{args[0]} takes no {flag}"
    elif exe in ("kvtier", ".venv/bin/kvtier", ".venv-e2e/bin/kvtier"):
        _check_kvtier(args)
    elif exe in ("python", ".venv/bin/python", ".venv-e2e/bin/python"):
        if args[:2] == ["-m", "kvtier"]:
            _check_kvtier(args[2:])
        elif args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:  # vLLM's CPU build's server
            _check(["vllm", "serve", *args[2:]])
        else:
            script = ROOT / args[0]
            assert args[0].startswith("benchmarks/") and script.is_file(), f"no {args[0]}"
            _check_script(script, args[1:])
    elif exe == "vllm":
        assert args[0] == "serve"
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector_module_path"] == "kvtier.integrations.vllm"
        assert transfer["kv_connector"] in ("KVTierConnector", "KVTierMultiConnector")
    else:
        raise AssertionError(f"a command the docs tests do not know: {shlex.join(argv)}")


def test_bash_snippets_name_commands_and_options_that_exist() -> None:
    seen = 0
    for page, block in _blocks("bash"):
        for argv in _commands(block):
            try:
                _check(argv)
            except AssertionError as exc:
                raise AssertionError(f"{_rel(page)}: {exc}") from None
            seen += 1
    assert seen >= 15


def test_every_benchmark_page_regenerates_its_figures() -> None:
    for page in sorted((ROOT / "docs" / "benchmarks").glob("*.md")):
        if page.name == "README.md":
            continue
        text = _text(page)
        assert "## Regenerate" in text, _rel(page)
        regenerate = text.split("## Regenerate", 1)[1]
        assert FENCE.search(regenerate), f"{_rel(page)}: no command under Regenerate"
        results = set(re.findall(r"benchmarks/results/(\w+\.json)", text))
        assert results, f"{_rel(page)} names no result file"
        for name in results:
            assert (ROOT / "benchmarks" / "results" / name).is_file(), f"{_rel(page)}: no {name}"


# ---- what the docs cite -----------------------------------------------------------------------------------

CITED_PATH = re.compile(r"`((?:kvtier|tests|benchmarks|configs|scripts|requirements|\.ci)/[\w./-]*[\w/])`")
CITED_TEST = re.compile(r"`(tests/[\w/]+\.py)?::(\w+)(\[[^\]`]*\])?`|`(tests/[\w/]+\.py)`")


def test_cited_files_exist() -> None:
    for page in PAGES:
        for path in CITED_PATH.findall(_text(page)):
            assert (ROOT / path).exists(), f"{_rel(page)} cites {path}, which does not exist"


def test_cited_tests_exist() -> None:
    """A `tests/x.py::test_name` names a test there; so does `::test_name` (of the file last named on its line) and,
    in a table whose header says "Shown by (`tests/x.py::`)", a bare `test_name` in its rows."""
    count = 0
    for page in PAGES:
        table: str | None = None
        for line in _text(page).splitlines():
            header = re.search(r"\(`(tests/[\w/]+\.py)::`\)", line)
            if header or not line.startswith("|"):
                table = header.group(1) if header else None
            cited: list[tuple[str | None, str]] = []
            last: str | None = None
            for m in CITED_TEST.finditer(line):
                file, name, alone = m.group(1), m.group(2), m.group(4)
                last = file or alone or last
                if name is not None:
                    cited.append((last, name))
            if table and not header:
                cited += [(table, name) for name in re.findall(r"(?<![:\w])`(test_\w+)(?:\[[^\]`]*\])?`", line)]
            for file, name in cited:
                assert file is not None, f"{_rel(page)}: ::{name} follows no test file"
                source = (ROOT / file).read_text()
                assert re.search(rf"def {name}\(", source), f"{_rel(page)}: {file} has no {name}"
                count += 1
    assert count >= 100
