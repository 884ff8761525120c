"""The reference engine alone: determinism, paged attention against a dense oracle, sliding windows,
chunked prefill, preemption, block accounting."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import Engine, EngineArgs, ModelConfig, RequestSpec, reference_logits
from kvtier.engine.kv_cache import NULL_BLOCK, BlockPool
from kvtier.engine.model import tiled_matmul
from kvtier.engine.workload import random_tokens


def _specs(n: int = 4, base: int = 40, step: int = 23, max_tokens: int = 5, seed: int = 1) -> list[RequestSpec]:
    gen = torch.Generator().manual_seed(seed)
    return [RequestSpec(f"r{i}", tuple(random_tokens(gen, base + step * i, 512)), max_tokens) for i in range(n)]


def _run(args: EngineArgs, specs: list[RequestSpec]) -> tuple[Engine, dict]:
    engine = Engine(args)
    return engine, engine.run(specs)


def _logits(req) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.stack(req.logits)


MODELS = {
    "full": ModelConfig(),
    "hybrid": ModelConfig(sliding_window=32),
    "learned": ModelConfig(positions="learned", sliding_window=48, num_kv_heads=1),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_attention_matches_dense_reference(name: str) -> None:
    model = MODELS[name]
    engine, done = _run(EngineArgs(model=model, max_num_batched_tokens=48), _specs(max_tokens=4))
    for req in done.values():
        dense = reference_logits(engine.model, req.all_token_ids)
        p = req.num_prompt_tokens
        assert torch.allclose(_logits(req), dense[p - 1:p - 1 + len(req.output_token_ids)], atol=1e-4)
        assert req.output_token_ids == [int(t) for t in dense[p - 1:-1].argmax(-1)]


def test_bfloat16_matches_dense_reference_within_tolerance() -> None:
    engine, done = _run(EngineArgs(model=ModelConfig(dtype="bfloat16", sliding_window=32)), _specs(n=2))
    for req in done.values():
        dense = reference_logits(engine.model, req.all_token_ids)
        p = req.num_prompt_tokens
        assert (_logits(req) - dense[p - 1:p - 1 + len(req.logits)]).abs().max() < 0.25


def test_sliding_window_changes_the_answer_for_prompts_longer_than_the_window() -> None:
    specs = _specs(n=1, base=120)
    _, full = _run(EngineArgs(model=ModelConfig()), specs)
    _, swa = _run(EngineArgs(model=ModelConfig(sliding_window=32)), specs)
    assert not torch.equal(_logits(full["r0"]), _logits(swa["r0"]))


def test_outputs_do_not_depend_on_batching_or_chunking() -> None:
    model = ModelConfig(sliding_window=32)
    specs = _specs(n=5)
    _, batched = _run(EngineArgs(model=model, max_num_batched_tokens=512), specs)
    _, chunked = _run(EngineArgs(model=model, max_num_batched_tokens=17, max_num_seqs=2), specs)
    for spec in specs:
        _, alone = _run(EngineArgs(model=model), [spec])
        for other in (batched, chunked):
            assert other[spec.request_id].output_token_ids == alone[spec.request_id].output_token_ids
            assert torch.equal(_logits(other[spec.request_id]), _logits(alone[spec.request_id]))


def test_identical_seeds_give_identical_runs_and_different_seeds_do_not() -> None:
    specs = _specs(n=2)
    _, a = _run(EngineArgs(), specs)
    _, b = _run(EngineArgs(), specs)
    _, c = _run(EngineArgs(model=ModelConfig(seed=7)), specs)
    assert all(torch.equal(_logits(a[k]), _logits(b[k])) for k in a)
    assert not torch.equal(_logits(a["r0"]), _logits(c["r0"]))


def test_attention_reads_kv_through_the_block_table() -> None:
    """Overwriting one block of a request's cache after prefill changes its next logits."""
    spec = _specs(n=1, base=64, max_tokens=3)[0]
    _, clean = _run(EngineArgs(), [spec])
    engine = Engine(EngineArgs())
    engine.add_request(spec)
    engine.step()  # the whole prompt and the first token
    block = engine.kv.tables["r0"][0][1]
    for cache in engine.kv_caches.values():
        cache[:, block] = torch.randn_like(cache[:, block])
    done = {r.request_id: r for r in engine.drain()}
    assert torch.equal(done["r0"].logits[0], clean["r0"].logits[0])
    assert not torch.equal(done["r0"].logits[1], clean["r0"].logits[1])


def test_released_window_blocks_give_the_same_outputs_with_fewer_blocks() -> None:
    model = ModelConfig(sliding_window=32)
    specs = _specs(n=3, base=150, max_tokens=8)
    _, kept = _run(EngineArgs(model=model), specs)
    engine = Engine(EngineArgs(model=model, release_swa_blocks=True, max_num_batched_tokens=64))
    for spec in specs:
        engine.add_request(spec)
    nulls = 0
    while engine.has_unfinished():
        engine.step()
        nulls = max(nulls, sum(t[1].count(NULL_BLOCK) for t in engine.kv.tables.values()))
    assert nulls > 0
    assert engine.leaked_blocks() == 0 and not engine.scheduler.requests
    released = Engine(EngineArgs(model=model, release_swa_blocks=True, max_num_batched_tokens=64)).run(specs)
    for k in kept:
        assert torch.equal(_logits(kept[k]), _logits(released[k]))


def test_preemption_recomputes_and_gives_identical_outputs() -> None:
    model = ModelConfig(sliding_window=32)
    specs = _specs(n=4, base=60, step=10, max_tokens=24)
    _, roomy = _run(EngineArgs(model=model), specs)
    engine, tight = _run(EngineArgs(model=model, num_blocks=24, max_num_batched_tokens=64), specs)
    assert sum(r.num_preemptions for r in tight.values()) > 0
    assert engine.leaked_blocks() == 0
    for k in roomy:
        assert tight[k].output_token_ids == roomy[k].output_token_ids
        assert torch.equal(_logits(tight[k]), _logits(roomy[k]))


def test_every_block_returns_to_the_pool() -> None:
    engine, done = _run(EngineArgs(num_blocks=64), _specs(n=6))
    assert len(done) == 6 and all(r.finish_reason == "length" for r in done.values())
    assert engine.leaked_blocks() == 0 and engine.kv.pool.num_free == 63


def test_requests_that_cannot_fit_are_refused() -> None:
    engine = Engine(EngineArgs(num_blocks=8))
    with pytest.raises(ValueError, match="block pool"):
        engine.add_request(RequestSpec("big", tuple(range(1, 200)), 4))
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(EngineArgs()).add_request(RequestSpec("long", tuple([1] * 1020), 8))
    with pytest.raises(ValueError, match="duplicate"):
        e = Engine(EngineArgs())
        e.add_request(RequestSpec("x", (1, 2), 1))
        e.add_request(RequestSpec("x", (1, 2), 1))


def test_block_pool_rejects_double_free_and_keeps_the_null_block() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert ids is not None and NULL_BLOCK not in ids
    assert pool.allocate(1) is None
    pool.free([*ids, NULL_BLOCK])
    with pytest.raises(RuntimeError, match="twice"):
        pool.free([ids[0]])


def test_tiled_matmul_is_row_invariant() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 64, generator=gen), torch.randn(64, 96, generator=gen)
    whole = tiled_matmul(x, w)
    assert torch.equal(whole[5:6], tiled_matmul(x[5:6], w))
    assert torch.equal(whole[17:53], tiled_matmul(x[17:53], w))
    assert torch.allclose(whole, x @ w, atol=1e-4)


def test_kv_cache_config_describes_the_groups() -> None:
    engine = Engine(EngineArgs(model=ModelConfig(sliding_window=32, num_layers=4)))
    groups = engine.kv_cache_config.kv_cache_groups
    assert [g.layer_names for g in groups] == [("model.layers.0.self_attn", "model.layers.2.self_attn"),
                                               ("model.layers.1.self_attn", "model.layers.3.self_attn")]
    assert str(groups[1].kind) == "sliding_window"
    shape = engine.kv_caches["model.layers.1.self_attn"].shape
    assert tuple(shape) == (2, engine.args.num_blocks, 16, 2, 16)
