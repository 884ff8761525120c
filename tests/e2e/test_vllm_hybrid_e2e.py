"""A hybrid model with linear-attention (gated delta-net) layers in vLLM's CPU engine: Qwen3-Next, tiny, random
weights. With prefix caching on, vLLM runs ``mamba_cache_mode="align"``: 160-token blocks in the attention group and
the three recurrent-state groups alike, a state kept at each block-aligned step end, handed to kvtier as a boundary
offer. A2 shares 260 tokens with A: the last state boundary inside them is 160, one chunk of 160 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EngineRunner,
    assert_hit,
    assert_uncached,
    disk_config,
    kvtier_yaml,
    prompts,
    same_output,
    save_then_load,
)

CHUNK = 160  # vLLM's block size for this model in align mode: kvtier's chunks must end on state boundaries
HIT = 160


def config_for(tier: str, workdir: Path, redis_factory: Any) -> str:
    if tier == "disk":
        return disk_config(workdir, chunk_size=CHUNK)
    server = redis_factory()
    return kvtier_yaml(workdir / "kvtier.yaml",
                       f"[{{name: redis, kind: redis, capacity: 256MiB, url: '{server.url}', timeout: 1s}}]",
                       chunk_size=CHUNK)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_new_engine_hits_the_recurrent_state_and_the_kv_with_the_prefix_caches_output(
        tier: str, run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[..., dict[str, Any]], workdir: Path, redis_factory: Any) -> None:
    first, second = save_then_load(run_engine, models("qwen3_next"), config_for(tier, workdir, redis_factory))
    assert_uncached(first["phases"][0][0], prompts()["A"])
    # one attention chunk and the state at 160 of each of the three state groups (offered by vLLM)
    assert first["kvtier"]["save_chunks"] == 4 and not first["kvtier"]["disabled"]
    out = second["phases"][0][0]
    assert_hit(out, prompts()["A2"], HIT)  # the engine computed only the 130 tokens after the loaded state
    loads = sorted(v for k, v in second["kvtier"].items() if k.startswith("load_chunks_group"))
    assert loads == [1, 1, 1, 1] and second["kvtier"][f"hits_{tier}"] == 4, second["kvtier"]
    assert second["kvtier"].get("load_failures", 0) == 0
    assert same_output(out, references("qwen3_next")["A2_prefix_cached"])


def test_a_forged_state_changes_the_output_so_the_loaded_state_is_used(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[..., dict[str, Any]], workdir: Path) -> None:
    """Engine 1 saves A's and B's records. B's recurrent states re-encoded as valid records under A's keys (A's
    attention KV kept): the hit still loads, and the output changes; A's own states restored: right again."""
    from kvtier.records import codec
    from kvtier.records.keys import chunk_keys
    from kvtier.tiers.disk.index import Layout

    kv = workdir / "kv"
    model, dtype = models("qwen3_next")
    p = prompts()
    spec = {"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": disk_config(workdir, CHUNK),
            "prefix_caching": True}
    run_engine({**spec, "phases": [[p["A"]], [p["B"]]]})
    spaces = [bytes.fromhex(d.name) for d in kv.iterdir() if d.is_dir() and len(d.name) == 32]
    assert len(spaces) == 4  # one namespace per KV-cache group
    layout = Layout(str(kv), 2)
    states: dict[Path, bytes] = {}
    for space in spaces:
        a, b = chunk_keys(space, p["A"], CHUNK)[0], chunk_keys(space, p["B"], CHUNK)[0]
        record = codec.decode(Path(layout.path(b)).read_bytes(), expected_key=b)
        if record.header.dtype == "uint8":  # a state group's record: each layer's state bytes at 160 tokens
            states[Path(layout.path(a))] = Path(layout.path(a)).read_bytes()
            Path(layout.path(a)).write_bytes(codec.encode_bytes(a, record.payload, record.header.dtype,
                                                                record.header.shape))
    assert len(states) == 3
    forged = run_engine({**spec, "phases": [[p["A2"]]]})["phases"][0][0]
    assert_hit(forged, p["A2"], HIT)
    assert forged["logprobs"] != references("qwen3_next")["A2_prefix_cached"]["logprobs"]
    for path, original in states.items():
        path.write_bytes(original)
    restored = run_engine({**spec, "phases": [[p["A2"]]]})["phases"][0][0]
    assert_hit(restored, p["A2"], HIT)
    assert same_output(restored, references("qwen3_next")["A2_prefix_cached"])


def test_without_prefix_caching_no_state_is_kept_and_kvtier_serves_without_hits(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[..., dict[str, Any]], workdir: Path) -> None:
    """vLLM keeps one running state per request when prefix caching is off (mamba_cache_mode "none"): no prefix
    of this model can be restored, kvtier says so once, stores nothing, and the output is the uncached one."""
    model, dtype = models("qwen3_next")
    config = kvtier_yaml(workdir / "kvtier.yaml", f"[{{name: disk, kind: disk, capacity: 256MiB, path: {workdir}/kv}}]",
                         chunk_size=CHUNK, serve_without_prefix_caching=True)
    spec = {"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": config, "prefix_caching": False}
    first = run_engine({**spec, "phases": [[prompts()["A"]]]})
    assert "mamba_cache_mode='none'" in first["log"]
    assert first["kvtier"].get("save_chunks", 0) == 0
    second = run_engine({**spec, "phases": [[prompts()["A2"]]]})
    out = second["phases"][0][0]
    assert_uncached(out, prompts()["A2"])
    assert same_output(out, references("qwen3_next", prefix=False)["A2"])


def test_a_corrupt_record_of_a_hybrid_is_recomputed_not_a_crash(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[..., dict[str, Any]], workdir: Path) -> None:
    """vLLM raises on block-level load errors for a model with several KV-cache groups; kvtier reports the failed
    load per request (``failed_recving``): one corrupted byte in A's attention record, and the new engine
    recomputes A2 whole, with the uncached output, and keeps serving."""
    from kvtier.records.keys import chunk_keys
    from kvtier.tiers.disk.index import Layout

    kv = workdir / "kv"
    model, dtype = models("qwen3_next")
    p = prompts()
    spec = {"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": disk_config(workdir, CHUNK),
            "prefix_caching": True}
    run_engine({**spec, "phases": [[p["A"]]]})
    layout = Layout(str(kv), 2)
    records = [Path(layout.path(chunk_keys(bytes.fromhex(d.name), p["A"], CHUNK)[0]))
               for d in kv.iterdir() if d.is_dir() and len(d.name) == 32]
    assert len(records) == 4 and all(r.exists() for r in records)
    for record in records:  # every group's record: whichever the engine reads first fails the request's load
        data = bytearray(record.read_bytes())
        data[-1] ^= 0xFF
        record.write_bytes(bytes(data))
    second = run_engine({**spec, "phases": [[p["A2"]], [p["B"]]]})
    out = second["phases"][0][0]
    assert out["computed"] == len(p["A2"]), out  # recomputed whole after the failed load
    assert second["kvtier"]["load_failures"] >= 1 and second["kvtier"].get("hits_disk", 0) == 0
    assert same_output(out, references("qwen3_next", prefix=False, cache_on=True)["A2"])
    assert same_output(second["phases"][1][0], references("qwen3_next", prefix=False, cache_on=True)["B"])
