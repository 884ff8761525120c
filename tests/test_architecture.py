"""The house: kvtier's import graph keeps the layers that docs/architecture.md declares.

The contracts live in pyproject.toml (``[tool.importlinter]``) and import-linter checks them against the code's
own imports, every import counted (those inside functions and under ``TYPE_CHECKING`` too):

* no import circles between the modules and folders of one folder, at every depth (import-linter's
  acyclic_siblings: a module that imports one from a folder beside it ties the two folders);
* the layers, top down: bench, ops, engine, integrations, connector, store, tiers | kvcopy, control, records,
  config, layout, errors; no import runs back up, so the library never imports ops/, bench/ or engine/;
* the connector's scheduler half and worker half never import each other;
* the config, the engine's KV model, the control plane and the scheduler half import no torch, vLLM or redis
  themselves, and neither does the root package (tests/test_imports.py checks what importing them loads, in a
  fresh interpreter);
* only kvtier.integrations (and the layers above the library) imports vLLM.

A broken contract prints the import chain that breaks it; ``.venv/bin/lint-imports`` prints the same report.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def _contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {str(c["id"]): c for c in config["contracts"]}


def test_the_import_graph_keeps_every_contract() -> None:
    """lint-imports in its own interpreter (it configures logging, which would silence kvtier's loggers here)."""
    run = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
           "--config", str(PYPROJECT), "--no-cache"]
    proc = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "0 broken" in proc.stdout, proc.stdout[-2000:]


def test_the_contracts_cover_what_the_architecture_page_declares() -> None:
    """The layers contract names every folder of kvtier/ and the page lists the same layers in the same order."""
    contracts = _contracts()
    assert {"no-circles", "layers", "halves", "no-tensors", "cheap-root", "vllm-adapter"} <= set(contracts)
    layers = [name.strip() for layer in contracts["layers"]["layers"] for name in str(layer).split("|")]
    folders = {p.name for p in (ROOT / "kvtier").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(layers) - {"errors"}, sorted(folders ^ set(layers))
    flat = sorted(p.name for p in (ROOT / "kvtier").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "errors.py"], flat
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[page.index("## The layers"):page.index("## The routes")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    positions = [next((i for i, row in enumerate(rows) if f"`{name}/`" in row.split("|")[1]), -1)
                 for name in layers if name != "errors"]
    assert -1 not in positions and positions == sorted(positions), dict(zip(layers, positions, strict=False))


NOT_KVTIER = {"index_select", "ttl"}  # torch's, and a config key


def _defined() -> tuple[dict[str, set[str]], set[str]]:
    """Each class of kvtier/ with the methods and attributes its body defines, and every function name."""
    classes: dict[str, set[str]] = {}
    functions: set[str] = set()
    for path in (ROOT / "kvtier").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                names.update(n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
                names.update(t.id for n in node.body if isinstance(n, ast.Assign | ast.AnnAssign)
                             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                             if isinstance(t, ast.Name))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.add(node.name)
    return classes, functions


def test_every_call_the_routes_name_exists() -> None:
    """The routes on the architecture page name real code: each ``Class.method`` is a method of that class, each
    bare name a function of kvtier/, each path a file (the standard library's ``os.*`` aside)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    routes = page[page.index("## The routes"):page.index("## Disk reads")]
    classes, functions = _defined()
    missing = []
    for name in re.findall(r"`([A-Za-z_][\w./]*)`", routes):
        if name.endswith(".py"):
            if not (ROOT / "kvtier" / name).is_file():
                missing.append(name)
        elif name.startswith("os.") or "/" in name or name in NOT_KVTIER:
            continue
        elif "." in name:
            cls, _, method = name.partition(".")
            if method not in classes.get(cls, set()):
                missing.append(name)
        elif name not in functions and name not in classes:
            missing.append(name)
    assert not missing, f"docs/architecture.md's routes name code that is not there: {missing}"
