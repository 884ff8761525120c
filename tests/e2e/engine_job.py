"""One engine process for the end-to-end tests: real vLLM (CPU build) running a tiny model, with or without kvtier.

    python engine_job.py SPEC.json OUT.json

SPEC (JSON): ``model`` (directory), ``connector`` (null, "kvtier" or "multi": KVTierMultiConnector with kvtier
and a two-argument legacy child), ``kvtier_config`` (YAML path), ``extra`` (more kv_connector_extra_config),
``prefix_caching`` (vLLM's own), ``phases`` (lists of prompts, each list one ``LLM.generate`` call), ``kill``
(``{"after_phase": i, "pid": p}``: SIGKILL a process between phases), ``pause_s`` (seconds the engine stays idle
before each phase after the first), ``max_tokens``, ``dtype``, ``max_model_len``, ``num_blocks`` (the engine's KV
memory, in blocks),
``attention_backend`` (vLLM's, e.g. "CPU_MLA").

OUT (JSON): per phase and prompt the greedy tokens, their logprobs (exact floats), ``num_cached_tokens``; the
kvtier worker's counters since start (``kvtier``, and with ``phase_counters`` after each phase, ``kvtier_phases``;
in-process engines only), the legacy child's calls, timings.
Runs under the ``__main__`` guard: vLLM may spawn processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()


def kvtier_totals(connector: Any) -> dict[str, float] | None:
    if connector is None:
        return None
    children = getattr(connector, "sub_connectors", None)
    if children is not None:  # KVTierMultiConnector: kvtier is the first child
        connector = children[0]
    worker = getattr(connector, "_worker", None)
    if worker is None:
        return None
    worker.flush()  # saves are written in the background: count them once they are done
    return {**worker.totals(), "disabled": worker.disabled is not None}


HYBRID_BLOCK = {"qwen3_next": 160}  # the block size the hybrid tests' chunks and references are written for


def hybrid_blocks(model: str) -> dict[str, int]:
    """The block size of a hybrid model, set rather than left to vLLM: the size vLLM picks to fit the recurrent
    state's page depends on the CPU's attention backend (160 tokens on some machines, 96 on others)."""
    config = Path(model) / "config.json"
    kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return {"block_size": HYBRID_BLOCK[kind]} if kind in HYBRID_BLOCK else {}


def engine_args(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``LLM`` arguments for a job spec: the tiny model with the settings of every benchmark engine
    (kvtier.bench.vllm_driver.llm_kwargs), and kvtier (alone or chained) when it asks."""
    from kvtier.bench.vllm_driver import llm_kwargs

    kw = llm_kwargs({**spec, "max_model_len": spec.get("max_model_len", 1024)}, max_num_seqs=8,
                    enable_prefix_caching=bool(spec.get("prefix_caching", False)), **hybrid_blocks(spec["model"]))
    if spec.get("num_blocks"):  # the engine's KV memory in blocks: a small one evicts
        kw["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("attention_backend"):
        kw["attention_backend"] = spec["attention_backend"]
    extra = {"config_file": spec["kvtier_config"], **spec.get("extra", {})} if spec.get("kvtier_config") else {}
    kvtier = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if spec.get("connector") == "kvtier":
        kw["kv_transfer_config"] = kvtier
    elif spec.get("connector") == "multi":
        legacy = {"kv_connector": "LegacyCountingConnector", "kv_connector_module_path": "legacy_child",
                  "kv_role": "kv_both"}
        kw["kv_transfer_config"] = {"kv_connector": "KVTierMultiConnector",
                                    "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"connectors": [kvtier, legacy]}}
    return kw


def run_phases(llm: Any, spec: dict[str, Any]) -> tuple[list[list[dict[str, Any]]], list[float], list[Any]]:
    """Each phase's prompts, greedy: tokens, logprobs and vLLM's count of cached tokens per prompt; the time of
    each phase, and with ``phase_counters`` the kvtier worker's counters after each (in-process engines only)."""
    from vllm import SamplingParams

    from kvtier.bench.vllm_inproc import worker_connector

    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=1, ignore_eos=True,
                            detokenize=False)
    phases: list[list[dict[str, Any]]] = []
    phase_s: list[float] = []
    counters: list[Any] = []
    kill = spec.get("kill")
    for i, prompts in enumerate(spec["phases"]):
        if i:
            time.sleep(spec.get("pause_s", 0))
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        phase_s.append(time.perf_counter() - t)
        results = []
        for out in outs:
            completion = out.outputs[0]
            logprobs = [d[tok].logprob for tok, d in zip(completion.token_ids, completion.logprobs or [], strict=True)]
            results.append({"tokens": list(completion.token_ids), "logprobs": logprobs,
                            "num_cached_tokens": out.num_cached_tokens})
        phases.append(results)
        if spec.get("phase_counters"):  # flushes the phase's saves first
            counters.append(kvtier_totals(worker_connector()))
        if kill and kill["after_phase"] == i:
            os.kill(int(kill["pid"]), signal.SIGKILL)
    return phases, phase_s, counters


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM

    from kvtier.bench.vllm_inproc import worker_connector

    t = time.perf_counter()
    llm = LLM(**engine_args(spec))
    engine_s = time.perf_counter() - t
    phases, phase_s, counters = run_phases(llm, spec)
    connector = worker_connector()
    legacy_calls = None
    if spec.get("connector") == "multi" and connector is not None:
        legacy_calls = sorted({name for name, *_ in connector.sub_connectors[1].calls})
    result = {"phases": phases, "kvtier": kvtier_totals(connector), "kvtier_phases": counters,
              "legacy_calls": legacy_calls,
              "timings": {"engine_s": engine_s, "phase_s": phase_s, "process_s": time.perf_counter() - T0}}
    with open(out_path, "w") as f:
        json.dump(result, f)
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
