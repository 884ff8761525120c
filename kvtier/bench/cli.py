"""Benchmarks: kvtier bench NAME [options]; kvtier bench NAME --help for each one's options.

Results go to ./benchmarks/results (./kvtier-results with --quick; or --out DIR) as JSON, with a chart where
the benchmark draws one; the run ends with a line naming the files. The vllm benchmarks need vLLM's CPU build:
run them with .venv-e2e/bin/python -m kvtier bench ... (made by bash scripts/bootstrap.sh --vllm --e2e).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier.ops.cli import KvtierParser

BENCHMARKS: dict[str, tuple[str, str]] = {
    "hit-rate": ("kvtier.bench.hitrate_cli", "token hit rate of each eviction policy on a trace or workload"),
    "throughput": ("kvtier.bench.throughput", "store/load GB/s of each tier beside the raw limit of its medium"),
    "ttft": ("kvtier.bench.ttft", "time to first token on the reference engine, no cache vs each tier"),
    "overhead": ("kvtier.bench.overhead", "scheduler-side cost per request when nothing is reused"),
    "vllm": ("kvtier.bench.vllm_engine", "TTFT and throughput of vLLM's CPU engine: no cache, its prefix cache, "
             "kvtier from each tier"),
    "vllm-overhead": ("kvtier.bench.vllm_overhead", "cost of an active kvtier on requests that never hit, in "
                      "vLLM's CPU engine"),
    "vllm-contention": ("kvtier.bench.vllm_contention", "async kvtier loads beside a decoding batch in vLLM's CPU "
                        "engine: its step time with and without them"),
    "vllm-replay": ("kvtier.bench.vllm_replay", "a real trace through vLLM's CPU engine with too little KV memory: "
                    "its prefix cache alone vs + kvtier"),
    "serve": ("kvtier.bench.serve", "a trace through vLLM's OpenAI server with concurrent clients: its prefix cache "
              "alone vs + kvtier"),
    "fingerprint": ("kvtier.bench.fingerprint", "start-up cost of the weights fingerprint beside a plain read"),
    "copy": ("kvtier.bench.copy", "the copy of a hit into the engine's blocks beside a plain memory copy"),
}
NEEDS_VLLM_CPU = ("vllm", "vllm-overhead", "vllm-contention", "vllm-replay")  # they start vLLM's CPU engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark name and everything after it, which that benchmark's own parser reads."""
    listing = "\n".join(f"  {name:<11} {text}" for name, (_, text) in BENCHMARKS.items())
    parser.epilog = f"benchmarks:\n{listing}"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), metavar="BENCHMARK",
                        help=f"one of {', '.join(BENCHMARKS)}")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="...", help="options of the benchmark")


def build_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The argument parser of benchmark name and its run function; ImportError when it is unavailable."""
    module_path, text = BENCHMARKS[name]
    module = importlib.import_module(module_path)
    add, run_fn = getattr(module, "add_arguments", None), getattr(module, "run", None)
    if not (callable(add) and callable(run_fn)):
        raise ImportError(f"{module_path} defines no add_arguments(parser) / run(args)")
    parser = KvtierParser(prog=f"kvtier bench {name}", description=module.__doc__ or text,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add(parser)
    return parser, run_fn


def run(args: argparse.Namespace) -> int:
    """Import the chosen benchmark, parse its options, run it."""
    try:
        parser, run_fn = build_parser(args.benchmark)
    except ImportError as exc:
        print(f"kvtier: error: benchmark {args.benchmark!r} is not available ({exc})", file=sys.stderr)
        return 2
    bench_args = parser.parse_args(args.bench_args)
    if args.benchmark in NEEDS_VLLM_CPU:
        from kvtier.bench.vllm_driver import cpu_build_error

        error = cpu_build_error(args.benchmark)
        if error is not None:
            print(f"kvtier: error: {error}", file=sys.stderr)
            return 2
    from kvtier.bench.output import check_writable

    check_writable(bench_args)
    return int(run_fn(bench_args))  # type: ignore[operator]
