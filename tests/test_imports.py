"""Importing kvtier stays cheap: no torch, redis or vllm until a tier, a transfer or the integration needs them."""

from __future__ import annotations

import json
import subprocess
import sys


def test_import_kvtier_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, json, kvtier, kvtier.config, kvtier.store, kvtier.directory, kvtier.policy, kvtier.codec, "
        "kvtier.connector.base, kvtier.connector.factory, kvtier.tiers, kvtier.cli\n"
        "kvtier.load_config({'tiers': [{'name': 'cpu', 'kind': 'cpu', 'capacity': '1MiB'}]}, env={})\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'redis', 'vllm')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"torch": False, "redis": False, "vllm": False}
