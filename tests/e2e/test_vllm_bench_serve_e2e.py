"""``kvtier bench serve --quick``: the synthetic multi-turn set through three real ``vllm`` OpenAI servers (vLLM's
prefix cache alone, + kvtier cpu+disk, no cache) with streaming clients. Speed is not asserted; the hit
accounting and the outputs are: every completion equals the no-cache server's, kvtier's hit tokens by tier add up
to vLLM's own count of transferred tokens, and the prefix-only server's hits are all its own cache's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import engine_env


@pytest.mark.timeout(900)  # the engines start in subprocesses; pytest's 300 s default is too tight on a loaded machine
def test_bench_serve_quick_run_accounts_every_hit_and_changes_no_answer(workdir: Path) -> None:
    out = workdir / "vllm_serve.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "serve", "--quick", "--json", str(out),
                           "--no-plot"], env=engine_env(workdir), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "each 512-token hash block -> 32 tokens" in proc.stdout
    data = json.loads(out.read_text())
    assert data["checks"] == {"passed": True, "failures": []}
    [point] = data["points"]
    modes, requests = point["modes"], data["settings"]["requests"]
    assert set(modes) == {"prefix", "kvtier_cpu_disk", "none"} and point["reference_mode"] == "none"
    for row in modes.values():
        assert row["requests"] == requests and row["errors"] == 0 and row["mismatches"] == 0
        assert row["prompt_tokens"] == data["settings"]["prompt_tokens"]  # every prompt counted once by vLLM
        assert row["reconciled"] and row["kvtier_load_failures"] == 0
        by_source = row["tokens_by_source"]  # the server's per-request usage agrees with its /metrics
        assert row["client_cached_tokens"] == by_source["local_cache_hit"] + by_source["external_kv_transfer"]
        assert row["prefill_computed_tokens"] == by_source["local_compute"]  # per request == per engine step
    kvtier = modes["kvtier_cpu_disk"]
    assert kvtier["kvtier_hit_tokens_total"] > 0
    assert kvtier["kvtier_hit_tokens_total"] == kvtier["tokens_by_source"]["external_kv_transfer"]
    assert kvtier["hit_rate"] > modes["prefix"]["hit_rate"]
    # A signal a recompute cannot give: the engine computed fewer prompt tokens than with its own cache alone (its
    # per-request count agrees, above), and kvtier copied exactly its hit tokens' KV bytes out of its tiers.
    computed = {m: r["tokens_by_source"]["local_compute"] for m, r in modes.items()}
    assert computed["kvtier_cpu_disk"] < computed["prefix"] < computed["none"] == data["settings"]["prompt_tokens"]
    assert kvtier["kvtier_load_bytes"] == kvtier["kvtier_hit_tokens_total"] * data["settings"]["kv_bytes_per_token"]
    assert sum(kvtier["kvtier_tier_read_bytes"].values()) >= kvtier["kvtier_load_bytes"]
    assert sum(kvtier["kvtier_stored_bytes"].values()) > 0
    prefix = modes["prefix"]
    assert prefix["tokens_by_source"]["local_cache_hit"] > 0
    assert prefix["tokens_by_source"]["external_kv_transfer"] == 0 and prefix["kvtier_hit_tokens"] == {}
    assert modes["none"]["hit_rate"] == 0
    assert set(point["simulation"]) == {"prefix", "kvtier_cpu_disk"}

