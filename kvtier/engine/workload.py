"""Workloads for the reference engine: prefix-sharing waves (conformance) and multi-turn chat (demo).

Chat: every user shares one system prompt; turn ``t`` of a user sends the whole conversation so far (system
prompt, earlier user messages and the engine's own replies) plus a new message, as a chat front end does. A
user's next turn is submitted when the previous reply finished (closed loop), so a cache that kept the
conversation turns its prefill into a load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.engine.core import Engine, RequestSpec
from kvtier.engine.model import ModelConfig
from kvtier.engine.scheduler import EngineRequest


def random_tokens(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from ``gen`` (ids 1.. vocab-1)."""
    return [int(t) for t in torch.randint(1, vocab, (n,), generator=gen)]


def shared_prefix_waves(model: ModelConfig, seed: int = 0, max_tokens: int = 6) -> list[list[RequestSpec]]:
    """Three waves whose later requests share prefixes (longer than a sliding window) with earlier ones.

    Wave 1 stores: two long prompts and a short one. Wave 2 extends or branches them (hits expected), wave 3
    repeats a prompt exactly (everything but its last block can load).
    """
    gen = torch.Generator().manual_seed(seed)
    v = model.vocab_size
    sys_a, sys_b = random_tokens(gen, 300, v), random_tokens(gen, 170, v)
    q = [random_tokens(gen, n, v) for n in (37, 21, 50, 19, 64)]
    wave1 = [RequestSpec("w1-a", tuple(sys_a + q[0]), max_tokens), RequestSpec("w1-b", tuple(sys_b + q[1]), max_tokens),
             RequestSpec("w1-short", tuple(q[3][:12]), max_tokens)]
    wave2 = [RequestSpec("w2-a-branch", tuple(sys_a + q[2]), max_tokens),
             RequestSpec("w2-b-extend", tuple(sys_b + q[1] + q[4]), max_tokens),
             RequestSpec("w2-a-long", tuple(sys_a + q[0] + q[2] + q[4] + q[3]), max_tokens)]
    wave3 = [RequestSpec("w3-a-repeat", tuple(sys_a + q[0]), max_tokens),
             RequestSpec("w3-fresh", tuple(random_tokens(gen, 90, v)), max_tokens)]
    return [wave1, wave2, wave3]


@dataclass(frozen=True)
class ChatSpec:
    """Shape of a multi-turn chat workload."""

    users: int = 8
    turns: int = 4
    system_tokens: int = 160
    user_tokens: tuple[int, int] = (24, 64)  # message length range (inclusive)
    max_tokens: int = 12
    seed: int = 0

    def max_prompt_len(self) -> int:
        return self.system_tokens + self.turns * (self.user_tokens[1] + self.max_tokens)


@dataclass
class Conversation:
    """One user's chat: the history so far and the messages still to send."""

    user: int
    history: list[int]
    messages: list[list[int]]
    max_tokens: int
    turn: int = 0
    ttfts: list[float] = field(default_factory=list)

    def next_request(self) -> RequestSpec | None:
        """The next turn's request (history + next message), or None when the chat is over."""
        if self.turn >= len(self.messages):
            return None
        self.history = self.history + self.messages[self.turn]
        return RequestSpec(f"u{self.user}-t{self.turn}", tuple(self.history), self.max_tokens)

    def record_reply(self, req: EngineRequest) -> None:
        self.history = self.history + req.output_token_ids
        if req.ttft is not None:
            self.ttfts.append(req.ttft)
        self.turn += 1


def chat_conversations(spec: ChatSpec, vocab: int) -> list[Conversation]:
    """Deterministic conversations sharing one system prompt."""
    gen = torch.Generator().manual_seed(spec.seed)
    system = random_tokens(gen, spec.system_tokens, vocab)
    low, high = spec.user_tokens
    convs = []
    for user in range(spec.users):
        lengths = torch.randint(low, high + 1, (spec.turns,), generator=gen).tolist()
        convs.append(Conversation(user, list(system), [random_tokens(gen, n, vocab) for n in lengths],
                                  spec.max_tokens))
    return convs


def run_chat(engine: Engine, convs: list[Conversation],
             on_finish: Callable[[EngineRequest], None] | None = None) -> list[EngineRequest]:
    """Closed loop: each user's next turn is submitted when its previous reply finished."""
    by_id: dict[str, Conversation] = {}
    for conv in convs:
        _submit(engine, conv, by_id)
    done: list[EngineRequest] = []
    while engine.has_unfinished():
        for req in engine.step():
            done.append(req)
            conv = by_id.pop(req.request_id)
            conv.record_reply(req)
            _submit(engine, conv, by_id)
            if on_finish is not None:
                on_finish(req)
        if engine.last_scheduled == 0:
            time.sleep(engine.args.idle_sleep)  # only waiting on loads or saves: let the I/O thread run
    return done


def _submit(engine: Engine, conv: Conversation, by_id: dict[str, Conversation]) -> None:
    spec = conv.next_request()
    if spec is not None:
        engine.add_request(spec)
        by_id[spec.request_id] = conv
