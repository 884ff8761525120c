"""Time to first token on the reference engine, no cache against hits from each tier: ``kvtier bench ttft``.

One engine per mode, all with the same model and cache shape: ``none`` (no connector: full prefill) and one
KVTierConnector per tier (``cpu``, ``gpu`` on whatever device is available, ``disk``, ``disk_cold``: the same
disk tier with the page cache of its files dropped before each request, ``redis``: a private
``redis-server`` on a free loopback port). For each prompt length a fixed prompt is run once per tier mode
to store its chunks; then rounds interleave every length and mode (A B C ... A B C ...), each a fresh request
with that prompt, and the engine's TTFT (arrival -> first sampled token) is recorded. Each result carries the
median and spread over the rounds, the tokens restored from the tier, the speed-up over ``none`` and whether
the first token equals the one computed without a cache.

The hit covers whole chunks and leaves at least one token to compute, so with ``--chunk-size 64`` a
2048-token prompt restores 1984 tokens and computes 64.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.bench.measure import Spread, default_device, drop_page_cache, save_results
from kvtier.bench.output import add_output_arguments, figure
from kvtier.bench.redis_servers import redis_server
from kvtier.ops.argtypes import names_from, positive_int, positive_ints

ALL_MODES = ("none", "cpu", "gpu", "disk", "disk_cold", "redis")


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...] = (512, 1024, 2048)
    repeats: int = 5
    modes: tuple[str, ...] = ALL_MODES
    chunk_size: int = 64
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    head_size: int = 64
    device: str | None = None  # of the gpu tier; None: cuda when available, else cpu


QUICK = Settings(lengths=(128, 256), repeats=2, layers=2, heads=4, kv_heads=2, head_size=16)


def model_config(s: Settings) -> Any:
    from kvtier.engine.model import ModelConfig

    return ModelConfig(vocab_size=512, num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.kv_heads,
                       head_size=s.head_size, intermediate_size=4 * s.heads * s.head_size,
                       max_model_len=max(s.lengths) + 16)


def engine_args(s: Settings) -> Any:
    from kvtier.engine.core import EngineArgs

    top = max(s.lengths) + 16
    return EngineArgs(model=model_config(s), block_size=16, num_blocks=top // 16 + 16, max_num_batched_tokens=top)


def tier_section(mode: str, s: Settings, tmp: Path, redis_url: str, capacity: int) -> Any:
    from kvtier.config import CpuTierConfig, DiskTierConfig, GpuTierConfig, RedisTierConfig

    if mode == "cpu":
        return CpuTierConfig(mode, capacity)
    if mode == "gpu":
        return GpuTierConfig(mode, capacity, device=s.device or default_device())
    if mode in ("disk", "disk_cold"):
        return DiskTierConfig(mode, capacity, path=str(tmp / mode))
    if mode == "redis":
        return RedisTierConfig(mode, capacity, url=redis_url, timeout=5.0, connect_timeout=5.0)
    raise ValueError(f"unknown mode {mode!r}; known: {', '.join(ALL_MODES)}")


def kv_bytes(s: Settings) -> int:
    """KV bytes of every prompt (float32 K and V of every layer), with slack: the tier capacity."""
    per_token = 2 * s.layers * s.kv_heads * s.head_size * 4
    return 4 * per_token * sum(s.lengths) + (64 << 20)


@contextmanager
def engines(s: Settings) -> Iterator[dict[str, Any]]:
    """One engine per mode (tiers started, Redis server running); everything closed after."""
    from kvtier.config import KvtierConfig, NamespaceConfig, PolicyConfig, WritePolicy
    from kvtier.engine.core import Engine

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-ttft-")))
        url = stack.enter_context(redis_server()) if "redis" in s.modes else ""
        built: dict[str, Any] = {}
        try:
            for mode in s.modes:
                connector = None
                if mode != "none":
                    cfg = KvtierConfig(chunk_size=s.chunk_size, namespace=NamespaceConfig(model=f"ttft-{mode}"),
                                       tiers=(tier_section(mode, s, tmp, url, kv_bytes(s)),),
                                       policy=PolicyConfig(eviction="lru", write=WritePolicy.WRITE_THROUGH))
                    connector = pair(cfg)
                built[mode] = Engine(engine_args(s), connector=connector)
            yield built
        finally:
            for engine in built.values():
                engine.close()


def pair(cfg: Any) -> Any:
    """Both connector halves over one started store (``KVTierPair``; older engines: ``kvtier_connector``)."""
    from kvtier.engine import core

    build = getattr(core, "KVTierPair", None) or getattr(core, "kvtier_connector")  # noqa: B009
    return build(cfg)


def prompt(length: int) -> tuple[int, ...]:
    rng = random.Random(length)
    return tuple(rng.randrange(1, 512) for _ in range(length))


def drop_dir_cache(root: Path) -> None:
    """Drop the page cache of every file under ``root``."""
    drop_page_cache([os.path.join(d, f) for d, _, files in os.walk(root) for f in files])


def one_request(engine: Any, request_id: str, tokens: Sequence[int]) -> Any:
    from kvtier.engine.core import RequestSpec

    return engine.run([RequestSpec(request_id, tuple(tokens), 1)])[request_id]


def measure(s: Settings, progress: bool = True) -> list[dict[str, Any]]:
    """Seed every tier, then interleaved rounds over lengths and modes; one record per (length, mode)."""
    samples: dict[tuple[int, str], list[Any]] = {(n, m): [] for n in s.lengths for m in s.modes}
    with engines(s) as built:
        for mode, engine in built.items():
            for n in s.lengths:  # warm-up round, and the store that later requests hit
                one_request(engine, f"seed-{mode}-{n}", prompt(n))
        for r in range(s.repeats):
            if progress:
                print(f"ttft: round {r + 1}/{s.repeats}", flush=True)
            for n in s.lengths:
                for mode, engine in built.items():
                    if mode == "disk_cold":
                        drop_dir_cache(_disk_root(engine))
                    samples[(n, mode)].append(one_request(engine, f"r{r}-{mode}-{n}", prompt(n)))
    return [summarize(n, mode, samples, s) for n in s.lengths for mode in s.modes]


def _disk_root(engine: Any) -> Path:
    """The disk tier's directory of an engine's connector config."""
    conn = engine.worker_connector
    return Path(conn.kvtier_config.tiers[0].path)


def summarize(n: int, mode: str, samples: dict[tuple[int, str], list[Any]], s: Settings) -> dict[str, Any]:
    """Median TTFT and spread, restored tokens, speed-up over no cache, first-token agreement."""
    reqs = samples[(n, mode)]
    ttft = Spread.of([r.ttft for r in reqs])
    base = samples.get((n, "none"))
    first = {r.output_token_ids[0] for r in reqs if r.output_token_ids}
    ref = {r.output_token_ids[0] for r in base if r.output_token_ids} if base else set()
    rec: dict[str, Any] = {
        "prompt_tokens": n, "mode": mode, "ttft_s": ttft.as_dict(),
        "hit_tokens": int(Spread.of([r.external_tokens for r in reqs]).median),
        "computed_tokens": int(Spread.of([r.prefill_computed for r in reqs]).median),
        "speedup_vs_none": round(Spread.of([r.ttft for r in base]).median / ttft.median, 3) if base else None,
        "same_first_token": (first == ref) if ref else None,
    }
    return rec


def table(results: Sequence[dict[str, Any]]) -> str:
    head = f"{'tokens':>7} {'mode':<10} {'TTFT ms':>9} {'[min-max]':>17} {'hit tok':>8} {'speed-up':>9} same"
    lines = [head, "-" * len(head)]
    for r in results:
        t = r["ttft_s"]
        up = r["speedup_vs_none"]
        lines.append(f"{r['prompt_tokens']:>7} {r['mode']:<10} {1e3 * t['median']:>9.1f} "
                     f"[{1e3 * t['min']:>7.1f}-{1e3 * t['max']:>7.1f}] {r['hit_tokens']:>8} "
                     f"{'-' if up is None else f'{up:.2f}x':>9} {r['same_first_token']}")
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Grouped bars: median TTFT per prompt length, one bar per mode (min-max whiskers)."""
    lengths = sorted({r["prompt_tokens"] for r in results})
    modes = list(dict.fromkeys(r["mode"] for r in results))
    by = {(r["prompt_tokens"], r["mode"]): r["ttft_s"] for r in results}
    width = 0.8 / len(modes)
    with figure(path, dpi=90, figsize=(10, 4.5)) as (_, ax):
        for j, mode in enumerate(modes):
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(lengths))]
            med = [1e3 * by[(n, mode)]["median"] for n in lengths]
            err = [[1e3 * (by[(n, mode)]["median"] - by[(n, mode)]["min"]) for n in lengths],
                   [1e3 * (by[(n, mode)]["max"] - by[(n, mode)]["median"]) for n in lengths]]
            ax.bar(xs, med, width, yerr=err, capsize=2, label=mode)
        ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
        ax.set_ylabel("time to first token (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of kvtier bench ttft."""
    parser.add_argument("--quick", action="store_true", help="tiny model, short prompts, 2 rounds (CI smoke)")
    parser.add_argument("--lengths", type=positive_ints, help="comma list of prompt lengths (default 512,1024,2048)")
    parser.add_argument("--modes", type=names_from(ALL_MODES), help=f"comma list of {', '.join(ALL_MODES)}")
    parser.add_argument("--repeats", type=positive_int, help="measured rounds (default 5)")
    parser.add_argument("--chunk-size", type=positive_int, help="kvtier chunk size in tokens (default 64)")
    add_output_arguments(parser, "ttft")


def run(args: argparse.Namespace) -> int:
    """Measure, print a table, write JSON (and PNG)."""
    s = QUICK if args.quick else Settings()
    if args.lengths:
        s = replace(s, lengths=args.lengths)
    if args.modes:
        s = replace(s, modes=args.modes)
    if args.repeats:
        s = replace(s, repeats=args.repeats)
    if args.chunk_size:
        s = replace(s, chunk_size=args.chunk_size)
    results = measure(s)
    print(table(results))
    title = f"reference engine TTFT by cache tier ({'ttft-quick' if args.quick else 'ttft'})"
    save_results(args, "ttft", {"settings": vars(s), "model": vars(model_config(s)), "results": results},
                 lambda png: plot(results, png, title))
    return 0
