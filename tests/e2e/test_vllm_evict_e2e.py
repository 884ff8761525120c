"""Saves on eviction (``policy.save_at: evict``, with the default learned admission) in vLLM's CPU engine: with KV memory for one prompt, a prompt
computed and then pushed out of vLLM's prefix cache by another is saved as its blocks are taken, and hit from
kvtier's cpu tier when it comes back, with the output of vLLM's own prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import EngineRunner, assert_hit, assert_uncached, kvtier_yaml, prompts, same_output


def test_a_prompt_pushed_out_of_the_engines_cache_is_saved_as_it_leaves_and_hits_from_kvtier(
        run_engine: EngineRunner, models: Callable[[str], tuple[str, str]],
        references: Callable[[str], dict[str, Any]], workdir: Path) -> None:
    model, dtype = models("llama")
    config = kvtier_yaml(workdir / "kvtier.yaml", "[{name: cpu, kind: cpu, capacity: 64MiB}]",
                         policy={"save_at": "evict"})
    p = prompts()
    # 12 blocks of 32 tokens (the null block among them): B's 288 tokens take A's blocks but its first two
    out = run_engine({"model": model, "dtype": dtype, "connector": "kvtier", "kvtier_config": config,
                      "prefix_caching": True, "max_model_len": 320, "num_blocks": 12, "phase_counters": True,
                      "phases": [[p["A"]], [p["B"]], [p["A2"]]]})
    assert_uncached(out["phases"][0][0], p["A"])
    assert out["kvtier_phases"][0]["save_chunks"] == 0  # A computed: its 4 chunks held, none saved
    assert_uncached(out["phases"][1][0], p["B"])
    assert out["kvtier_phases"][1]["save_chunks"] >= 3  # B took A's blocks: saved as they left
    a2 = out["phases"][2][0]
    assert_hit(a2, p["A2"], 256)  # the engine computed only the 34 tokens past A's 4 chunks
    assert out["kvtier"]["hits_cpu"] >= 2  # at most A's first chunk was left in vLLM's cache
    assert out["kvtier"].get("load_failures", 0) == 0
    assert same_output(a2, references("llama")["A2_prefix_cached"])
