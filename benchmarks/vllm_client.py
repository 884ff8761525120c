"""vLLM's own client against vLLM's OpenAI server, with vLLM's prefix cache alone and with kvtier, in one run.

The client is ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; the CPU build's ``vllm`` console script
fails, so its module is called). The server is ``vllm serve`` of a tiny random-weight Llama (float32, with a
word-level tokenizer made on the spot: nothing is downloaded). Three servers, the same engine KV memory but the
ceiling's:

* ``vllm``: vLLM's prefix cache alone, with ``--memory-share`` of the KV the prefixes need (they do not fit);
* ``kvtier``: the same, with kvtier (a cpu tier that holds every prefix, and a disk tier);
* ``ceiling``: vLLM's prefix cache with memory for every prefix: what a tier can at best reach.

Workloads, with ``--temperature 0``:

* ``prefix_repetition``: ``--prefixes`` shared prefixes of ``--prefix-len`` tokens, twice: the first pass untimed
  (it fills the caches), the second timed, so that prefixes the engine evicted come back;
* ``random``: prompts that share nothing, the no-reuse control (what kvtier costs requests it cannot help);
* ``restart``: a new server runs the timed pass of ``prefix_repetition`` again: kvtier's on the same disk
  directory, vLLM's alone with its cache empty.

The modes take turns (the order turns every other repeat), and each reports mean, p50 and p99 TTFT, output
throughput, and where the prompt tokens came from (vLLM's ``/metrics``). Every timed pass of a repeat must give the
same texts, request by request, on every server (float32, greedy: kvtier's loaded KV, vLLM's cached and its
computed KV alike), and kvtier's timed passes must have loaded prompt tokens from kvtier; else the run exits 1.
Writes ``benchmarks/results/vllm_client.json``.

    .venv-e2e/bin/python benchmarks/vllm_client.py [--repeats 2] [--prefixes 12] [--prefix-len 768]
                                                  [--clients 4] [--memory-share 0.4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvtier from this checkout

from benchmarks.script_run import run_checked, unwritable  # noqa: E402
from kvtier.bench.output import machine_info  # noqa: E402
from kvtier.errors import KvtierError  # noqa: E402
from kvtier.ops.argtypes import positive_int  # noqa: E402
from kvtier.ops.cli import KvtierParser  # noqa: E402
from kvtier.ops.demo_vllm import BLOCK, HIDDEN, LAYERS, SERVER_ENV, SOURCES  # noqa: E402  (the demo's model)

CLIENT = ("import json, sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=positive_int, default=2, help="rounds of every mode (the order turns)")
    parser.add_argument("--prefixes", type=positive_int, default=12, help="shared prefixes")
    parser.add_argument("--prefix-len", type=positive_int, default=768, help="tokens of each prefix")
    parser.add_argument("--suffix-len", type=positive_int, default=32, help="tokens after the prefix")
    parser.add_argument("--per-prefix", type=positive_int, default=4, help="prompts per prefix and pass")
    parser.add_argument("--output-len", type=positive_int, default=8, help="tokens generated per prompt")
    parser.add_argument("--clients", type=positive_int, default=4, help="requests in flight (--max-concurrency)")
    parser.add_argument("--memory-share", type=float, default=0.4,
                        help="the engine's KV memory as a share of what the prefixes need (vllm and kvtier)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_client.json")


def engine_blocks(args: argparse.Namespace, share: float) -> tuple[int, int]:
    """(KV blocks, max_model_len) for ``share`` of what every prefix with one suffix and reply holds."""
    prompt = args.prefix_len + args.suffix_len + args.output_len + 2
    max_len = -(-prompt // BLOCK) * BLOCK
    need = args.prefixes * (max_len // BLOCK)
    return max(args.clients * (max_len // BLOCK) + 1, round(share * need)), max_len


def server_spec(args: argparse.Namespace, model: str, work: Path, mode: str) -> Any:
    """The server of a mode (``vllm``, ``kvtier``, ``ceiling``)."""
    from kvtier.ops.vllm_server import ServerSpec, kvtier_transfer

    blocks, max_len = engine_blocks(args, 1.25 if mode == "ceiling" else args.memory_share)
    transfer = kvtier_transfer(str(work / "kvtier.yaml")) if mode == "kvtier" else None
    extra = ["--num-gpu-blocks-override", str(blocks)] + (["--shutdown-timeout", "10"] if transfer else [])
    return ServerSpec(model, 0, block_size=BLOCK, max_model_len=max_len, max_num_seqs=args.clients,
                      transfer=transfer, extra_args=extra, tokenizer=True,
                      env={**SERVER_ENV, "VLLM_CACHE_ROOT": str(work / "vllm-cache")})


def kvtier_config(args: argparse.Namespace, work: Path, disk: Path) -> None:
    """A cpu tier that holds every prefix twice over (float32 KV of the model) and a disk tier in ``disk``."""
    per_token = 2 * LAYERS * HIDDEN * 4
    cpu = 2 * args.prefixes * (args.prefix_len + args.suffix_len) * per_token
    text = (f"chunk_size: {BLOCK}\ntiers:\n  - {{name: cpu, kind: cpu, capacity: {cpu}B}}\n"
            f"  - {{name: disk, kind: disk, capacity: {2 * cpu}B, path: {disk}}}\n")
    (work / "kvtier.yaml").write_text(text)


def client(args: argparse.Namespace, server: Any, model: str, work: Path, workload: str, seed: int,
           tag: str) -> dict[str, Any]:
    """One pass (``tag``) of vLLM's client against ``server``; its result JSON, with each request's text."""
    from kvtier.ops.vllm_server import same_kvtier

    name = f"client-{workload}-{seed}-{server.spec.port}-{tag}.json"
    data = (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
             "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
             str(args.prefixes), "--prefix-repetition-output-len", str(args.output_len)]
            if workload == "prefix_repetition" else
            ["--dataset-name", "random", "--random-input-len", str(args.prefix_len + args.suffix_len),
             "--random-output-len", str(args.output_len)])
    cmd = [sys.executable, "-c", CLIENT, "--backend", "openai", "--host", "127.0.0.1", "--port",
           str(server.spec.port), "--model", model, "--tokenizer", model, *data,
           "--num-prompts", str(args.prefixes * args.per_prefix), "--max-concurrency", str(args.clients),
           "--temperature", "0", "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--save-result",
           "--save-detailed", "--result-dir", str(work), "--result-filename", name,
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99"]
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1200, check=False,
                              env=same_kvtier(dict(os.environ)))
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM's client exited {proc.returncode} ({log}): "
                           f"{log.read_text(errors='replace')[-400:]}")
    return dict(json.loads((work / name).read_text()))


def sources(before: Any, after: Any) -> dict[str, float]:
    from kvtier.ops.vllm_server import metric

    name = "vllm:prompt_tokens_by_source_total"
    return {s: metric(after, name, source=s) - metric(before, name, source=s) for s in SOURCES}


def timed_pass(args: argparse.Namespace, server: Any, model: str, work: Path, workload: str,
               seed: int) -> dict[str, Any]:
    """A timed pass of ``workload``: vLLM's figures and the prompt tokens by source."""
    from kvtier.ops.demo_vllm import settled

    before = settled(server)
    result = client(args, server, model, work, workload, seed, "timed")
    after = settled(server)
    keep = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p90_ttft_ms", "output_throughput",
            "request_throughput", "completed", "duration")
    return {**{k: result.get(k) for k in keep}, "prompt_tokens": sources(before, after),
            "texts": list(result.get("generated_texts") or [])}


def one_server(args: argparse.Namespace, model: str, work: Path, mode: str, repeat: int,
               restarted: bool = False) -> dict[str, dict[str, Any]]:
    """Start a mode's server and run its passes (a restarted one: the timed prefix pass only)."""
    from kvtier.ops.vllm_server import running

    spec = server_spec(args, model, work, mode)
    print(f"vllm_client: repeat {repeat + 1}: {mode}{', restarted' if restarted else ''}", flush=True)
    passes: dict[str, dict[str, Any]] = {}
    with running(spec, work / f"server-{mode}-{repeat}-{int(restarted)}.log", timeout_s=600) as server:
        if not restarted:
            client(args, server, model, work, "prefix_repetition", repeat, "warm")  # untimed: fills the caches
        passes["restart" if restarted else "prefix_repetition"] = timed_pass(args, server, model, work,
                                                                            "prefix_repetition", repeat)
        if not restarted:
            passes["random"] = timed_pass(args, server, model, work, "random", 1000 + repeat)
    return passes


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every repeat's timed passes by workload and mode, and the checks: the same texts on every server, and
    kvtier's passes loading from kvtier."""
    from kvtier.ops.models import add_tokenizer, make_llama

    model = add_tokenizer(make_llama(str(work / "model"), LAYERS, HIDDEN))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    texts: dict[tuple[str, int], list[list[str]]] = {}  # (prompt set, repeat): each timed pass's texts
    modes = ["vllm", "kvtier", "ceiling"]
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            if mode == "kvtier":
                kvtier_config(args, work, work / f"disk-{repeat}")
            for restarted in [False, True] if mode in ("vllm", "kvtier") else [False]:
                for workload, figures in one_server(args, model, work, mode, repeat, restarted).items():
                    prompts = "random" if workload == "random" else "prefix_repetition"  # a restart's are these
                    texts.setdefault((prompts, repeat), []).append(figures.pop("texts"))
                    runs.setdefault(workload, {}).setdefault(mode, []).append(figures)
    same = all(t and all(other == t[0] for other in t) and t[0] for t in texts.values())
    loaded = all(p["prompt_tokens"]["external_kv_transfer"] > 0
                 for workload in ("prefix_repetition", "restart") for p in runs[workload]["kvtier"])
    return {"runs": runs, "same_texts": bool(same), "kvtier_loaded": loaded,
            "texts_compared": sum(len(t) * len(t[0]) for t in texts.values())}


def summary(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Medians over the repeats (the prompt tokens: sums), and the ratios against vLLM's prefix cache alone and
    against the ceiling, in the same workload (a restart: against a restarted vLLM, and no ceiling)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, by_mode in runs.items():
        out[workload] = {}
        for mode, passes in by_mode.items():
            row: dict[str, Any] = {k: statistics.median(p[k] for p in passes) for k in
                                   ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput")}
            row["prompt_tokens"] = {s: sum(p["prompt_tokens"][s] for p in passes) for s in SOURCES}
            out[workload][mode] = row
    for rows in out.values():
        refs = rows if "vllm" in rows else out.get("prefix_repetition", {})
        for row in rows.values():
            if "vllm" in refs:
                row["mean_ttft_vs_vllm"] = row["mean_ttft_ms"] / refs["vllm"]["mean_ttft_ms"]
                row["throughput_vs_vllm"] = row["output_throughput"] / refs["vllm"]["output_throughput"]
            if "ceiling" in refs:
                row["mean_ttft_vs_ceiling"] = row["mean_ttft_ms"] / refs["ceiling"]["mean_ttft_ms"]
    return out


def _ratio(value: float | None) -> str:
    return f"{value:7.2f}x" if value is not None else f"{'-':>8}"


def table(summed: dict[str, Any]) -> list[str]:
    lines = [f"{'workload':<18} {'mode':<8} {'mean TTFT':>10} {'p50':>8} {'p99':>8} {'tok/s':>8} "
             f"{'vs vllm':>8} {'vs ceil':>8}  prompt tokens: computed / vLLM cache / kvtier"]
    for workload, rows in summed.items():
        for mode, r in rows.items():
            t = r["prompt_tokens"]
            lines.append(f"{workload:<18} {mode:<8} {r['mean_ttft_ms']:8.1f}ms {r['median_ttft_ms']:6.1f}ms "
                         f"{r['p99_ttft_ms']:6.1f}ms {r['output_throughput']:8.1f} "
                         f"{_ratio(r.get('mean_ttft_vs_vllm'))} {_ratio(r.get('mean_ttft_vs_ceiling'))}  "
                         f"{t['local_compute']:.0f} / "
                         f"{t['local_cache_hit']:.0f} / {t['external_kv_transfer']:.0f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = KvtierParser(prog="benchmarks/vllm_client.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not 0 < args.memory_share < 1:
        parser.error(f"argument --memory-share: expected a share between 0 and 1, got {args.memory_share}")
    need = unwritable(args.out)
    if need is None:
        from kvtier.ops.demo_vllm import check_vllm

        try:
            check_vllm()
        except KvtierError as exc:
            need = str(exc)
    return run_checked("vllm_client", need, lambda: _run_and_write(args))


def _run_and_write(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-client-") as work:
        found = run(args, Path(work))
    summed = summary(found["runs"])
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"settings": settings, "block": BLOCK, "model": {"layers": LAYERS, "hidden": HIDDEN, "dtype": "float32"},
              "summary": summed, **found, "machine": machine_info()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table(summed)))
    print(f"the same texts on every server ({found['texts_compared']} completions compared): "
          f"{found['same_texts']}; kvtier's timed passes loaded from kvtier: {found['kvtier_loaded']}")
    print(f"results: {args.out}")
    return 0 if found["same_texts"] and found["kvtier_loaded"] else 1


if __name__ == "__main__":
    sys.exit(main())
