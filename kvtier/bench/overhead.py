"""Scheduler-side cost of kvtier when nothing is reused: ``kvtier bench overhead``.

Every request pays for hashing its prompt into chunk keys and for one directory lookup, even when the cache
holds nothing useful. This benchmark measures, per prompt length (median over repeats, with spreads):

* ``hash``: ``kvtier.records.keys.chunk_keys`` of the prompt (a Python list of token ids, as engines hold it):
  microseconds per request and per 1k tokens, tokens/s and GB/s of int32 token ids;
* ``lookup``: ``Directory.lookup`` against an empty directory and against one holding ``--populated``
  unrelated chunks (cold for this request);
* ``connector``: ``TieredConnector.get_num_new_matched_tokens`` (scheduler role, cpu + disk tiers) on a
  miss-only workload: the whole per-request scheduler cost, keys included;

and sets the total beside the prefill it rides on: the reference engine's measured prefill of the same
prompt (a tiny CPU model, so an upper bound of the share) and an assumed GPU prefill rate
(``--gpu-prefill-tps``, default 50,000 tokens/s: deliberately fast for an 8B model on one GPU, so the share
printed is again an upper bound).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.bench.measure import Spread, interleave, save_results
from kvtier.bench.output import add_output_arguments
from kvtier.ops.argtypes import positive_float, positive_int, positive_ints

CHUNK = 256


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 16384, 65536)
    repeats: int = 11
    calls: int = 50  # calls timed together per repeat (microsecond operations)
    populated: int = 100_000
    engine_max_len: int = 2048  # prompt lengths above this are not prefilled on the reference engine
    gpu_prefill_tps: float = 50_000.0
    chunk_size: int = CHUNK


QUICK = Settings(lengths=(512, 2048), repeats=2, calls=5, populated=1000, engine_max_len=512)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` random prompts (distinct, so every lookup misses)."""
    rng = random.Random(seed)
    return [[rng.randrange(128_000) for _ in range(length)] for _ in range(n)]


def per_call(fn: Callable[[list[int]], object], inputs: Sequence[list[int]]) -> Callable[[], float]:
    """A run for :func:`interleave`: seconds per call of ``fn`` over all ``inputs``."""
    def run() -> float:
        t0 = time.perf_counter()
        for x in inputs:
            fn(x)
        return (time.perf_counter() - t0) / len(inputs)
    return run


def scale(spread: Spread, factor: float) -> dict[str, float]:
    """A spread's fields multiplied by ``factor`` (seconds -> microseconds, per 1k tokens, ...)."""
    return {k: (round(v * factor, 4) if k != "n" else v) for k, v in asdict(spread).items()}


def directory_with(populated: int) -> Any:
    """A directory of a cpu and a disk tier holding ``populated`` unrelated ready chunks in the disk tier."""
    from kvtier.control.directory import Directory, TierSlot
    from kvtier.control.policy import make_policy

    d = Directory([TierSlot("cpu", 1 << 40, make_policy("lru")), TierSlot("disk", 1 << 50, make_policy("lru"))])
    if populated:
        rng = random.Random(1)
        d.adopt("disk", ((rng.randbytes(32), 1 << 20) for _ in range(populated)))
    return d


def connector(tmp: Path) -> Any:
    """A scheduler-role TieredConnector over a cpu and a disk tier (Llama-3.1-8B-shaped layout)."""
    from kvtier.config import CpuTierConfig, DiskTierConfig, KvtierConfig, NamespaceConfig
    from kvtier.connector.base import KVConnectorRole
    from kvtier.connector.tiered import TieredConnector
    from kvtier.layout import simple_config

    cfg = KvtierConfig(chunk_size=CHUNK, namespace=NamespaceConfig(model="bench/llama-3.1-8b"),
                       tiers=(CpuTierConfig("cpu", 1 << 30), DiskTierConfig("disk", 1 << 34, path=str(tmp))))
    return TieredConnector.from_config(cfg, KVConnectorRole.SCHEDULER, simple_config(32, 8, 128, "bfloat16"))


def engine_prefill(lengths: Sequence[int], repeats: int) -> dict[int, Spread]:
    """Reference-engine time to first token (prefill + 1 token) with no connector, per prompt length."""
    from kvtier.engine.core import Engine, EngineArgs, RequestSpec
    from kvtier.engine.model import ModelConfig

    out: dict[int, Spread] = {}
    if not lengths:
        return out
    top = max(lengths)
    args = EngineArgs(model=ModelConfig(max_model_len=top + 16), num_blocks=(top + 16) // 16 + 8,
                      max_num_batched_tokens=top)
    engine = Engine(args)
    try:
        for length in lengths:
            samples = []
            for r, prompt in enumerate(prompts(repeats + 1, length, seed=length)):
                req = engine.run([RequestSpec(f"p{length}-{r}", tuple(t % 512 for t in prompt), 1)])
                ttft = req[f"p{length}-{r}"].ttft
                if r and ttft is not None:  # the first one warms up
                    samples.append(ttft)
            out[length] = Spread.of(samples)
    finally:
        engine.close()
    return out


def measure(settings: Settings, progress: bool = True) -> list[dict[str, Any]]:
    """Every figure for every prompt length."""
    from kvtier.records.keys import Namespace

    ns = Namespace(model="bench").digest()
    empty, full = directory_with(0), directory_with(settings.populated)
    prefill = engine_prefill([n for n in settings.lengths if n <= settings.engine_max_len], settings.repeats)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-overhead-") as tmp:
        conn = connector(Path(tmp))
        try:
            for length in settings.lengths:
                if progress:
                    print(f"overhead: {length} tokens", flush=True)
                spreads = measure_length(settings, length, ns, conn, empty, full)
                results.append(summarize(length, spreads, prefill.get(length), settings))
        finally:
            conn.shutdown()
    return results


def measure_length(s: Settings, length: int, ns: bytes, conn: Any, empty: Any, full: Any) -> dict[str, Spread]:
    """Seconds per request of hashing, lookups (empty and populated directory) and the connector's miss,
    interleaved round by round."""
    from kvtier.engine.types import Request
    from kvtier.records.keys import chunk_keys

    inputs = prompts(s.calls, length, seed=length)
    keys = [chunk_keys(ns, p, s.chunk_size) for p in inputs]
    positions = [[i] for i in range(len(inputs))]
    tiers = ["cpu", "disk"]
    ids = iter(range(10**9))

    def matched(p: list[int]) -> object:
        req = Request(f"q{next(ids)}", p)
        got = conn.get_num_new_matched_tokens(req, 0)
        conn.request_finished(req, [])
        return got

    runs = {
        "hash": per_call(lambda p: chunk_keys(ns, p, s.chunk_size), inputs),
        "lookup_empty": per_call(lambda i: empty.lookup(keys[i[0]], tiers), positions),
        "lookup_populated": per_call(lambda i: full.lookup(keys[i[0]], tiers), positions),
        "connector_miss": per_call(matched, inputs),
    }
    return {name: Spread.of(v) for name, v in interleave(runs, s.repeats).items()}


def summarize(length: int, spreads: dict[str, Spread], prefill: Spread | None, s: Settings) -> dict[str, Any]:
    """One result record: microseconds per request and per 1k tokens, hashing rate, share of prefill."""
    hashing = spreads["hash"].median
    total = spreads["connector_miss"].median
    gpu_prefill = length / s.gpu_prefill_tps
    rec: dict[str, Any] = {
        "prompt_tokens": length, "chunk_tokens": s.chunk_size,
        "us_per_request": {k: scale(v, 1e6) for k, v in spreads.items()},
        "us_per_1k_tokens": {k: scale(v, 1e6 * 1000 / length) for k, v in spreads.items()},
        "hash_tokens_per_s": round(length / hashing),
        "hash_gbps_token_ids": round(4 * length / hashing / 1e9, 4),
        "gpu_prefill_s_assumed": gpu_prefill,
        "pct_of_gpu_prefill": round(100 * total / gpu_prefill, 4),
        "engine_prefill_s": prefill.as_dict() if prefill is not None else None,
        "pct_of_engine_prefill": round(100 * total / prefill.median, 4) if prefill is not None else None,
    }
    return rec


def table(results: Sequence[dict[str, Any]]) -> str:
    head = (f"{'tokens':>7} {'hash us':>9} {'lookup us':>10} {'conn us':>9} {'(min)':>7} {'us/1k tok':>10} "
            f"{'hash Mtok/s':>11} {'hash GB/s':>9} {'% GPU prefill':>13} {'% ref prefill':>13}")
    lines = [head, "-" * len(head)]
    for r in results:
        us = r["us_per_request"]
        ref = r["pct_of_engine_prefill"]
        lines.append(f"{r['prompt_tokens']:>7} {us['hash']['median']:>9.1f} {us['lookup_empty']['median']:>10.2f} "
                     f"{us['connector_miss']['median']:>9.1f} {us['connector_miss']['min']:>7.1f} "
                     f"{r['us_per_1k_tokens']['connector_miss']['median']:>10.2f} "
                     f"{r['hash_tokens_per_s'] / 1e6:>11.2f} {r['hash_gbps_token_ids']:>9.3f} "
                     f"{r['pct_of_gpu_prefill']:>12.3f}% {'-' if ref is None else f'{ref:.4f}%':>13}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of kvtier bench overhead."""
    parser.add_argument("--quick", action="store_true", help="two short prompt lengths, 2 repeats (CI smoke)")
    parser.add_argument("--lengths", type=positive_ints,
                        help="comma list of prompt lengths in tokens (default 1024,2048,4096,16384,65536)")
    parser.add_argument("--repeats", type=positive_int, help="repeats per figure (default 11)")
    parser.add_argument("--gpu-prefill-tps", type=positive_float,
                        help="assumed GPU prefill rate, tokens/s (default 50000)")
    add_output_arguments(parser, "overhead", chart=False)


def run(args: argparse.Namespace) -> int:
    """Measure, print a table, write JSON."""
    s = QUICK if args.quick else Settings()
    if args.lengths:
        s = replace(s, lengths=args.lengths)
    if args.repeats:
        s = replace(s, repeats=args.repeats)
    if args.gpu_prefill_tps:
        s = replace(s, gpu_prefill_tps=args.gpu_prefill_tps)
    results = measure(s)
    print(table(results))
    save_results(args, "overhead", {"settings": vars(s), "results": results})
    return 0
