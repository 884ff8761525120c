"""TieredConnector's scheduler half and multimodal / prompt-embeds requests: images key the chunks (same
placeholders, different images never share KV), the scheduler-output path keys like the lookup, prompt embeds never
hit nor save."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from scheduler_harness import FULL, TOKENS, Build, C

from kvtier.connector.keying import request_extra, request_keys
from kvtier.engine.types import KVCacheBlocks, NewRequestData, Request, SchedulerOutput
from kvtier.layout import KVCacheConfig


@dataclass
class MMRequest(Request):
    """An engine request with vLLM 0.33's multimodal / prompt-embeds attributes."""

    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


@dataclass
class MMNewRequestData(NewRequestData):
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


def _image(ident: str, offset: int = 2, length: int = 20) -> SimpleNamespace:
    return SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=length))


def test_same_placeholders_different_images_never_share_kv(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    cat = MMRequest("cat", TOKENS, mm_features=[_image("img-cat")])
    cat_keys = request_keys(h.spaces, TOKENS, C, request_extra(cat))
    h.loop.run(h.store.put([(k, torch.zeros(4)) for k in cat_keys[0][:4]], tiers=["cpu"]))
    assert h.conn.get_num_new_matched_tokens(cat, 0) == (4 * C, False)
    dog = MMRequest("dog", TOKENS, mm_features=[_image("img-dog")])
    assert h.conn.get_num_new_matched_tokens(dog, 0) == (0, False)
    moved = MMRequest("moved", TOKENS, mm_features=[_image("img-cat", offset=3)])
    assert h.conn.get_num_new_matched_tokens(moved, 0) == (0, False)
    old_style = MMRequest("old", TOKENS, mm_features=[SimpleNamespace(mm_hash="img-cat", mm_position=None)])
    assert request_extra(old_style) != request_extra(MMRequest("x", TOKENS))
    assert h.conn.get_num_new_matched_tokens(MMRequest("plain", TOKENS), 0) == (0, False)


def test_new_request_data_path_keys_multimodal_requests_like_the_lookup(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    ids = list(range(1, 10))
    request = MMRequest("n", TOKENS, mm_features=[_image("img-cat")])
    assert h.conn.get_num_new_matched_tokens(request, 0) == (0, False)
    new = MMNewRequestData("n", TOKENS, (ids,), 0, mm_features=[_image("img-cat")])
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"n": 2 * C}))
    expected = request_keys(h.spaces, TOKENS, C, request_extra(request))
    assert [s.keys for s in meta.saves] == [tuple(expected[0][:2])]
    assert expected[0][0] != h.keys(TOKENS)[0][0]


def test_requests_never_looked_up_plan_no_saves(harness: Build) -> None:
    """Without the engine's request (cache salt, LoRA) the keys could miss the tenant: nothing is saved."""
    h = harness(KVCacheConfig((FULL,)))
    new = MMNewRequestData("u", TOKENS, (list(range(1, 10)),), 0)
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"u": 3 * C}))
    assert meta.saves == []


def test_prompt_embeds_requests_never_hit_and_never_save(harness: Build) -> None:
    h = harness(KVCacheConfig((FULL,)))
    h.place(TOKENS, 0, [0, 1, 2, 3])
    embeds = torch.zeros(len(TOKENS), 4)
    req = MMRequest("e", TOKENS, prompt_embeds=embeds)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    ids = list(range(1, 10))
    h.conn.update_state_after_alloc(req, KVCacheBlocks((ids,)), 0)
    new = MMNewRequestData("e", TOKENS, (ids,), 0, prompt_embeds=embeds)
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"e": 3 * C}))
    assert meta.saves == [] and meta.loads == []
    # only the scheduler output says so (no lookup first): still no saves
    other = MMNewRequestData("f", TOKENS, (ids,), 0, prompt_embeds=embeds)
    meta = h.conn.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[other], num_scheduled_tokens={"f": 3 * C}))
    assert meta.saves == []
