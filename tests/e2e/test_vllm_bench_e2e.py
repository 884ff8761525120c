"""The vLLM benchmarks' own engines, in bounded smoke runs (``--quick``): ``kvtier bench vllm`` hits and gives the
uncached first tokens, ``vllm-overhead`` measures no-hit requests with kvtier working and paused, and
``vllm-replay`` replays the Mooncake trace with the hit accounting checked against the engine's own count of the
tokens it computed, and ``vllm-contention`` adds requests that load from disk to a decoding batch. Speed is not asserted here; the full runs write README's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import computed_tokens, counts_env, engine_env

from kvtier.bench.hitrate import DEFAULT_TRACE


@pytest.mark.timeout(600)  # the engines start in subprocesses; pytest's 300 s default is too tight on a loaded machine
def test_bench_vllm_quick_run_reports_hits_and_same_first_tokens(workdir: Path) -> None:
    """``kvtier bench vllm --quick``: the benchmark's own engines, a smoke run of two modes. The engines' own
    counts show the hits: kvtier's requests compute only their 16 new tokens, which no recompute does."""
    out = workdir / "vllm_engine.json"
    counts = workdir / "counts.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "vllm", "--quick", "--modes", "none",
                           "kvtier_disk", "--json", str(out), "--no-plot"],
                          env={**engine_env(workdir), **counts_env(counts)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    table = json.loads(out.read_text())["results"]
    for length, rows in table.items():
        assert rows["none"]["cached_tokens"] == 0
        assert rows["kvtier_disk"]["cached_tokens"] == int(length)
        assert rows["kvtier_disk"]["same_first_token_as_none"] is True
        assert 0 < rows["kvtier_disk"]["ttft_s"]["min"] <= rows["kvtier_disk"]["ttft_s"]["median"]
    from kvtier.bench.vllm_engine import PHASES, SUFFIX

    suffix_only = [n for _, n in computed_tokens(counts) if n == SUFFIX]  # TTFT requests: max_tokens=1
    assert len(suffix_only) >= len(table), computed_tokens(counts)
    _check_breakdown(json.loads(out.read_text())["raw"], PHASES)


def _check_breakdown(raw: dict[str, Any], phases: tuple[str, ...]) -> None:
    """Each request's phases add up to its time to first token; kvtier's copies wrote the whole prefix (twice the
    bytes for twice the tokens; none's engine copied nothing), and the medium alone read the same bytes."""
    copied: dict[int, int] = {}
    for mode, res in raw.items():
        for length, samples in res["phases"].items():
            for sample, ttft in zip(samples, res["ttft_s"][length], strict=True):
                assert sum(sample[p] for p in phases) == pytest.approx(ttft, rel=1e-6), (mode, sample)
            if mode == "none":
                assert all(s["bytes"] == 0 and s["copy"] == 0 for s in samples)
                continue
            assert {s["bytes"] for s in samples} == {res["medium_alone"][length]["bytes"]}
            assert all(s["copy"] > 0 and s["medium_s"] > 0 for s in samples)
            copied[int(length)] = samples[0]["bytes"]
    small, large = sorted(copied)
    assert copied[large] * small == copied[small] * large > 0, copied


@pytest.mark.timeout(600)  # the engines start in subprocesses; pytest's 300 s default is too tight on a loaded machine
def test_bench_vllm_overhead_quick_run_times_kvtier_working_and_paused(workdir: Path) -> None:
    """``kvtier bench vllm-overhead --quick``: engines take turns on new prompts; every request misses (the
    benchmark refuses a hit); the kvtier engine saved every full chunk of the requests it ran working (3 rounds
    of 3 prompts of 128 tokens: 36 chunks of 32) and none of those it ran paused; every mode generated the same
    tokens; every figure and both ratios are there."""
    out = workdir / "vllm_overhead.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "vllm-overhead", "--quick", "--modes", "none",
                           "kvtier_cpu", "--json", str(out)], env=engine_env(workdir), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"none", "kvtier_cpu", "kvtier_cpu_off"}
    assert len(data["raw"]["none"]) == 12 and len(data["raw"]["kvtier_cpu"]) == 6
    assert data["same_tokens_as_none"] == {"none": True, "kvtier_cpu": True, "kvtier_cpu_off": True}
    assert data["kvtier_counters"]["kvtier_cpu"]["save_chunks"] == 36
    for row in data["results"].values():
        assert all(row[m]["median"] > 0 for m in ("ttft_s", "decode_s_per_token", "step_s"))
    ratios = data["results"]["kvtier_cpu"]
    assert set(ratios["vs_off"]) == set(ratios["vs_none"]) == {"ttft_s", "decode_s_per_token", "step_s"}
    assert ratios["hook_ms"]["median"] > data["results"]["kvtier_cpu_off"]["hook_ms"]["median"] > 0


@pytest.mark.timeout(900)  # the engines start in subprocesses; pytest's 300 s default is too tight on a loaded machine
@pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="the Mooncake trace in kvtier/bench/traces is not here")
def test_bench_vllm_replay_quick_run_accounts_every_hit_and_changes_no_answer(workdir: Path) -> None:
    """``kvtier bench vllm-replay --quick``: 150 trace requests through four engines with KV memory for 10% of the
    working set. Every engine's completions equal the prefix-cache engine's; kvtier's modes hit beyond vLLM's
    cache; and each engine's own count of the tokens it computed (recorded in vLLM's scheduler, per process)
    equals prompt tokens minus the cached ones it reported, so kvtier's hits were loaded, not recomputed."""
    out = workdir / "vllm_replay.json"
    counts = workdir / "counts.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "vllm-replay", "--quick", "--json", str(out)],
                          env={**engine_env(workdir), **counts_env(counts)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    modes, settings = data["results"]["modes"], data["settings"]
    requests, outputs = settings["requests"], settings["output_tokens"]
    assert all(row["same_tokens_as_prefix"] == requests for row in modes.values())
    assert modes["prefix"]["kvtier_hit_rate"] == 0
    assert modes["kvtier_cpu_disk"]["kvtier_hit_rate"] > 0
    assert modes["kvtier_cpu_disk"]["hit_rate"] > modes["prefix"]["hit_rate"]
    counters = data["kvtier_counters"]
    assert counters["kvtier_reuse2"].get("save_chunks", 0) < counters["kvtier_cpu"]["save_chunks"]
    scheduled: dict[int, int] = {}
    for line in counts.read_text().splitlines():
        row = json.loads(line)
        for n in row.get("step", {}).values():
            scheduled[row["pid"]] = scheduled.get(row["pid"], 0) + int(n)
    for mode, pid in settings["pids"].items():
        raw = data["raw"][mode]
        prompt_computed = sum(r["prompt"] - r["cached"] for r in raw)
        assert scheduled[pid] == prompt_computed + requests * (outputs - 1), mode


@pytest.mark.timeout(600)  # the engines start in subprocesses; pytest's 300 s default is too tight on a loaded machine
def test_bench_vllm_hybrid_quick_run_hits_the_state_and_kv_from_kvtier(workdir: Path) -> None:
    """``kvtier bench vllm --hybrid --quick``: Qwen3-Next, kvtier cpu with vLLM's prefix cache emptied before every
    request. Hits stop at the last 160-token state boundary, and the engine computes only the rest."""
    from kvtier.bench.vllm_engine import HYBRID_CHUNK, SUFFIX

    out = workdir / "vllm_engine_hybrid.json"
    counts = workdir / "counts.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "vllm", "--hybrid", "--quick", "--modes", "none",
                           "kvtier_cpu", "--json", str(out), "--no-plot"],
                          env={**engine_env(workdir), **counts_env(counts)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    body = json.loads(out.read_text())
    assert body["raw"]["kvtier_cpu"]["prefix_cache_resets_failed"] == 0  # every hit is kvtier's
    computed = {n for _, n in computed_tokens(counts)}
    for length, rows in body["results"].items():
        hit = (int(length) + SUFFIX - 1) // HYBRID_CHUNK * HYBRID_CHUNK
        assert rows["none"]["cached_tokens"] == 0
        assert rows["kvtier_cpu"]["cached_tokens"] == hit
        assert rows["kvtier_cpu"]["same_first_token_as_none"] is True
        assert int(length) + SUFFIX - hit in computed, sorted(computed)


@pytest.mark.timeout(600)  # the engines start in subprocesses; pytest's 300 s default is too tight on a loaded machine
def test_bench_vllm_contention_quick_run_loads_beside_a_decoding_batch(workdir: Path) -> None:
    """``kvtier bench vllm-contention --quick``: requests that load their prefix from disk join a decoding batch.
    Their loads were in flight while the batch decoded (steps counted during loads); they hit their whole
    prefix, and the engine computed only their 16 new tokens (its own count), which no recompute does; their
    tokens equal those of the engine without kvtier, which prefilled them."""
    from kvtier.bench.vllm_contention import SUFFIX

    out = workdir / "vllm_contention.json"
    counts = workdir / "counts.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "vllm-contention", "--quick", "--modes", "none",
                           "kvtier_disk", "--json", str(out), "--no-plot"],
                          env={**engine_env(workdir), **counts_env(counts)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    settings, rows = data["settings"], data["results"]
    assert data["same_tokens"] == {"none": True, "kvtier_disk": True}
    assert rows["kvtier_disk"]["loaders_hit_whole_prefix"] is True
    assert all(c == settings["length"] for r in data["raw"]["kvtier_disk"] for c in r["cached"])
    assert all(c == 0 for r in data["raw"]["none"] for c in r["cached"])
    disk = rows["kvtier_disk"]
    assert all(r["copy_step_s"] is not None for r in data["raw"]["kvtier_disk"])  # a step reported loads finished
    assert disk["delayed_steps_per_round"] >= disk["during_steps_per_round"] + 2  # + the copy and suffix steps
    assert rows["none"]["copy_step_s"] is None and rows["none"]["load_thread_s"]["max"] == 0  # no kvtier there
    loaded = 2 * (settings["rounds"] + 1) * settings["loaders"]  # with the batch and alone, warm-up round too
    assert sum(1 for _, n in computed_tokens(counts) if n == SUFFIX) >= loaded
