"""``kvtier demo``: a multi-turn chat workload through the reference engine, without and with kvtier.

Runs on the embedded default config (or ``--config``) on any machine: no GPU, no server. The disk tier goes to
a temporary directory unless ``--persist``. Prints per-tier hit rates, prefill tokens saved and time to first
token (median, p90) with and without the cache, and checks that both runs generated the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from kvtier.config import DiskTierConfig, KvtierConfig, TierKind, load_config
from kvtier.config_parse import format_size, parse_size
from kvtier.engine.core import Engine, EngineArgs, KVTierPair
from kvtier.engine.model import ModelConfig
from kvtier.engine.scheduler import EngineRequest
from kvtier.engine.workload import ChatSpec, chat_conversations, run_chat
from kvtier.errors import KvtierError
from kvtier.metrics import hits_key
from kvtier.progress import progress_bar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvtier demo``."""
    parser.add_argument("--config", help="kvtier YAML config (default: the embedded default: cpu + disk)")
    parser.add_argument("--users", type=int, default=8, help="concurrent chat users (default 8)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    parser.add_argument("--system-tokens", type=int, default=160, help="shared system prompt length")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens generated per reply")
    parser.add_argument("--chunk-size", type=int, default=32,
                        help="tokens per stored chunk (default 32: the tiny model's prompts are short)")
    parser.add_argument("--window", type=int, default=64,
                        help="sliding window of every other layer (hybrid model); 0: full attention only")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-capacity",
                        help="capacity of the memory tiers (cpu, gpu); default: 1MiB with the embedded config (the "
                             "tiny model's KV is small: chunks then spill to disk), the file's sizes with --config")
    parser.add_argument("--persist", action="store_true",
                        help="keep the disk tier where the config puts it (default: a temporary directory)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class PhaseResult:
    """One pass of the workload."""

    requests: list[EngineRequest]
    seconds: float
    stats: dict[str, Any]

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.requests if r.ttft is not None]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvtier demo``; exit code 0 when both runs agree, 1 otherwise, 2 on a config error."""
    try:
        with ExitStack() as stack:
            cfg = _config(args, stack)
            return _demo(args, cfg)
    except KvtierError as exc:
        print(f"kvtier demo: {exc}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace, stack: ExitStack) -> KvtierConfig:
    """The config with the demo's chunk size and, unless ``--persist``, every disk tier in a temp dir."""
    cfg = load_config(args.config, overrides={"chunk_size": args.chunk_size})
    memory = args.memory_capacity or (None if args.config else "1MiB")
    if memory is not None:
        size = parse_size(memory, "--memory-capacity")
        cfg = dataclasses.replace(cfg, tiers=tuple(
            dataclasses.replace(t, capacity=size) if t.kind in (TierKind.CPU, TierKind.GPU) else t
            for t in cfg.tiers))
    if args.persist:
        return cfg
    root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-"))
    tiers = tuple(dataclasses.replace(t, path=f"{root}/{t.name}") if isinstance(t, DiskTierConfig) else t
                  for t in cfg.tiers)
    return dataclasses.replace(cfg, tiers=tiers)


def _demo(args: argparse.Namespace, cfg: KvtierConfig) -> int:
    spec = ChatSpec(users=args.users, turns=args.turns, system_tokens=args.system_tokens,
                    max_tokens=args.max_tokens, seed=args.seed)
    window = args.window or None
    model = ModelConfig(sliding_window=window, dtype=args.dtype,
                        max_model_len=max(1024, -(-spec.max_prompt_len() // 128) * 128))
    engine_args = EngineArgs(model=model, num_blocks=_blocks_needed(spec, args.users), max_num_seqs=args.users)
    tiers = ", ".join(f"{t.name} ({t.kind}, {format_size(t.capacity)})" for t in cfg.tiers)
    print(f"kvtier demo: {args.users} users x {args.turns} turns, tiny {model.num_layers}-layer model "
          f"({'hybrid, window ' + str(window) if window else 'full attention'}, {model.dtype}), "
          f"chunk {cfg.chunk_size} tokens, tiers: {tiers}, write policy {cfg.policy.write}")
    base = _phase("without cache", Engine(engine_args), spec, model, args.no_progress)
    cached = _phase("with kvtier", Engine(engine_args, KVTierPair(cfg)), spec, model, args.no_progress)
    same = _same_outputs(base.requests, cached.requests)
    _report(base, cached, cfg, same)
    return 0 if same else 1


def _blocks_needed(spec: ChatSpec, users: int) -> int:
    per_request = -(-spec.max_prompt_len() // 16) * 2  # two groups at most
    return max(256, per_request * users // 2)


def _phase(title: str, engine: Engine, spec: ChatSpec, model: ModelConfig, quiet: bool) -> PhaseResult:
    convs = chat_conversations(spec, model.vocab_size)
    try:
        start = time.perf_counter()
        with progress_bar(spec.users * spec.turns, desc=f"{title:>14}", unit="turn", enabled=not quiet) as update:
            done = run_chat(engine, convs, lambda _req: update(1))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return PhaseResult(done, seconds, dict(engine.stats.data))


def _same_outputs(a: list[EngineRequest], b: list[EngineRequest]) -> bool:
    other = {r.request_id: r.output_token_ids for r in b}
    return all(other.get(r.request_id) == r.output_token_ids for r in a) and len(a) == len(b)


def _quantiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    if len(values) == 1:
        return values[0], values[0]
    return statistics.median(values), statistics.quantiles(values, n=10, method="inclusive")[-1]


def _report(base: PhaseResult, cached: PhaseResult, cfg: KvtierConfig, same: bool) -> None:
    prompt = sum(r.num_prompt_tokens for r in cached.requests)
    saved = sum(r.external_tokens for r in cached.requests)
    hits = {t.name: float(cached.stats.get(hits_key(t.name), 0)) for t in cfg.tiers}
    total_hits = sum(hits.values()) or 1.0
    print(f"\nprefill tokens saved: {saved} of {prompt} prompt tokens ({100 * saved / max(prompt, 1):.1f}%)")
    print("hit rate by tier (share of prompt tokens loaded from it):")
    for name, n in hits.items():
        print(f"  {name:<8} {100 * saved / max(prompt, 1) * n / total_hits:6.1f}%   ({int(n)} chunk loads)")
    (b50, b90), (c50, c90) = _quantiles(base.ttfts()), _quantiles(cached.ttfts())
    print("time to first token      median      p90")
    print(f"  without cache       {1000 * b50:8.1f} ms {1000 * b90:8.1f} ms")
    print(f"  with kvtier         {1000 * c50:8.1f} ms {1000 * c90:8.1f} ms   "
          f"({b50 / c50 if c50 else 0:.2f}x median)")
    print(f"wall time: {base.seconds:.1f} s without, {cached.seconds:.1f} s with the cache")
    print(f"outputs identical with and without the cache: {'yes' if same else 'NO'}")
