"""A real ``vllm`` OpenAI server (vLLM's CPU build) in its own process, for kvtier demo, benchmarks and end-to-end
tests: start it on a loopback port, send completions, scrape its ``/metrics``, stop it.

Tiny checkpoints have no tokenizer unless one is added (kvtier.ops.models.add_tokenizer): by default the server
runs with ``--skip-tokenizer-init`` and prompts are lists of token ids; completions return token ids
(``return_token_ids``), and the text too where the server has a tokenizer.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
ENGINE_LABELS = ("engine", "model_name")
# vLLM's CPU build binds its worker's threads to all cores but the ones it reserves: one for the scheduler, and
# one more when any KV connector is set. On a 2-core machine that extra one cannot be had, so a server with kvtier
# computed on both cores and one without on a single core. Every server started here reserves the same one core.
CPU_LAYOUT = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
CORE_IDS = re.compile(r"local_rank=0, core ids=\[([0-9, ]*)\]")


def kvtier_transfer(config_file: str, **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvtier's connector with a kvtier config file."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": config_file, **extra}}


@dataclass
class ServerSpec:
    """How to start one server."""

    model: str
    port: int  # 0: a free one, chosen now
    block_size: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 8
    dtype: str = "float32"
    prefix_caching: bool = True
    transfer: dict[str, Any] | None = None  # --kv-transfer-config
    events_endpoint: str | None = None  # ZMQ endpoint vLLM's publisher connects to
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    tokenizer: bool = False  # the checkpoint has one: prompts may be text

    def __post_init__(self) -> None:
        if self.port == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = int(s.getsockname()[1])

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               *(() if self.tokenizer else ("--skip-tokenizer-init",)), "--host", "127.0.0.1", "--port", str(self.port),
               "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len), "--enforce-eager",
               "--dtype", self.dtype, "--seed", "0", "--max-num-seqs", str(self.max_num_seqs),
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.transfer)]
        if self.events_endpoint is not None:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": self.events_endpoint})]
        return [*cmd, *self.extra_args]


class Server:
    """A running server: completions, metrics."""

    def __init__(self, spec: ServerSpec, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.spec, self.proc, self.log = spec, proc, log
        self.url = f"http://127.0.0.1:{spec.port}"

    def complete(self, prompt: Sequence[int], max_tokens: int = 4, timeout_s: float = 300) -> list[int]:
        """Greedy completion of ``prompt`` (token ids); the generated token ids."""
        body = {"model": self.spec.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            return list(json.load(reply)["choices"][0]["token_ids"])

    def stream(self, prompt: str | Sequence[int], max_tokens: int, timeout_s: float = 600) -> Streamed:
        """One greedy streamed completion of ``prompt`` (text or token ids)."""
        return stream_completion("127.0.0.1", self.spec.port, self.spec.model, prompt, max_tokens, timeout_s)

    def metrics(self) -> Samples:
        """Every sample of ``/metrics`` by name and labels (vLLM's engine labels left out)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ENGINE_LABELS))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def worker_cores(self) -> list[int] | None:
        """The CPU cores vLLM bound its worker's threads to, from its log (None when it did not say)."""
        found = CORE_IDS.search(self.log.read_text(errors="replace"))
        return None if found is None else [int(c) for c in found.group(1).split(",") if c.strip()]


@dataclass
class Streamed:
    """What one streamed completion gave: seconds from sending to the first token, the generated token ids and
    text, and the usage the server reported last (``prompt_tokens_details`` with ``--enable-prompt-tokens-details``)."""

    ttft_s: float
    tokens: list[int]
    text: str
    usage: dict[str, Any]


def stream_completion(host: str, port: int, model: str, prompt: str | Sequence[int], max_tokens: int,
                      timeout_s: float = 600) -> Streamed:
    """One greedy streamed completion (``ignore_eos``: always ``max_tokens`` tokens)."""
    body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300].decode(errors='replace')}")
        out = Streamed(0.0, [], "", {})
        for raw in reply:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and not out.ttft_s:
                    out.ttft_s = time.perf_counter() - start
                out.tokens.extend(ids)
                out.text += choice.get("text") or ""
            out.usage = chunk.get("usage") or out.usage
        return out
    finally:
        conn.close()


def metric(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({server.proc.returncode}):\n{server.tail()}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the vLLM server did not start in {timeout_s:.0f}s:\n{server.tail()}")


def same_kvtier(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a Python process a benchmark starts, so that it imports the kvtier this process imported: never
    the working directory's (``python -m`` puts it first; ``PYTHONSAFEPATH`` keeps it out), and this one's own
    tree first when it is not an installed one (a checkout)."""
    out = {**env, "PYTHONSAFEPATH": "1"}
    root = Path(__file__).resolve().parents[2]
    if root.name not in ("site-packages", "dist-packages"):
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return out


@contextmanager
def running(spec: ServerSpec, log: Path, timeout_s: float = 600) -> Iterator[Server]:
    """Start the server (with the kvtier this process imported, ``CPU_LAYOUT`` unless ``spec.env`` says otherwise),
    wait for ``/health``, stop it on exit."""
    env = same_kvtier({**os.environ, **CPU_LAYOUT, **spec.env})
    env.pop("VLLM_TARGET_DEVICE", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(spec.command(), stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(spec, proc, log)
    try:
        _wait_ready(server, timeout_s)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
