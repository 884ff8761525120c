"""kvtier demo: a multi-turn chat workload through the reference engine, without and with kvtier; with
``--engine vllm``, through vLLM's OpenAI server, alone, with kvtier and restarted (kvtier.ops.demo_vllm).

Runs on the embedded default config (or --config) on any machine: no GPU; no server unless --engine vllm. The
disk tier goes to a temporary directory unless --persist (then where the config puts it, or under --persist DIR).
Prints where the disk tier lives and the overrides applied, then per-tier hit rates, prefill tokens saved and
time to first token (median, p90) with and without the cache, and checks that both runs generated the same
tokens.

Exit code 0 when both runs agree, 1 when they differ, 2 on a bad option, config or disk path.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import ENV_RESERVED, MEMORY_KINDS, SECTIONS, DiskTierConfig, KvtierConfig, load_config
from kvtier.config.layers import env_layer
from kvtier.config.parse import format_size
from kvtier.control.metrics import hits_key
from kvtier.errors import ConfigError, KvtierError
from kvtier.ops.argtypes import non_negative_int, positive_int, positive_size
from kvtier.ops.progress import loading, note, progress_bar

if TYPE_CHECKING:
    from kvtier.engine.core import Engine, EngineArgs
    from kvtier.engine.model import ModelConfig
    from kvtier.engine.scheduler import EngineRequest
    from kvtier.engine.workload import ChatSpec

PROG = "kvtier demo"
P90_NOTE = ("p90 is the first turns and the requests queued behind them: nothing to reuse yet, and with kvtier "
            "they also save what they compute, so p90 can be worse with the cache while the median is better")
TIMING_NOTE = ("same --seed, same prompts and generated tokens; hits, tokens saved and times depend on timing "
               "(when background writes land, machine load) and vary run to run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of kvtier demo."""
    parser.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                        help="reference: kvtier's in-process engine (default); vllm: vLLM's OpenAI server (vLLM's "
                             "CPU build in .venv-e2e, or vLLM on a GPU), three servers in turn")
    parser.add_argument("--config", help="kvtier YAML config (default: the embedded default: cpu + disk)")
    parser.add_argument("--users", type=positive_int, default=8, help="concurrent chat users (default 8)")
    parser.add_argument("--turns", type=positive_int, default=4, help="turns per conversation (default 4)")
    parser.add_argument("--system-tokens", type=non_negative_int, default=160,
                        help="shared system prompt length (default 160)")
    parser.add_argument("--max-tokens", type=positive_int, default=12, help="tokens generated per reply (default 12)")
    parser.add_argument("--chunk-size", type=positive_int, default=32,
                        help="tokens per stored chunk (default 32: the tiny model's prompts are short)")
    parser.add_argument("--window", type=non_negative_int, default=64,
                        help="sliding window of every other layer (hybrid model); 0: full attention only")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompts (default 0)")
    parser.add_argument("--memory-capacity", type=positive_size,
                        help="capacity of the memory tiers (cpu, gpu); default with the embedded config: 1MiB, "
                             "16MiB with --engine vllm (smaller than the chats: chunks then spill to disk); the "
                             "file's sizes with --config")
    parser.add_argument("--persist", nargs="?", const="", default=None, metavar="DIR",
                        help="keep the disk tier: under DIR, or where the config puts it when no DIR is given "
                             "(default: a temporary directory, removed at exit)")
    parser.add_argument("--repeats", type=positive_int,
                        help="runs of each mode, taking turns (without, with, with, without, ...), each cached run "
                             "on an empty cache: the figures are medians with their spread (default 5; 1 with "
                             "--persist, whose cache one run keeps and a later run reuses; the reference engine "
                             "only)")
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
    """Entry point of kvtier demo; exit code 0 when both runs agree, 1 otherwise, 2 on a config error."""
    try:
        with ExitStack() as stack:
            cfg, applied, root = _config(args, stack)
            check_disk_paths(cfg)
            if args.engine == "vllm":
                return _vllm_demo(args, cfg, applied, root)
            return _demo(args, cfg, applied)
    except KvtierError as exc:
        print(f"kvtier: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace, stack: ExitStack) -> tuple[KvtierConfig, list[str], str | None]:
    """The config with the demo's chunk size and memory capacity, every disk tier in a temp dir unless
    --persist (under DIR with --persist DIR); the overrides applied, in words; and that directory (None: the
    config's own paths, with --persist alone)."""
    cfg = load_config(args.config, overrides={"chunk_size": args.chunk_size})
    applied = [f"chunk_size {cfg.chunk_size} (--chunk-size)"]
    if cfg.namespace.model != "default":  # records are labelled with the model that ran: the tiny one
        applied.append(f"namespace.model: the reference engine's tiny model, not {cfg.namespace.model!r}")
        cfg = dataclasses.replace(cfg, namespace=dataclasses.replace(cfg.namespace, model="default"))
    default = (16 if args.engine == "vllm" else 1) * 1024**2
    memory = args.memory_capacity if args.memory_capacity is not None else (None if args.config else default)
    if memory is not None:
        tiers = tuple(dataclasses.replace(t, capacity=memory) if t.kind in MEMORY_KINDS else t
                      for t in cfg.tiers)
        names = ", ".join(t.name for t in cfg.tiers if t.kind in MEMORY_KINDS)
        if names:
            cfg = dataclasses.replace(cfg, tiers=tiers)
            origin = "--memory-capacity" if args.memory_capacity is not None else "the demo's default"
            applied.append(f"{names} capacity {format_size(memory)} ({origin})")
    env = [var for var, _, _ in env_layer(os.environ, SECTIONS, ENV_RESERVED)]
    env += [var for var in ("KVTIER_CACHE_DIR",) + (() if args.config else ("KVTIER_CONFIG",)) if os.environ.get(var)]
    if env:
        applied.append("environment: " + ", ".join(sorted(env)))
    if args.persist == "":
        return cfg, applied, None
    root = args.persist or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-"))
    return _disks_under(cfg, root), applied, root


def _own_tenant(cfg: KvtierConfig, run: str, repeat: int) -> KvtierConfig:
    """``cfg`` under a tenant of this demo ``run`` and repeat's own: a shared tier (Redis) holds none of the records
    of earlier repeats or runs under its keys."""
    tenant = f"{cfg.namespace.tenant}/demo-{run}-repeat-{repeat}"
    return dataclasses.replace(cfg, namespace=dataclasses.replace(cfg.namespace, tenant=tenant))


def _disks_under(cfg: KvtierConfig, root: str) -> KvtierConfig:
    """``cfg`` with each disk tier's directory at ``root``/its name."""
    return dataclasses.replace(cfg, tiers=tuple(
        dataclasses.replace(t, path=os.path.join(root, t.name)) if isinstance(t, DiskTierConfig) else t
        for t in cfg.tiers))


def check_disk_paths(cfg: KvtierConfig) -> None:
    """Create every disk tier's directory and a file in it, now: a ConfigError naming tiers[i].path and the
    fix when that fails (a path under a file, a read-only directory or file system)."""
    fix = "give a writable directory with --persist DIR, or change the config"
    for i, tier in enumerate(cfg.tiers):
        if not isinstance(tier, DiskTierConfig):
            continue
        path = Path(tier.path)
        near = path
        while not near.exists() and near != near.parent:
            near = near.parent
        if not near.is_dir():
            raise ConfigError(f"tiers[{i}].path", f"cannot create {path}: {near} is a file, not a directory", fix)
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".kvtier-demo-probe-", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(f"tiers[{i}].path", f"cannot write {path}: {exc.strerror or exc}", fix) from None


def _describe(cfg: KvtierConfig, applied: list[str], temporary: bool) -> None:
    for tier in cfg.tiers:
        if isinstance(tier, DiskTierConfig):
            where = "temporary, removed at exit; --persist keeps it" if temporary else "kept"
            print(f"{PROG}: disk tier {tier.name!r} at {tier.path} ({where})")
    print(f"{PROG}: overrides applied: {'; '.join(applied)}", flush=True)


def _vllm_demo(args: argparse.Namespace, cfg: KvtierConfig, applied: list[str], root: str | None) -> int:
    """``--engine vllm``: the model, the servers' logs and vLLM's cache go beside the disk tiers (a temporary
    directory unless --persist)."""
    from kvtier.ops.demo_vllm import BLOCK, demo

    if not any(t.kind.value == "disk" for t in cfg.tiers):
        raise ConfigError("tiers", "the vLLM demo restarts the server and loads from disk: the config has no disk "
                          "tier", "add one, or leave out --config for the embedded default (cpu + disk)")
    if cfg.chunk_size % BLOCK:
        raise ConfigError("--chunk-size", f"{cfg.chunk_size} is not a multiple of the vLLM demo's block size "
                          f"({BLOCK} tokens)", f"use {BLOCK} or a multiple")
    with ExitStack() as stack:
        work = Path(root or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-vllm-")))
        _describe(cfg, applied, temporary=args.persist is None)
        return demo(args, cfg, work)


def _demo(args: argparse.Namespace, cfg: KvtierConfig, applied: list[str]) -> int:
    with loading(PROG, "torch"):
        from kvtier.engine.core import EngineArgs
        from kvtier.engine.model import ModelConfig
        from kvtier.engine.workload import ChatSpec

    spec = ChatSpec(users=args.users, turns=args.turns, system_tokens=args.system_tokens,
                    max_tokens=args.max_tokens, seed=args.seed)
    window = args.window or None
    model = ModelConfig(sliding_window=window, dtype=args.dtype,
                        max_model_len=max(1024, -(-spec.max_prompt_len() // 128) * 128))
    engine_args = EngineArgs(model=model, num_blocks=_blocks_needed(spec, args.users), max_num_seqs=args.users)
    _check_fit(cfg, engine_args)
    tiers = ", ".join(f"{t.name} ({t.kind}, {format_size(t.capacity)})" for t in cfg.tiers)
    print(f"{PROG}: {args.users} users x {args.turns} turns, tiny {model.num_layers}-layer model "
          f"({'hybrid, window ' + str(window) if window else 'full attention'}, {model.dtype}), "
          f"chunk {cfg.chunk_size} tokens, tiers: {tiers}, write policy {cfg.policy.write}")
    _describe(cfg, applied, temporary=args.persist is None)
    pairs = _pairs(args, engine_args, cfg, spec, model)
    same = all(_same_outputs(pairs[0][0].requests, r.requests) for pair in pairs for r in pair)
    _report(pairs, cfg, same)
    return 0 if same else 1


def _pairs(args: argparse.Namespace, engine_args: EngineArgs, cfg: KvtierConfig, spec: ChatSpec,
           model: ModelConfig) -> list[tuple[PhaseResult, PhaseResult]]:
    """``--repeats`` (without, with) pairs, the order turned every other repeat so that neither mode always runs
    on a warmer machine; each cached run on an empty cache: the first on the config's disk tiers, the others on
    temporary ones, and each (unless --persist) under a tenant of its own in a shared tier."""
    from kvtier.engine.core import Engine

    memory = sum(t.capacity for t in cfg.tiers if t.kind in MEMORY_KINDS)
    note(f"{PROG}: each run with kvtier opens the cache tiers ({format_size(memory)} of memory)")
    pairs = []
    repeats = args.repeats or (1 if args.persist is not None else 5)
    run = secrets.token_hex(4)
    with ExitStack() as scratch:
        for repeat in range(repeats):
            run_cfg = cfg if repeat == 0 else _disks_under(
                cfg, scratch.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-demo-repeat-")))
            if args.persist is None:  # --persist keeps its one run's records under the config's own tenant
                run_cfg = _own_tenant(run_cfg, run, repeat)
            of = f" {repeat + 1}/{repeats}" if repeats > 1 else ""
            done = {}
            for cached in (False, True) if repeat % 2 == 0 else (True, False):
                engine = _cached_engine(engine_args, run_cfg) if cached else Engine(engine_args)
                title = f"{'with kvtier' if cached else 'without cache'}{of}"
                done[cached] = _phase(title, engine, spec, model, args.no_progress)
            pairs.append((done[False], done[True]))
    return pairs


def _check_fit(cfg: KvtierConfig, engine_args: EngineArgs) -> None:
    """Refuse, as kvtier check does, a config the engine's KV layout cannot use (a chunk size that is not a
    multiple of the block size): the connector would disable itself and the demo compare nothing."""
    from kvtier.engine.kv_cache import build_kv_cache_config
    from kvtier.records.fit import check_fit

    check_fit(cfg, build_kv_cache_config(engine_args.model, engine_args.block_size, engine_args.num_blocks))


def _cached_engine(engine_args: EngineArgs, cfg: KvtierConfig) -> Engine:
    """The engine with kvtier; a disk path that fails at start is a ConfigError naming it."""
    from kvtier.engine.core import Engine, KVTierPair

    try:
        return Engine(engine_args, KVTierPair(cfg))
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        where = exc.filename or ", ".join(str(t.path) for t in cfg.tiers if isinstance(t, DiskTierConfig))
        raise ConfigError("", f"cannot use {where}: {exc.strerror or exc}",
                          "give a writable directory with --persist DIR, or change the config") from None


def _blocks_needed(spec: ChatSpec, users: int) -> int:
    per_request = -(-spec.max_prompt_len() // 16) * 2  # two groups at most
    return max(256, per_request * users // 2)


def _phase(title: str, engine: Engine, spec: ChatSpec, model: ModelConfig, quiet: bool) -> PhaseResult:
    from kvtier.engine.workload import chat_conversations, run_chat

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


def output_digest(requests: list[EngineRequest]) -> str:
    """A short digest of every request's generated tokens, in request id order (fixed by the seed)."""
    h = hashlib.sha256()
    for req in sorted(requests, key=lambda r: r.request_id):
        h.update(f"{req.request_id}:{','.join(map(str, req.output_token_ids))};".encode())
    return h.hexdigest()[:12]


def _quantiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    if len(values) == 1:
        return values[0], values[0]
    return statistics.median(values), statistics.quantiles(values, n=10, method="inclusive")[-1]


def _saved(run: PhaseResult) -> int:
    return sum(r.external_tokens for r in run.requests)


def _report(pairs: list[tuple[PhaseResult, PhaseResult]], cfg: KvtierConfig, same: bool) -> None:
    """Tokens saved and hits by tier of the median cached run; times to first token over every run, and the
    median with its range of each pair's ratio; whether every run generated the same tokens."""
    cached = sorted((pair[1] for pair in pairs), key=_saved)[len(pairs) // 2]
    prompt, saved = sum(r.num_prompt_tokens for r in cached.requests), _saved(cached)
    share = 100 * saved / max(prompt, 1)
    spread = [100 * _saved(c) / max(prompt, 1) for _, c in pairs]
    runs = f"; median of {len(pairs)} runs, {min(spread):.1f}-{max(spread):.1f}%" if len(pairs) > 1 else ""
    print(f"\nprefill tokens saved: {saved} of {prompt} prompt tokens ({share:.1f}%{runs})")
    hits = {t.name: float(cached.stats.get(hits_key(t.name), 0)) for t in cfg.tiers}
    total_hits = sum(hits.values()) or 1.0
    print("hit rate by tier (share of prompt tokens loaded from it):")
    for name, n in hits.items():
        print(f"  {name:<8} {share * n / total_hits:6.1f}%   ({int(n)} chunk loads)")
    base_all = [t for b, _ in pairs for t in b.ttfts()]
    cached_all = [t for _, c in pairs for t in c.ttfts()]
    (b50, b90), (c50, c90) = _quantiles(base_all), _quantiles(cached_all)
    ratios = sorted(_quantiles(b.ttfts())[0] / m for b, c in pairs if (m := _quantiles(c.ttfts())[0]))
    print(f"time to first token      median      p90   (every request of the {len(pairs)} run(s) of each mode)")
    print(f"  without cache       {1000 * b50:8.1f} ms {1000 * b90:8.1f} ms")
    print(f"  with kvtier         {1000 * c50:8.1f} ms {1000 * c90:8.1f} ms")
    if ratios:
        print(f"  kvtier's median: {statistics.median(ratios):.2f}x the speed without cache, median of {len(ratios)} "
              f"paired runs ({ratios[0]:.2f}-{ratios[-1]:.2f}x)")
    print(P90_NOTE)
    print(f"wall time: {sum(b.seconds for b, _ in pairs):.1f} s without, {sum(c.seconds for _, c in pairs):.1f} s "
          "with the cache")
    first = pairs[0][0].requests
    generated = sum(len(r.output_token_ids) for r in first)
    print(f"generated tokens: {generated} (digest {output_digest(first)})")
    print(f"outputs identical with and without the cache: {'yes' if same else 'NO'}")
    print(TIMING_NOTE)
