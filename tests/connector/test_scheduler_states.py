"""The scheduler half with a recurrent (Mamba / linear-attention) group: a hit needs the state at the hit point and
the attention KV before it; the state loads asynchronously into the block vLLM allocates at the hit point; states
are saved only from the engine's boundary offers (exact blocks), never by position.

Real tiers behind a real TieredStore (scheduler_harness); chunks are placed under the keys the scheduler computes.
"""

from __future__ import annotations

from scheduler_harness import FULL, MAMBA, TOKENS, Build, C, schedule_new

from kvtier.engine.types import KVCacheBlocks, KVConnectorBlockState, NewRequestData, Request, SchedulerOutput
from kvtier.layout import KVCacheConfig
from kvtier.layout.geometry import NULL_BLOCK

HYBRID = KVCacheConfig((FULL, MAMBA))  # block size 4 in both groups, chunks of 8: a state every other block


def test_a_hybrid_hit_is_the_last_boundary_with_a_state_and_loads_async(harness: Build) -> None:
    h = harness(HYBRID)
    h.place(TOKENS, 0, [0, 1, 2, 3])
    h.place(TOKENS, 1, [1])  # the state after 16 tokens only (the engine offered no other)
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (2 * C, True)  # async even from a memory tier
    # vLLM's allocation for a 16-token hit: the state group's slots are null up to slot (16-1)//4 = 3
    blocks = (list(range(1, 10)), [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 11])
    h.conn.update_state_after_alloc(req, KVCacheBlocks(blocks), 2 * C)
    meta = schedule_new(h.conn, req, blocks, 2 * C, len(TOKENS) - 2 * C)
    loads = {spec.group: spec for spec in meta.loads}
    assert loads[1].keys == (h.keys(TOKENS)[1][1],) and loads[1].block_ids == ((11,),) and loads[1].is_async
    assert loads[0].block_ids == ((1, 2), (3, 4)) and loads[0].is_async


def test_a_state_without_its_attention_prefix_or_kv_without_a_state_is_no_hit(harness: Build) -> None:
    h = harness(HYBRID)
    h.place(TOKENS, 0, [1, 2, 3])  # chunk 0's KV is missing
    h.place(TOKENS, 1, [0, 1, 2, 3])
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (0, False)
    h.place(TOKENS, 0, [0])
    assert h.conn.get_num_new_matched_tokens(Request("r", TOKENS), 0) == (4 * C, True)
    other = [*TOKENS[:C], *(t + 1000 for t in TOKENS[C:])]  # shares chunk 0's KV, no state of its own
    assert h.conn.get_num_new_matched_tokens(Request("o", other), 0) == (C, True)


def test_states_are_saved_from_the_engines_offers_only(harness: Build) -> None:
    h = harness(HYBRID)
    req = Request("r", TOKENS)
    assert h.conn.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = (list(range(1, 10)), [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 21])
    offers = {"r": [(1, 21, 32), (1, 22, 30), (0, 5, 32), (1, NULL_BLOCK, 24), (7, 9, 32)]}
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("r", TOKENS, blocks, 0)],
                          num_scheduled_tokens={"r": 4 * C},
                          kv_connector_block_state=KVConnectorBlockState(offers))
    meta = h.conn.build_connector_meta(out)
    by_group = {spec.group: spec for spec in meta.saves}
    assert by_group[0].keys == tuple(h.keys(TOKENS)[0][:4])  # attention: every full chunk, by position
    # the state group: only the offer at a chunk boundary (32 tokens: chunk 3), in the offered block
    assert by_group[1].keys == (h.keys(TOKENS)[1][3],) and by_group[1].block_ids == ((21,),)
    assert h.conn.request_finished_all_groups(req, blocks) == (True, None)  # saves in flight hold the request


def test_without_offers_no_state_is_saved(harness: Build) -> None:
    h = harness(HYBRID)
    req = Request("r", TOKENS)
    h.conn.get_num_new_matched_tokens(req, 0)
    meta = schedule_new(h.conn, req, (list(range(1, 10)), [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 21]), 0, 4 * C)
    assert {spec.group for spec in meta.saves} == {0}
