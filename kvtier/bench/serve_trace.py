"""The requests of ``kvtier bench serve``: a Mooncake-format trace (or a small synthetic multi-turn set) scaled to
this machine, with its arrival times, and the same requests as a hit-rate workload for the simulation.

Scaling (kvtier.bench.vllm_replay's): each 512-token hash block becomes ``block_tokens`` deterministic token ids
seeded by its id, the prompt length is scaled by ``block_tokens / 512`` and capped at ``max_prompt``; the output
length is scaled the same way and kept within 1 .. ``max_output``. Arrival times are the trace's times times
``time_scale``, or ``1 / rate`` seconds apart in trace order when a rate is given. ``sessions`` = N keeps one
conversation in N, whole: a conversation is the requests that share their first two hash blocks (every Mooncake
request starts with the common block 0, so the second block names the conversation), chosen by a stable hash of
those ids. Taking the first N requests instead keeps the trace's start, where few conversations have a next turn
yet; sampling conversations keeps the whole hour's reuse in fewer requests.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.vllm_replay import working_set_tokens
from kvtier.bench.workloads import MOONCAKE_BLOCK_TOKENS, Request, Workload

SYNTHETIC_NAME = "synthetic multi-turn"


@dataclass(frozen=True)
class Scaling:
    """How the trace was scaled to this machine."""

    block_tokens: int = 32
    max_prompt: int = 1024
    max_output: int = 16
    time_scale: float = 1.0
    rate: float | None = None  # requests per second, in trace order; overrides the trace's times
    sessions: int = 1  # keep one conversation in this many (1: every request)

    def describe(self) -> str:
        arrivals = (f"{self.rate:g} requests/s in trace order" if self.rate
                    else f"trace times x {self.time_scale:g}")
        sample = f", one conversation in {self.sessions}" if self.sessions > 1 else ""
        return (f"scaling: each 512-token hash block -> {self.block_tokens} tokens, prompts <= {self.max_prompt} "
                f"tokens, outputs <= {self.max_output} tokens (scaled by {self.block_tokens}/512), "
                f"arrivals: {arrivals}{sample}")


@dataclass(frozen=True)
class ServeRequest:
    """One scaled request: when it arrives (seconds from the start), its prompt and how many tokens it makes."""

    arrival_s: float
    prompt: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]


def read_rows(path: Path, requests: int, sessions: int = 1) -> list[dict[str, Any]]:
    """The first ``requests`` rows of a Mooncake-format JSONL trace that belong to the conversations ``sessions``
    keeps (see ``sampled``; every row when it is 1); ValueError naming a bad line. A conversation whose later
    turns come after the ``requests``-th kept row is cut there."""
    rows: list[dict[str, Any]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if len(rows) >= requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                hash_ids = [int(h) for h in row["hash_ids"]]
                parsed = {"timestamp": int(row.get("timestamp", 0)), "input_length": int(row["input_length"]),
                          "output_length": int(row.get("output_length", 1)), "hash_ids": hash_ids}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
            if sampled(hash_ids, sessions):
                rows.append(parsed)
    return rows


def sampled(hash_ids: Sequence[int], sessions: int) -> bool:
    """Whether the conversation of a request with ``hash_ids`` (its first two blocks) is one of the one in
    ``sessions`` kept: a stable hash of those ids, the same in every run."""
    if sessions <= 1:
        return True
    head = ",".join(str(h) for h in hash_ids[:2]).encode()
    return zlib.crc32(head) % sessions == 0


def synthetic_rows(conversations: int = 6, turns: int = 4, first_blocks: int = 4, new_blocks: int = 3,
                   gap_ms: int = 250) -> list[dict[str, Any]]:
    """A small multi-turn set in the trace's format: every conversation starts with the shared block 0; each turn
    is the previous prompt plus ``new_blocks`` new blocks. Turns of all conversations interleave (conversation c's
    turn t arrives at ``(t * conversations + c) * gap_ms``), so each conversation's earlier blocks have aged in
    a small cache by the time its next turn comes."""
    rows: list[dict[str, Any]] = []
    next_id = 1
    history: list[list[int]] = [[0] for _ in range(conversations)]
    for turn in range(turns):
        for conv in range(conversations):
            grow = first_blocks if turn == 0 else new_blocks
            history[conv] = history[conv] + list(range(next_id, next_id + grow))
            next_id += grow
            rows.append({"timestamp": (turn * conversations + conv) * gap_ms,
                         "input_length": len(history[conv]) * MOONCAKE_BLOCK_TOKENS - 100,
                         "output_length": 128, "hash_ids": list(history[conv])})
    return rows


def write_rows(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def block_token_ids(block_id: int, block_tokens: int) -> list[int]:
    """The token ids a hash block maps to: ``block_tokens`` ids in 3 .. 999 drawn from a generator seeded by the
    block's id, the same in every run and every request (kvtier.bench.vllm_replay's mapping)."""
    rng = random.Random(int(block_id))
    return [rng.randrange(3, 1000) for _ in range(block_tokens)]


def prompt_of(row: dict[str, Any], block_tokens: int, max_prompt: int, blocks: dict[int, list[int]]) -> list[int]:
    """A row's prompt: its hash blocks' token runs, cut at its scaled ``input_length`` and at ``max_prompt``."""
    length = min(max_prompt, math.ceil(row["input_length"] * block_tokens / MOONCAKE_BLOCK_TOKENS))
    tokens: list[int] = []
    for block_id in row["hash_ids"]:
        if len(tokens) >= length:
            break
        if block_id not in blocks:
            blocks[block_id] = block_token_ids(block_id, block_tokens)
        tokens.extend(blocks[block_id])
    return tokens[:length]


def scale(path: Path, requests: int, scaling: Scaling) -> list[ServeRequest]:
    """The first ``requests`` requests of the trace at ``path`` (of its sampled conversations), scaled (see the
    module's description)."""
    rows = read_rows(path, requests, scaling.sessions)
    ratio = scaling.block_tokens / MOONCAKE_BLOCK_TOKENS
    start = rows[0]["timestamp"] if rows else 0
    blocks: dict[int, list[int]] = {}
    out = []
    for i, row in enumerate(rows):
        prompt = prompt_of(row, scaling.block_tokens, scaling.max_prompt, blocks)
        if not prompt:
            raise ValueError(f"{path}: request {i + 1} has an empty prompt (no hash_ids or input_length 0)")
        arrival = i / scaling.rate if scaling.rate else (row["timestamp"] - start) / 1000 * scaling.time_scale
        tokens = min(scaling.max_output, max(1, math.ceil(row["output_length"] * ratio)))
        covered = math.ceil(len(prompt) / scaling.block_tokens)
        out.append(ServeRequest(arrival, prompt, tokens, tuple(row["hash_ids"][:covered])))
    if not out:
        kept = f" of the conversations --sessions {scaling.sessions} keeps" if scaling.sessions > 1 else ""
        raise ValueError(f"{path}: no requests in the trace{kept}")
    return out


def working_set(requests: Sequence[ServeRequest], block_tokens: int) -> int:
    """Tokens of every distinct full block of the scaled prompts (what a cache holding everything holds)."""
    return working_set_tokens([r.prompt for r in requests], block_tokens)


def hit_workload(requests: Sequence[ServeRequest], block_tokens: int) -> Workload:
    """The scaled requests as a hit-rate workload (one chunk per scaled block), counted as the engine can hit:
    full blocks only, and never the prompt's last token (the engine computes at least one)."""
    reqs = []
    for r in requests:
        full = (len(r.prompt) - 1) // block_tokens
        chunks: tuple[Hashable, ...] = r.hash_ids[:full]
        reqs.append(Request(chunks, len(r.prompt)))
    return Workload("serve", block_tokens, tuple(reqs))
