"""Recurrent (gated linear-attention) layers in the reference engine, with vLLM's Mamba "align" semantics.

Without kvtier: the model against a dense oracle, bit-identical logits whatever the chunking and the batch, the
scheduler's block-aligned prefill steps, the recurrent group's slots and its boundary offers, and the hit / failed
load / forged state paths through a small dict connector (state_connector.py). With kvtier (KVTierPair): a second
request gets its hit (attention chunks and the state at the hit) from each tier, computes only the tokens after
it and gives the logits of the run without kvtier; a forged state record changes the output.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from dict_connector import block_keys
from state_connector import STORES as STATE_STORES

from kvtier.config import KvtierConfig, load_config
from kvtier.connector.keying import identity_from, namespaces, request_keys
from kvtier.connector.settings import read_settings
from kvtier.engine import Engine, EngineArgs, KVTierPair, ModelConfig, RequestSpec, reference_logits, run_conformance
from kvtier.engine.harness import RunRecord, compare, run_waves
from kvtier.engine.types import KVTransferConfig
from kvtier.engine.workload import random_tokens
from kvtier.layout import GroupKind, MambaSpec, from_vllm

BS = 16
REC = ModelConfig(recurrent_layers=(1, 3))  # attention layers 0 and 2, recurrent 1 and 3
REC_SWA = ModelConfig(recurrent_layers=(1,), sliding_window=32)  # full 0 and 2, sliding window 3, recurrent 1
MODELS = {"recurrent": REC, "recurrent+swa": REC_SWA}
_names = itertools.count()


def tokens(seed: int, *lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [random_tokens(gen, n, REC.vocab_size) for n in lengths]


def run(args: EngineArgs, specs: list[RequestSpec], **kw: Any) -> dict[str, Any]:
    return Engine(args, **kw).run(specs)


def logits(req: Any) -> torch.Tensor:
    return torch.stack(req.logits)


# ---- the model and the scheduler, without a connector ---------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_recurrent_model_matches_the_dense_reference(name: str) -> None:
    engine = Engine(EngineArgs(model=MODELS[name], max_num_batched_tokens=40))
    prompts = tokens(1, 90, 37)
    done = engine.run([RequestSpec(f"r{i}", tuple(p), 5) for i, p in enumerate(prompts)])
    for req in done.values():
        dense = reference_logits(engine.model, req.all_token_ids)
        p = req.num_prompt_tokens
        assert torch.allclose(logits(req), dense[p - 1:p - 1 + len(req.logits)], atol=1e-4)
        assert req.output_token_ids == [int(t) for t in dense[p - 1:-1].argmax(-1)]
    assert engine.leaked_blocks() == 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_do_not_depend_on_chunking_or_batching(name: str) -> None:
    model = MODELS[name]
    prompt, *others = tokens(2, 100, 23, 61, 130)
    spec = RequestSpec("r", tuple(prompt), 20)  # decodes past two block boundaries
    one_step = Engine(EngineArgs(model=model, max_num_batched_tokens=512))
    one_step.scheduler._aligned = lambda req, start, n: n  # type: ignore[method-assign]  # the whole prompt at once
    alone = one_step.run([spec])["r"]
    assert one_step.num_steps == 21  # one prefill step, 19 decode steps, one reporting the finish
    for budget in (512, 16, 32, 48, 10):  # 10: sub-block steps, realigned at each boundary
        chunked = run(EngineArgs(model=model, max_num_batched_tokens=budget), [spec])["r"]
        assert chunked.output_token_ids == alone.output_token_ids
        assert torch.equal(logits(chunked), logits(alone)), budget
    crowd = [RequestSpec(f"o{i}", tuple(p), 9) for i, p in enumerate(others)]
    for budget in (512, 64):
        batched = run(EngineArgs(model=model, max_num_batched_tokens=budget), [*crowd, spec])["r"]
        assert torch.equal(logits(batched), logits(alone)), budget


def test_the_recurrent_state_changes_the_answer() -> None:
    spec = RequestSpec("r", tuple(tokens(3, 80)[0]), 4)
    with_rec = run(EngineArgs(model=REC), [spec])["r"]
    plain = run(EngineArgs(model=ModelConfig()), [spec])["r"]
    assert not torch.equal(logits(with_rec), logits(plain))
    assert REC.model != ModelConfig().model and "gla@1,3" in REC.model


def test_preemption_recomputes_the_state_and_gives_identical_outputs() -> None:
    specs = [RequestSpec(f"r{i}", tuple(p), 24) for i, p in enumerate(tokens(8, 60, 70, 80, 90))]
    roomy = run(EngineArgs(model=REC_SWA, max_num_batched_tokens=64), specs)
    engine = Engine(EngineArgs(model=REC_SWA, num_blocks=24, max_num_batched_tokens=64))
    tight = engine.run(specs)
    assert sum(r.num_preemptions for r in tight.values()) > 0 and engine.leaked_blocks() == 0
    for k in roomy:
        assert torch.equal(logits(tight[k]), logits(roomy[k]))


def test_prefill_steps_end_at_block_boundaries() -> None:
    engine = Engine(EngineArgs(model=REC, max_num_batched_tokens=40))
    engine.add_request(RequestSpec("r", tuple(tokens(4, 100)[0]), 3))
    ends = []
    while engine.has_unfinished():
        engine.step()
        if "r" in engine.scheduler.requests:
            ends.append(engine.scheduler.requests["r"].num_computed_tokens)
    # aligned down to the block; the last block boundary before the prompt's end (96) is a stop; then decode
    assert ends == [32, 64, 96, 100, 101]


def test_recurrent_layers_are_checked() -> None:
    with pytest.raises(ValueError, match="distinct"):
        ModelConfig(recurrent_layers=(4,))
    with pytest.raises(ValueError, match="both recurrent and sliding"):
        ModelConfig(recurrent_layers=(1,), sliding_window=32, swa_layers=(1,))
    with pytest.raises(ValueError, match="full-attention"):
        ModelConfig(num_layers=2, recurrent_layers=(0, 1))
    assert ModelConfig(recurrent_layers=(1,), sliding_window=32).sliding_layers() == (3,)


def test_kv_cache_config_has_a_mamba_group_over_the_recurrent_layers() -> None:
    engine = Engine(EngineArgs(model=REC_SWA))
    groups = engine.kv_cache_config.kv_cache_groups
    assert [g.kind for g in groups] == [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA]
    assert groups[2].layer_names == ("model.layers.1.linear_attn",)
    spec = groups[2].kv_cache_spec
    assert isinstance(spec, MambaSpec) and spec.block_size == BS and spec.dtypes == ("float32", "float32")
    layout = REC_SWA.state_layout()
    assert spec.state_bytes_per_layer() == layout.state_bytes == (3 * 64 + 4 * 16 * 16) * 4
    cache = engine.kv_caches["model.layers.1.linear_attn"]
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (engine.args.num_blocks, layout.row_bytes)
    assert layout.row_bytes > layout.state_bytes  # padded rows: kvtier reads [b, :state_bytes]
    assert engine.kv.state_group == 2


# ---- the recurrent group's slots and offers (through a connector, as vLLM only offers to one) -------------------
def state_ktc(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="StateDictConnector", kv_connector_module_path="state_connector",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"store": f"rec-{next(_names)}", **extra})


def state_rows(engine: Engine, block: int) -> list[torch.Tensor]:
    size = engine.model.config.state_layout().state_bytes
    return [t[block, :size].clone() for name, t in engine.kv_caches.items() if "linear_attn" in name]


def check_slots(table: list[int], seq_len: int, prev_len: int) -> None:
    """Running slot real, the previous step's slot kept, every other slot null."""
    slot, prev = (seq_len - 1) // BS, (prev_len - 1) // BS if prev_len else None
    assert len(table) == slot + 1 and table[slot] != 0
    assert all(block == 0 for p, block in enumerate(table) if p not in (slot, prev)), (table, seq_len)


def test_slots_and_boundary_offers_follow_the_align_contract() -> None:
    engine = Engine(EngineArgs(model=REC, max_num_batched_tokens=BS), kv_transfer_config=state_ktc())
    conn, group = engine.scheduler_connector, engine.kv.state_group
    engine.add_request(RequestSpec("r", tuple(tokens(5, 3 * BS)[0]), 18))  # 3 blocks; decodes to 65 tokens
    prev_len, held, offered = 0, None, []
    while engine.has_unfinished():
        engine.step()
        req = engine.scheduler.requests.get("r")
        offers = conn.offers[-1].get("r", [])  # type: ignore[union-attr]
        if req is None:
            break
        seq_len, table = req.num_computed_tokens, engine.kv.tables["r"][group]
        check_slots(table, seq_len, prev_len)
        if held is not None:  # a state offered last step is still intact after this one
            assert all(torch.equal(a, b) for a, b in zip(held[1], state_rows(engine, held[0]), strict=True))
            held = None
        if seq_len % BS == 0:
            assert offers == [(group, table[(seq_len - 1) // BS], seq_len)]
            held = (table[(seq_len - 1) // BS], state_rows(engine, table[(seq_len - 1) // BS]))
            offered.append(seq_len)
        else:
            assert offers == []
        prev_len = seq_len
    assert offered == [16, 32, 48, 64]
    assert engine.leaked_blocks() == 0


# ---- hits, failed loads and forged states through the dict connector --------------------------------------------
PREFIX, OTHER, TAIL_A, TAIL_B = tokens(6, 64, 64, 40, 30)
SPEC_A = RequestSpec("a", tuple(PREFIX + TAIL_A), 6)
SPEC_B = RequestSpec("b", tuple(PREFIX + TAIL_B), 6)  # shares A's first 64 tokens
SPEC_C = RequestSpec("c", tuple(OTHER + TAIL_A), 6)  # another prefix of the same length
ARGS = EngineArgs(model=REC, max_num_batched_tokens=32)
_BASE: dict[str, RunRecord] = {}


def baseline() -> RunRecord:
    if "base" not in _BASE:
        _BASE["base"] = run_waves(Engine(ARGS), [[SPEC_A, SPEC_C], [SPEC_B]])
    return _BASE["base"]


def assert_same_as_baseline(record: RunRecord) -> None:
    tokens_same, logits_same, worst, failures = compare(baseline(), record, 0.0)
    assert tokens_same and logits_same and not failures, (worst, failures)
    assert record.leaked_blocks == 0


def test_a_stored_state_is_hit_loaded_async_and_carried() -> None:
    engine = Engine(ARGS, kv_transfer_config=state_ktc())
    record = run_waves(engine, [[SPEC_A, SPEC_C], [SPEC_B]])
    assert_same_as_baseline(record)
    b = record.requests["b"]
    assert b.external_tokens == 64 and b.prefill_computed == len(SPEC_B.prompt_token_ids) - 64
    req_id, external, ids = engine.scheduler_connector.allocations[-1]  # type: ignore[union-attr]
    assert (req_id, external) == ("b", 64)
    assert ids[engine.kv.state_group][:3] == [0, 0, 0] and ids[engine.kv.state_group][3] != 0  # slot (64-1)//16
    assert engine.worker_connector.num_state_loads == 1  # type: ignore[union-attr]


def test_a_failed_state_load_recomputes_the_request_from_zero() -> None:
    engine = Engine(ARGS, kv_transfer_config=state_ktc(fail_state_loads=1))
    record = run_waves(engine, [[SPEC_A, SPEC_C], [SPEC_B]])
    assert_same_as_baseline(record)
    b = record.requests["b"]
    assert b.num_load_failures == 1 and b.external_tokens == 0
    assert b.prefill_computed == len(SPEC_B.prompt_token_ids)


def test_a_synchronous_state_load_is_not_carried() -> None:
    """As in vLLM, the running state is copied (preprocess_mamba) before ``start_load_kv``: a state loaded in the
    step that computes after it is never carried, so a connector must load states asynchronously."""
    engine = Engine(ARGS, kv_transfer_config=state_ktc(async_load=False))
    record = run_waves(engine, [[SPEC_A, SPEC_C], [SPEC_B]])
    b = record.requests["b"]
    assert b.external_tokens == 64 and engine.worker_connector.num_state_loads == 1  # type: ignore[union-attr]
    assert not torch.equal(logits(b), logits(baseline().requests["b"]))


def test_a_swapped_state_changes_the_output() -> None:
    """Control: the loaded state is what the recurrent layers continue from (nothing recomputes it)."""
    ktc = state_ktc()
    store_name = ktc.kv_connector_extra_config["store"]

    def swap(wave: int) -> None:
        store = STATE_STORES[store_name]
        a, c = (b"s" + block_keys(list(s.prompt_token_ids), BS, 4)[-1] for s in (SPEC_A, SPEC_C))
        store[a], store[c] = store[c], store[a]

    record = run_waves(Engine(ARGS, kv_transfer_config=ktc), [[SPEC_A, SPEC_C], [SPEC_B]], between_waves=swap)
    b = record.requests["b"]
    assert b.external_tokens == 64
    assert not torch.equal(logits(b), logits(baseline().requests["b"]))


# ---- kvtier -----------------------------------------------------------------------------------------------------
def kvtier_config(kind: str, tmp_path: Path, redis_url: str | None) -> KvtierConfig:
    tier: dict[str, Any] = {"name": kind, "kind": kind, "capacity": "32MiB"}
    if kind == "disk":
        tier["path"] = str(tmp_path / "disk")
    elif kind == "redis":
        tier.update(url=redis_url, key_prefix=f"kvtier-recurrent-{next(_names)}", timeout="500ms")
    return load_config({"chunk_size": 32, "tiers": [tier],
                        "policy": {"write": "write_back", "eviction": "prefix_lru", "promote_on_hit": True}}, env={})


@pytest.mark.parametrize("kind", ["cpu", "disk", "redis"])
def test_kvtier_hit_restores_the_state_from_each_tier(kind: str, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    pair = KVTierPair(kvtier_config(kind, tmp_path, url))
    record = run_waves(Engine(ARGS, pair), [[SPEC_A, SPEC_C], [SPEC_B]])
    b = record.requests["b"]
    assert b.external_tokens == 64, f"no 64-token hit for the shared prefix ({b.external_tokens})"
    assert b.prefill_computed == len(SPEC_B.prompt_token_ids) - 64
    assert_same_as_baseline(record)
    assert record.stats.get(f"hits_{kind}", 0) > 0


def state_key(engine: Engine, cfg: KvtierConfig, prompt: tuple[int, ...], boundary: int) -> bytes:
    """The key of the recurrent group's record at ``boundary`` tokens (the group's chunk key there)."""
    ident = identity_from(cfg, read_settings(engine.vllm_config), tp_rank=0)
    spaces = namespaces(ident, from_vllm(engine.kv_cache_config), cfg.chunk_size)
    group = engine.kv.state_group
    assert group is not None
    keys = request_keys([spaces[group]], list(prompt[:boundary]), cfg.chunk_size, b"")[0]
    return keys[boundary // cfg.chunk_size - 1]


def test_kvtier_forged_state_record_changes_the_output(tmp_path: Path) -> None:
    """A valid record holding another prompt's state at the same boundary: the hit loads it and the answer
    changes (the state is really restored, not recomputed)."""
    cfg = kvtier_config("cpu", tmp_path, None)
    pair = KVTierPair(cfg)
    engine = Engine(ARGS, pair)

    def forge(wave: int) -> None:
        if wave != 0:
            return
        a_key, c_key = (state_key(engine, cfg, s.prompt_token_ids, 64) for s in (SPEC_A, SPEC_C))
        a_state, c_state = pair.loop.run(pair.store.read("cpu", [a_key, c_key]))
        assert a_state is not None and c_state is not None, "no state record under the expected keys"
        assert not torch.equal(a_state, c_state)
        pair.loop.run(pair.store.delete("cpu", [a_key]))
        assert pair.loop.run(pair.store.write("cpu", [(a_key, c_state.clone())])) == [True]

    record = run_waves(engine, [[SPEC_A, SPEC_C], [SPEC_B]], between_waves=forge)
    b = record.requests["b"]
    assert b.external_tokens == 64
    assert not torch.equal(logits(b), logits(baseline().requests["b"]))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight"])
def test_kvtier_conformance_on_prefix_sharing_waves(name: str, tight: bool, tmp_path: Path) -> None:
    """The harness's waves (branches, extensions, an exact repeat); with a tight pool, requests holding loaded
    blocks are preempted while they wait, so that the first waiting one can start."""
    model = MODELS[name]
    blocks = (40 if model is REC else 64) if tight else 256  # the longest request just fits
    args = EngineArgs(model=model, max_num_batched_tokens=64 if tight else 32, num_blocks=blocks)
    result = run_conformance(KVTierPair(kvtier_config("disk", tmp_path, None)), args=args)
    assert result.passed, result.summary()
    assert result.max_logit_diff == 0.0 and result.requests_with_hits >= 3
    assert result.preemptions > 0 or not tight


def test_kvtier_corrupted_records_are_recomputed(tmp_path: Path) -> None:
    def corrupt(_wave: int) -> None:
        for path in (tmp_path / "disk").rglob("*.kvt"):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))

    result = run_conformance(KVTierPair(kvtier_config("disk", tmp_path, None)), args=ARGS, expect_hits=False,
                             expect_load_failures=True, between_waves=corrupt)
    assert result.passed, result.summary()
