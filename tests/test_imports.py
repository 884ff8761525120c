"""Importing kvtier stays cheap: no torch, redis or vllm until a tier, a transfer or the integration needs them.
The scheduler half and ``kvtier check`` never need torch: they plan with block ids and shapes only
(kvtier.layout.geometry)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "redis", "vllm")


def _loaded_after(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; the JSON object its last output line prints."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_import_kvtier_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, json, kvtier, kvtier.config, kvtier.store.tiered, kvtier.control.directory, kvtier.control.policy, kvtier.records.codec, "
        "kvtier.connector.base, kvtier.connector.factory, kvtier.tiers, kvtier.ops.cli, kvtier.layout.geometry, "
        "kvtier.layout, kvtier.kvcopy.pages, kvtier.connector.tiered, kvtier.connector.multi, kvtier.connector.settings\n"
        "kvtier.load_config({'tiers': [{'name': 'cpu', 'kind': 'cpu', 'capacity': '1MiB'}]}, env={})\n"
        f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    )
    assert _loaded_after(code) == {"torch": False, "redis": False, "vllm": False}


SCHEDULER_STEP = """
import json, sys
from types import SimpleNamespace as NS

from kvtier.config import load_config
from kvtier.connector.scheduler.half import SchedulerHalf
from kvtier.control.directory import Directory, TierSlot
from kvtier.layout.geometry import NULL_BLOCK
from kvtier.layout import simple_config
from kvtier.control.policy import make_policy

cfg = load_config({"chunk_size": 32, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]}, env={})
kcc = simple_config(2, 1, 8, "float16", block_size=16, num_blocks=8)
directory = Directory([TierSlot("cpu", 1 << 20, make_policy("lru"))])
tier = NS(name="cpu", stored_size=lambda n: n)  # the scheduler only sizes records; tiers are the workers'
half = SchedulerHalf(cfg, kcc, [bytes(16)], directory=directory, tiers={"cpu": tier})
tokens = list(range(64))
req = NS(request_id="r", prompt_token_ids=tokens, all_token_ids=tokens, cache_salt=None, prompt_embeds=None,
         lora_request=None, mm_features=None, mm_hashes=None)
hit = half.get_num_new_matched_tokens(req, 0)
new = NS(req_id="r", block_ids=([3, 4, 5, NULL_BLOCK],), num_computed_tokens=0, prompt_embeds=None,
         prompt_token_ids=tokens)
step = NS(num_scheduled_tokens={"r": 64}, scheduled_new_reqs=[new],
          scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()))
meta = half.build_connector_meta(step)
print(json.dumps({"hit": list(hit), "saves": [[list(b) for b in s.block_ids] for s in meta.saves],
                  "loaded": [m for m in ("torch", "vllm") if m in sys.modules]}))
"""


def test_scheduler_half_plans_without_torch() -> None:
    """A lookup and a step's save plans in a process that never loads torch: the first chunk (blocks 3, 4) is
    saved, the second holds the null block and is not."""
    result = _loaded_after(SCHEDULER_STEP)
    assert result == {"hit": [0, False], "saves": [[[3, 4]]], "loaded": []}


def test_kvtier_check_runs_without_torch(tmp_path: Path) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("chunk_size: 256\ntiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB}\n")
    code = (
        "import json, sys\n"
        "from kvtier.ops.cli import main\n"
        f"rc = main(['check', {str(config)!r}, '--json', '--no-env'])\n"
        f"print(json.dumps({{'rc': rc, 'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stderr.strip().splitlines()[-1]) == {"rc": 0, "loaded": []}
    report = json.loads(done.stdout)
    assert report["ok"] and report["tiers"][0]["chunks"] == (1 << 30) // (256 * 131072)  # Llama-3.1-8B: 128 KiB/token


BENCH_HELP = """
import contextlib, io, json, sys
from kvtier.bench.cli import BENCHMARKS
from kvtier.ops.cli import main

codes = {}
for name in BENCHMARKS:
    with contextlib.redirect_stdout(io.StringIO()):
        codes[name] = main(["bench", name, "--help"])
print(json.dumps({"codes": codes, "loaded": [m for m in ("torch", "vllm") if m in sys.modules]}))
"""


def test_bench_help_of_every_benchmark_loads_no_torch() -> None:
    """``kvtier bench NAME --help`` parses its options before any torch or vllm import: it answers at once."""
    result = _loaded_after(BENCH_HELP)
    assert result["loaded"] == []
    assert set(result["codes"].values()) == {0}, result["codes"]  # type: ignore[union-attr]
