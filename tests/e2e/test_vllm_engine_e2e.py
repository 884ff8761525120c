"""kvtier inside vLLM's CPU engine running real (tiny, random-weight) models: a second engine process gets the
first one's KV from each tier, and its greedy tokens and logprobs are those of vLLM's own prefix cache."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CHUNK,
    EngineRunner,
    assert_hit,
    assert_uncached,
    close_output,
    computed_tokens,
    counts_env,
    disk_config,
    engine_env,
    kvtier_yaml,
    prompts,
    same_output,
    save_then_load,
)

HIT = 4 * CHUNK  # A2 shares 260 tokens with A: four whole chunks


def test_llama_second_engine_hits_from_disk_with_the_prefix_caches_output(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    ref = references("llama")
    config = disk_config(workdir)
    first, second = save_then_load(run_engine, models("llama"), config)
    assert_uncached(first["phases"][0][0], prompts()["A"])
    assert first["kvtier"]["save_chunks"] == 4 and not first["kvtier"]["disabled"]
    out = second["phases"][0][0]
    assert_hit(out, prompts()["A2"], HIT)  # the engine computed only the 34 tokens after the loaded prefix
    assert second["kvtier"]["hits_disk"] == 4 and second["kvtier"].get("load_failures", 0) == 0
    assert same_output(out, ref["A2_prefix_cached"])
    assert close_output(out, ref["A2"])


def test_llama_second_engine_hits_from_redis(run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
                                             references: Callable[[str], dict[str, Any]], workdir: Path,
                                             redis_factory: Any) -> None:
    server = redis_factory()
    config = kvtier_yaml(workdir / "kvtier.yaml",
                         f"[{{name: redis, kind: redis, capacity: 256MiB, url: '{server.url}', timeout: 1s}}]")
    _, second = save_then_load(run_engine, models("llama"), config)
    out = second["phases"][0][0]
    assert_hit(out, prompts()["A2"], HIT)
    assert second["kvtier"]["hits_redis"] == 4
    assert same_output(out, references("llama")["A2_prefix_cached"])


def test_hybrid_sliding_window_model_hits_in_both_groups(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    """Gemma-3 text: sliding-window (64) layers and full-attention layers, two KV-cache groups."""
    config = disk_config(workdir)
    _, second = save_then_load(run_engine, models("gemma3"), config)
    out, totals = second["phases"][0][0], second["kvtier"]
    assert_hit(out, prompts()["A2"], HIT)
    # vLLM makes one full-attention group and three sliding-window groups (one layer each); a sliding-window
    # group needs only the chunk its 64-token window reaches, the full group all four
    loads = sorted(v for k, v in totals.items() if k.startswith("load_chunks_group"))
    assert loads == [1, 1, 1, 4], totals
    assert same_output(out, references("gemma3")["A2_prefix_cached"])


def amx() -> bool:
    """Whether this CPU has AMX tiles, as vLLM's CPU platform asks it."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("backend", [None, "CPU_MLA"])
def test_mla_model_hits_where_the_engine_can_prefill_after_a_cached_prefix(
        backend: str | None, run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[..., dict[str, Any]], workdir: Path) -> None:
    """DeepSeek-V2-shaped multi-head latent attention (one latent vector per token), bf16. With AMX vLLM runs its
    AMX MLA backend, which computes on a cached prefix: kvtier hits. Without AMX (forced here with the CPU_MLA
    backend, vLLM's choice on such CPUs) the reference backend cannot, vLLM turns prefix caching and chunked prefill
    off, and kvtier loads and saves nothing: the output is the uncached one, bit for bit."""
    chosen = "AMX_MLA" if backend is None and amx() else "CPU_MLA"
    config = disk_config(workdir)
    first, second = save_then_load(run_engine, models("deepseek_v2"), config, backend=backend)
    out = second["phases"][0][0]
    assert f"Using {chosen} backend" in second["log"]
    if chosen == "AMX_MLA":
        assert_hit(out, prompts()["A2"], HIT)
        assert second["kvtier"]["hits_disk"] == 4
        assert same_output(out, references("deepseek_v2")["A2_prefix_cached"])
    else:
        assert "kvtier loads and saves nothing in this engine" in first["log"]
        assert first["kvtier"].get("save_chunks", 0) == 0 and not list((workdir / "kv").rglob("*.kvt"))
        assert_uncached(out, prompts()["A2"])
        assert second["kvtier"].get("load_chunks", 0) == 0
        assert same_output(out, references("deepseek_v2", backend, prefix=False)["A2"])


def test_multi_connector_with_a_legacy_child_hits(run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
                                                  references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    config = disk_config(workdir)
    first, second = save_then_load(run_engine, models("llama"), config, connector="multi")
    out = second["phases"][0][0]
    assert_hit(out, prompts()["A2"], HIT)
    assert second["kvtier"]["hits_disk"] == 4
    assert same_output(out, references("llama")["A2_prefix_cached"])
    # the two-argument child ran in both engines' worker processes (its scheduler half lives in the engine core)
    assert {"start_load_kv", "wait_for_save"} <= set(first["legacy_calls"])
    assert "Connector LegacyCountingConnector uses the deprecated two-argument constructor" in first["log"]


def test_multiprocess_engine_hits_from_disk(run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
                                            references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    """vLLM's default: the engine core (scheduler and worker) in a child process."""
    config = disk_config(workdir)
    _, second = save_then_load(run_engine, models("llama"), config, multiprocessing=True)
    out = second["phases"][0][0]
    assert_hit(out, prompts()["A2"], HIT)  # counted in the engine-core process
    assert same_output(out, references("llama")["A2_prefix_cached"])


def test_redis_killed_mid_run_requests_complete_with_identical_outputs(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[[str], dict[str, Any]], workdir: Path, redis_factory: Any) -> None:
    server = redis_factory()
    config = kvtier_yaml(workdir / "kvtier.yaml",
                         f"[{{name: redis, kind: redis, capacity: 256MiB, url: '{server.url}'}}]")
    model, dtype = models("llama")
    p = prompts()
    assert server.proc is not None
    # one engine process: vLLM's prefix cache off (by choice) so that later phases ask kvtier
    result = run_engine({"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": config,
                         "extra": {"serve_without_prefix_caching": True},
                         "phases": [[p["A"]], [p["A2"], p["B"]], [p["A2"]]],
                         "kill": {"after_phase": 0, "pid": server.proc.pid}})
    assert server.proc.wait(timeout=10) == -signal.SIGKILL  # the engine process killed it after phase 0
    ref = references("llama")
    after_kill = result["phases"][1]
    assert close_output(after_kill[0], ref["A2"]) and close_output(after_kill[1], ref["B"])
    assert close_output(result["phases"][2][0], ref["A2"])
    assert after_kill[0]["computed"] == len(p["A2"]) - after_kill[0]["num_cached_tokens"]  # nothing claimed lost
    assert max(result["timings"]["phase_s"][1:]) < 60


def _disk_records(root: Path) -> dict[str, Path]:
    return {f.name: f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".")}


def test_negative_controls_a_record_under_the_wrong_key_is_refused_a_forged_one_changes_the_output(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    """Engine 1 saves A's and B's chunks. (1) B's record files moved over A's: kvtier refuses them (their header
    names B's keys), recomputes, and the output is the uncached one. (2) B's KV re-encoded as valid records under
    A's keys (what a hash collision would look like): kvtier loads it and the output changes, which shows the
    outputs above depend on the loaded KV."""
    from kvtier.records import codec
    from kvtier.records.keys import chunk_keys
    from kvtier.tiers.disk.index import Layout

    kv = workdir / "kv"
    config = kvtier_yaml(workdir / "kvtier.yaml", f"[{{name: disk, kind: disk, capacity: 256MiB, path: {kv}}}]")
    model, dtype = models("llama")
    p = prompts()
    spec = {"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": config, "prefix_caching": True}
    run_engine({**spec, "phases": [[p["A"]], [p["B"]]]})
    spaces = [bytes.fromhex(d.name) for d in kv.iterdir() if d.is_dir() and len(d.name) == 32]
    assert len(spaces) == 1
    layout = Layout(str(kv), 2)
    a_keys = chunk_keys(spaces[0], p["A"], CHUNK)[:4]
    b_keys = chunk_keys(spaces[0], p["B"], CHUNK)[:4]
    assert all(os.path.exists(layout.path(k)) for k in a_keys + b_keys)
    originals = {k: Path(layout.path(k)).read_bytes() for k in a_keys}

    for a, b in zip(a_keys, b_keys, strict=True):
        Path(layout.path(a)).write_bytes(Path(layout.path(b)).read_bytes())
    moved = run_engine({**spec, "phases": [[p["A2"]]]})["phases"][0][0]
    assert_uncached(moved, p["A2"])
    assert close_output(moved, references("llama")["A2"])

    for a, b in zip(a_keys, b_keys, strict=True):
        record = codec.decode(Path(layout.path(b)).read_bytes(), expected_key=b)
        Path(layout.path(a)).write_bytes(codec.encode_bytes(a, record.payload, record.header.dtype,
                                                            record.header.shape))
    forged = run_engine({**spec, "phases": [[p["A2"]]]})["phases"][0][0]
    assert_hit(forged, p["A2"], HIT)
    assert forged["tokens"] != references("llama")["A2"]["tokens"]

    for a in a_keys:  # and A's own records restored: the hit gives the right output again
        Path(layout.path(a)).write_bytes(originals[a])
    restored = run_engine({**spec, "phases": [[p["A2"]]]})["phases"][0][0]
    assert_hit(restored, p["A2"], HIT)
    assert same_output(restored, references("llama")["A2_prefix_cached"])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
    return result


def test_openai_server_second_completion_hits_from_kvtier(models: Callable[[str], tuple[str, str]],
                                                          references: Callable[[str], dict[str, Any]],
                                                          workdir: Path) -> None:
    """``vllm serve`` (the OpenAI server, started as every benchmark and the demo start it:
    kvtier.ops.vllm_server) with kvtier and vLLM's prefix cache off (by choice, so kvtier's config says
    ``serve_without_prefix_caching``): two HTTP completions sharing a 260-token prefix; the second one's prompt
    comes 256 tokens from kvtier."""
    from kvtier.ops.vllm_server import ServerSpec, kvtier_transfer, running

    model, dtype = models("llama")
    counts = workdir / "counts.jsonl"
    spec = ServerSpec(model, 0, max_model_len=1024, dtype=dtype, prefix_caching=False,
                      transfer=kvtier_transfer(disk_config(workdir), serve_without_prefix_caching=True),
                      extra_args=["--enable-prompt-tokens-details", "--return-tokens-as-token-ids"],
                      # computing on both cores, as the reference engines do: float32 sums in another thread
                      # layout give other logprobs (the servers of the benchmarks reserve a core: CPU_LAYOUT)
                      env={**engine_env(workdir), **counts_env(counts), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    with running(spec, workdir / "server.log", timeout_s=300) as server:
        p = prompts()
        body = {"model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        first = _post(f"{server.url}/v1/completions", {**body, "logprobs": 1, "prompt": p["A"]})
        time.sleep(1.0)  # the first request's chunks are visible once its saves are done
        second = _post(f"{server.url}/v1/completions", {**body, "logprobs": 1, "prompt": p["A2"]})
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        cores = server.worker_cores()
    assert cores == sorted(os.sched_getaffinity(0)), cores  # every core, as the reference engines compute on
    assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == HIT
    ref = references("llama")["A2_prefix_cached"]
    assert second["choices"][0]["token_ids"] == ref["tokens"]
    assert second["choices"][0]["logprobs"]["token_logprobs"] == ref["logprobs"]  # bit-identical
    # the engine computed A whole, then only A2's 34 tokens after the loaded prefix (8 tokens out: 7 decode steps)
    assert [n for _, n in computed_tokens(counts)] == [len(p["A"]) + 7, len(p["A2"]) - HIT + 7]
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:prompt_tokens_cached_by_source_total{")]
    by_source = {line.split('source="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    assert by_source.get("disk") == HIT and sum(by_source.values()) == HIT, lines  # where the hit came from


def test_weights_replaced_at_the_same_path_never_get_the_old_kv(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[..., dict[str, Any]], workdir: Path) -> None:
    """Engine 1 saves A with weights W1 at path P; W2 (same config, other values) is copied over P, as a redeploy
    into the same directory does. A new engine at P gets no hit and answers as W2 does uncached. Control: with W1
    still at P the same engine hits."""
    import shutil

    w1, dtype = models("llama")
    w2, _ = models("llama_w2")
    path = workdir / "model"
    shutil.copytree(w1, path)
    p = prompts()
    spec = {"model": str(path), "dtype": dtype, "connector": "kvtier", "kvtier_config": disk_config(workdir),
            "prefix_caching": True}
    assert run_engine({**spec, "phases": [[p["A"]]]})["kvtier"]["save_chunks"] == 4
    assert_hit(run_engine({**spec, "phases": [[p["A2"]]]})["phases"][0][0], p["A2"], HIT)  # control: same weights
    for weights in Path(w2).glob("*.safetensors"):
        shutil.copyfile(weights, path / weights.name)
    swapped = run_engine({**spec, "phases": [[p["A2"]]]})
    out = swapped["phases"][0][0]
    assert_uncached(out, p["A2"])
    assert swapped["kvtier"].get("load_chunks", 0) == 0
    new_uncached = references("llama_w2", prefix=False)["A2"]
    assert same_output(out, new_uncached)
    assert new_uncached["tokens"] != references("llama")["A2"]["tokens"]  # W1's KV would have shown
