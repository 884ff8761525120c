"""Workloads for the hit-rate replay: a request is a list of chunk ids (prefix order) and an input length.

Chunk ids identify content *and* prefix: equal ids mean the same chunk after the same prefix, as in the
Mooncake FAST'25 traces (``hash_ids``, one per 512-token block, the last one usually partial). The seeded
generators build prompts from text segments and intern each chunk as ``(parent id, pieces of segments it
covers)``, so a chunk's id changes whenever anything before or inside it changes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.config.parse import parse_size

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: its chunk ids in prefix order and its length in tokens."""

    chunks: tuple[Hashable, ...]
    input_len: int


@dataclass(frozen=True)
class Workload:
    """A named sequence of requests cut into chunks of ``chunk_tokens``."""

    name: str
    chunk_tokens: int
    requests: tuple[Request, ...]

    def unique_chunks(self) -> int:
        """Number of distinct chunk ids in the workload."""
        return len({c for r in self.requests for c in r.chunks})

    def head(self, limit: int | None) -> Workload:
        """The first ``limit`` requests (all when None)."""
        if limit is None or limit >= len(self.requests):
            return self
        return Workload(self.name, self.chunk_tokens, self.requests[:limit])


def load_mooncake(path: str | Path, limit: int | None = None,
                  window_ms: tuple[int, int | None] = (0, None)) -> Workload:
    """Read a Mooncake trace (JSONL: timestamp, input_length, output_length, hash_ids); ``window_ms``: only
    the requests that arrive in [start, end) (end None: to the end of the trace)."""
    path = Path(path)
    start, end = window_ms
    requests: list[Request] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                stamp = int(row.get("timestamp", 0))
                if stamp < start or (end is not None and stamp >= end):
                    continue
                requests.append(Request(tuple(row["hash_ids"]), int(row["input_length"])))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
    name = f"mooncake:{path.name}" if window_ms == (0, None) else f"mooncake:{path.name}[{start}ms,{end}ms)"
    return Workload(name, MOONCAKE_BLOCK_TOKENS, tuple(requests))


Segment = tuple[int, int]  # (segment id, length in tokens)


class ChunkInterner:
    """Cuts prompts made of segments into chunks and gives each (parent, content) a small int id."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def request(self, segments: Sequence[Segment]) -> Request:
        """The request whose prompt is the concatenation of ``segments``."""
        chunks: list[int] = []
        pieces: list[tuple[int, int, int]] = []
        room = self.chunk_tokens
        for seg, length in segments:
            start = 0
            while start < length:
                take = min(room, length - start)
                pieces.append((seg, start, start + take))
                start += take
                room -= take
                if room == 0:
                    chunks.append(self._intern(chunks, pieces))
                    pieces, room = [], self.chunk_tokens
        if pieces:
            chunks.append(self._intern(chunks, pieces))
        return Request(tuple(chunks), sum(length for _, length in segments))

    def _intern(self, chunks: list[int], pieces: list[tuple[int, int, int]]) -> int:
        key = (chunks[-1] if chunks else -1, tuple(pieces))
        return self._ids.setdefault(key, len(self._ids))


class _Segments:
    """Fresh segment ids with random lengths."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next_id = 0

    def new(self, low: int, high: int) -> Segment:
        self.next_id += 1
        return (self.next_id, self.rng.randint(low, high))


def _interleave(rng: random.Random, streams: list[Iterator[list[Segment]]]) -> Iterator[list[Segment]]:
    """Yield from randomly chosen live streams until all are exhausted (concurrent sessions)."""
    live = list(streams)
    while live:
        i = rng.randrange(len(live))
        try:
            yield next(live[i])
        except StopIteration:
            live.pop(i)


def multi_round_qa(users: int = 50, rounds: int = 8, system_tokens: int = 2000, question_tokens: int = 300,
                   answer_tokens: int = 400, chunk_tokens: int = 256, seed: int = 0) -> Workload:
    """Users share one system prompt; each round a user asks a question after its whole history."""
    rng = random.Random(seed)
    segs = _Segments(rng)
    system = segs.new(system_tokens, system_tokens)

    def user() -> Iterator[list[Segment]]:
        history: list[Segment] = []
        for _ in range(rng.randint(1, rounds)):
            question = segs.new(question_tokens // 2, question_tokens * 3 // 2)
            yield [system, *history, question]
            history += [question, segs.new(answer_tokens // 2, answer_tokens * 3 // 2)]

    interner = ChunkInterner(chunk_tokens)
    reqs = tuple(interner.request(p) for p in _interleave(rng, [user() for _ in range(users)]))
    return Workload(f"multi-round(users={users},rounds={rounds},seed={seed})", chunk_tokens, reqs)


REPEAT_MODES = ("random", "tile", "interleave")


def long_doc_qa(documents: int = 20, doc_tokens: int = 10000, repeats: int = 3, repeat_mode: str = "random",
                question_tokens: int = 64, chunk_tokens: int = 256, seed: int = 0) -> Workload:
    """Questions over long documents: each document asked ``repeats`` times, in the given order."""
    if repeat_mode not in REPEAT_MODES:
        raise ValueError(f"unknown repeat mode {repeat_mode!r}; use one of {REPEAT_MODES}")
    rng = random.Random(seed)
    segs = _Segments(rng)
    docs = [segs.new(doc_tokens // 2, doc_tokens * 3 // 2) for _ in range(documents)]
    if repeat_mode == "tile":
        order = [d for _ in range(repeats) for d in range(documents)]
    elif repeat_mode == "interleave":
        order = [d for d in range(documents) for _ in range(repeats)]
    else:
        order = [d for d in range(documents) for _ in range(repeats)]
        rng.shuffle(order)
    interner = ChunkInterner(chunk_tokens)
    reqs = tuple(interner.request([docs[d], segs.new(question_tokens, question_tokens)]) for d in order)
    name = f"long-doc(documents={documents},repeats={repeats},mode={repeat_mode},seed={seed})"
    return Workload(name, chunk_tokens, reqs)


def agentic(sessions: int = 30, turns: int = 12, system_tokens: int = 4000, tool_tokens: int = 1200,
            action_tokens: int = 200, chunk_tokens: int = 256, seed: int = 0) -> Workload:
    """Agent sessions: each turn re-sends the whole context grown by the last action and tool output."""
    rng = random.Random(seed)
    segs = _Segments(rng)
    system = segs.new(system_tokens, system_tokens)

    def session() -> Iterator[list[Segment]]:
        context: list[Segment] = [system, segs.new(200, 1000)]  # system prompt + task
        for _ in range(rng.randint(2, turns)):
            yield list(context)
            context += [segs.new(action_tokens // 2, action_tokens * 2), segs.new(tool_tokens // 4, tool_tokens * 2)]

    interner = ChunkInterner(chunk_tokens)
    reqs = tuple(interner.request(p) for p in _interleave(rng, [session() for _ in range(sessions)]))
    return Workload(f"agentic(sessions={sessions},turns={turns},seed={seed})", chunk_tokens, reqs)


def few_shot(tasks: int = 40, examples: int = 6, pool: int = 60, requests: int = 400, system_tokens: int = 500,
             example_tokens: int = 400, query_tokens: int = 150, chunk_tokens: int = 256, seed: int = 0) -> Workload:
    """Few-shot prompting: each task puts its own ordered pick of ``examples`` from a shared pool after one
    system prompt; requests pick tasks with Zipf-like popularity (task i with weight 1 / (i + 1)) and end in a
    fresh query. Popular tasks are asked often; the long tail rarely, so frequency matters more than recency."""
    rng = random.Random(seed)
    segs = _Segments(rng)
    system = segs.new(system_tokens, system_tokens)
    shots = [segs.new(example_tokens // 2, example_tokens * 3 // 2) for _ in range(pool)]
    prefixes = [[system, *rng.sample(shots, examples)] for _ in range(tasks)]
    weights = [1.0 / (i + 1) for i in range(tasks)]
    interner = ChunkInterner(chunk_tokens)
    reqs = tuple(interner.request([*prefixes[rng.choices(range(tasks), weights)[0]],
                                   segs.new(query_tokens // 2, query_tokens * 2)]) for _ in range(requests))
    return Workload(f"few-shot(tasks={tasks},examples={examples},seed={seed})", chunk_tokens, reqs)


GENERATORS: dict[str, Callable[..., Workload]] = {
    "multi-round": multi_round_qa, "long-doc": long_doc_qa, "agentic": agentic, "few-shot": few_shot,
}
TRACE_HALF_MS = 1_768_500  # half of the Mooncake conversation trace's hour (timestamps 0 .. 3,536,999 ms)


def synthetic_suite() -> list[Workload]:
    """The synthetic workloads of the benchmark: each generator of the hit-rate replay with its defaults
    (the ones the default policy's settings were chosen on, with the first half of the Mooncake trace)."""
    return [multi_round_qa(), long_doc_qa(), agentic()]


def held_out_suite() -> list[Workload]:
    """Workloads held back from tuning the default policy: another shape (few-shot), and the tuned
    generators with other seeds and sizes (``suite_workloads`` adds the trace's second half)."""
    return [few_shot(), few_shot(tasks=120, examples=4, requests=800, seed=1),
            multi_round_qa(users=120, rounds=12, seed=1), long_doc_qa(documents=40, repeats=4, seed=1),
            long_doc_qa(documents=30, repeats=3, repeat_mode="tile", seed=2), agentic(sessions=80, turns=20, seed=1)]


SUITES = ("synthetic", "held-out")


def suite_workloads(name: str, trace: Path) -> list[Workload]:
    """The workloads of suite ``name`` (one of ``SUITES``); the held-out one starts with the second half of
    the Mooncake trace at ``trace`` when that file exists."""
    if name == "synthetic":
        return synthetic_suite()
    held = held_out_suite()
    if trace.is_file():
        held.insert(0, load_mooncake(trace, window_ms=(TRACE_HALF_MS, None)))
    return held


def parse_capacities(spec: str, unique_chunks: int, chunk_bytes: int | None = None) -> list[int]:
    """Capacities in chunks from a comma list: '1000', '10%' (of unique chunks), '8GiB' (with ``chunk_bytes``).

    A trailing '%' on the last item applies to all of them: '5,10,20,40%'.
    """
    items = [x.strip() for x in spec.split(",") if x.strip()]
    if not items:
        raise ValueError(f"no capacity in {spec!r}")
    if items[-1].endswith("%"):
        items = [x if x.endswith("%") else x + "%" for x in items]
    return [_capacity(x, unique_chunks, chunk_bytes) for x in items]


def _capacity(item: str, unique_chunks: int, chunk_bytes: int | None) -> int:
    if item.endswith("%"):
        share = float(item[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"capacity {item!r}: a share of the unique chunks is over 0% and at most 100% "
                             f"(100% holds every chunk)")
        return max(1, round(share / 100 * unique_chunks))
    if item.isdigit():
        return int(item)
    if chunk_bytes is None:
        raise ValueError(f"capacity {item!r} is a size in bytes: give --model-shape (or use chunks or N%)")
    return parse_size(item, "--capacity") // chunk_bytes
