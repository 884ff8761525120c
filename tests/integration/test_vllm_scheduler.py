"""vLLM 0.33's real Scheduler drives kvtier's scheduler half; kvtier's worker half runs in-process on CPU tensors.

What is real: vLLM's VllmConfig, KVConnectorFactory, Scheduler (block allocation, connector calls, finished-request
handling), both halves of kvtier's connector (separate instances sharing nothing but the config, as in vLLM's
two processes) and kvtier's tiers. What stands in: the model runner. Each step this test does what vLLM's
KVConnectorModelRunnerMixin does with the worker connector (bind, start_load_kv, wait_for_save,
get_transfer_results, get_block_ids_with_load_errors, clear), a fake "forward pass" writes a known pattern into
the paged CPU tensors of the tokens computed this step, and the result goes back through
``Scheduler.update_from_output`` as a real ``ModelRunnerOutput`` with a ``KVConnectorOutput``.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.connector.plans import KVTierMetadata
from kvtier.integrations.vllm import KVTierConnector

RUNNER_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}  # vLLM 0.33

PREFIX = [(7 * i) % 900 + 1 for i in range(64)]  # 4 chunks of 16 tokens
TIERS = {
    "cpu": "[{name: cpu, kind: cpu, capacity: 4MiB}]",
    "disk": "[{name: disk, kind: disk, capacity: 16MiB, path: %s}]",
}


def fill_value(token: int, layer: int, kv: int) -> float:
    """The pattern the fake forward pass writes for one token (exact in float16)."""
    return float(token % 256) + 0.5 * kv + 0.25 * (layer % 2)


class Engine:
    """The real Scheduler plus kvtier's worker half, stepped like vLLM's engine core."""

    def __init__(self, cfg: Any, kcc: Any, kit: Any, kernel_block_size: int | None = None,
                 registered: dict[str, torch.Tensor] | None = None) -> None:
        cfg.cache_config.num_gpu_blocks = kcc.num_blocks
        self.kcc, self.kit = kcc, kit
        self.scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                                   structured_output_manager=StructuredOutputManager(cfg), block_size=kit.BLOCK_SIZE)
        self.worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
        self.kv = kit.kv_views(kcc, kernel_block_size)  # vLLM's own allocation: [B, H, N, C] views
        self.worker.register_kv_caches(self.kv if registered is None else registered)
        self.metadata: list[Any] = []
        self.stats: list[Any] = []  # the worker's connector stats of each step that had some

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1) -> None:
        self.scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                           None))

    def step(self) -> Any:
        so = self.scheduler.schedule()
        self.metadata.append(so.kv_connector_metadata)
        # The metadata crosses a process boundary in vLLM: hand the worker a pickled copy.
        self.worker.bind_connector_metadata(pickle.loads(pickle.dumps(so.kv_connector_metadata)))
        self.worker.start_load_kv(None)
        self.after_load(so)
        self.forward(so)
        if so.num_scheduled_tokens:
            self.worker.wait_for_save()
        results = self.worker.get_transfer_results(so.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        report = self.worker.build_connector_worker_meta()  # as vLLM's runner: the worker-metadata hook
        self.worker.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        stats = self.worker.get_kv_connector_stats()
        if stats is not None:
            self.stats.append(stats)
        output = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                   finished_recving=results.finished_recving or None, invalid_block_ids=errors,
                                   kv_connector_stats=stats, kv_connector_worker_meta=report)
        index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if RUNNER_HAS_INDEX else {}  # gone in 0.34
        self.scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[[5] for _ in ids], kv_connector_output=output, **index))
        return so

    def after_load(self, so: Any) -> None:
        """Hook for checks between the load and the forward pass."""

    def forward(self, so: Any) -> None:
        """Write the pattern of every token computed this step into its block in every layer."""
        for req_id, count in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            end = request.num_computed_tokens
            tokens = request.all_token_ids
            for g, group in enumerate(self.kcc.kv_cache_groups):
                blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[g]
                for pos in range(end - count, min(end, len(tokens))):
                    block, offset = blocks[pos // self.kit.BLOCK_SIZE], pos % self.kit.BLOCK_SIZE
                    for name in group.layer_names:
                        layer = int(name.split(".")[2])
                        for kv in (0, 1):
                            self.kit.token_cell(self.kv[name], block, offset, kv).fill_(
                                fill_value(tokens[pos], layer, kv))

    def run(self, timeout_s: float = 30.0) -> Iterator[Any]:
        """Step until no request is left. Steps that compute nothing wait on kvtier's background saves or
        loads, so they idle a moment, as an engine with no work would."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still pending after {timeout_s}s: {list(self.scheduler.requests)}")
            so = self.step()
            if not so.num_scheduled_tokens:
                time.sleep(0.005)
            yield so

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


def expected_blocks(kit: Any, kv: dict[str, torch.Tensor], name: str, blocks: list[int], tokens: list[int]) -> bool:
    layer, bs = int(name.split(".")[2]), kit.BLOCK_SIZE
    for i, block in enumerate(blocks):
        for offset in range(bs):
            for kv_index in (0, 1):
                cell = kit.token_cell(kv[name], block, offset, kv_index)
                if not torch.all(cell == fill_value(tokens[i * bs + offset], layer, kv_index)):
                    return False
    return True


CASES = [("cpu", layout, None) for layout in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")]
CASES += [("cpu", "LBHNC", 8), ("cpu", "LBNHC", 8), ("disk", "LBHNC", None)]


def _compute_and_save_r1(engine: Any) -> None:
    """r1 computes the 64-token prefix and saves its 4 chunks in both groups; then its blocks are zeroed."""
    engine.add("r1", PREFIX)
    steps = list(engine.run())
    assert steps[0].num_scheduled_tokens == {"r1": 64}
    first = engine.metadata[0]
    assert isinstance(first, KVTierMetadata)
    assert sorted({s.group for s in first.saves}) == [0, 1]
    assert all(len(s.keys) == 4 for s in first.saves)
    for tensor in engine.kv.values():  # the engine reuses the blocks: nothing of r1 is left in them
        tensor.zero_()


@pytest.mark.parametrize(("tier", "layout", "kernel"), CASES)
def test_second_request_loads_the_first_ones_chunks_in_every_group(tier: str, layout: str, kernel: int | None,
                                                                   kit: Any, make_vllm_config: Any,
                                                                   kvtier_config_file: Any, tmp_path: Any) -> None:
    """Every KV-cache layout vLLM can resolve, and kernel blocks of half a scheduler block: the views come from
    vLLM's own planner and allocator, the hit restores exactly the first request's KV in both groups."""
    tiers = TIERS[tier] % (tmp_path / "kv") if tier == "disk" else TIERS[tier]
    # Local prefix caching off: the second request's hit can only come from kvtier.
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file(tiers=tiers), serve_without_prefix_caching=True),
                           prefix_caching=False)
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    kcc = kit.planned_kv_cache_config(hybrid=True, layout=layout)
    engine = Engine(cfg, kcc, kit, kernel)
    try:
        assert isinstance(engine.scheduler.connector, KVTierConnector)
        # A failed load (dead tier, corrupt record) recomputes instead of failing the request.
        assert engine.scheduler.recompute_kv_load_failures is True
        _compute_and_save_r1(engine)
        loaded: dict[int, list[int]] = {}
        sources: list[Any] = []

        def check_after_load(so: Any) -> None:
            if "r2" not in so.num_scheduled_tokens:
                return
            # where the hit comes from, as vLLM's prompt_tokens_cached_by_source counts it
            sources.append(engine.scheduler.connector.get_external_cache_hit_sources(
                engine.scheduler.requests["r2"], 64))
            ids = engine.scheduler.kv_cache_manager.get_block_ids("r2")
            for g, group in enumerate(kcc.kv_cache_groups):
                for name in group.layer_names:
                    assert expected_blocks(kit, engine.kv, name, ids[g][:4], PREFIX), (g, name)
                loaded[g] = ids[g][:4]

        engine.after_load = check_after_load  # type: ignore[method-assign]
        engine.add("r2", [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6])
        steps = list(engine.run())
        compute_step = next(s for s in steps if "r2" in s.num_scheduled_tokens)
        assert compute_step.num_scheduled_tokens == {"r2": 8}  # 64 of 72 tokens came from kvtier
        assert set(loaded) == {0, 1} and all(0 not in ids for ids in loaded.values())
        assert sources == [{CacheHitSource.HOST if tier == "cpu" else CacheHitSource.DISK: 64}]
        loads = [spec for meta in engine.metadata for spec in meta.loads if spec.req_id == "r2"]
        assert {spec.group for spec in loads} == {0, 1}
        assert {spec.group: [b for (b,) in spec.block_ids] for spec in loads} == loaded
        assert all(spec.is_async for spec in loads)  # two groups: vLLM takes a failed load only per request
        assert not engine.scheduler.requests
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == kcc.num_blocks - 1  # no leaked blocks
    finally:
        engine.close()


def legacy_tensors(kcc: Any, kit: Any) -> dict[str, torch.Tensor]:
    """Pre-0.32 ``[2, blocks, block, heads, head]`` tensors: not what this engine's layout says."""
    return {name: torch.zeros(2, kcc.num_blocks, kit.BLOCK_SIZE, 2, 32, dtype=torch.float16)
            for group in kcc.kv_cache_groups for name in group.layer_names}


def test_kv_tensors_kvtier_cannot_read_disable_it_and_the_engine_still_serves(
        kit: Any, make_vllm_config: Any, kvtier_config_file: Any, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file(), serve_without_prefix_caching=True),
                           prefix_caching=False)
    kcc = kit.planned_kv_cache_config(hybrid=True)
    with caplog.at_level("ERROR"):
        engine = Engine(cfg, kcc, kit, registered=legacy_tensors(kcc, kit))
    try:
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "kvtier is disabled" in r.getMessage()]
        assert len(errors) == 1 and "LBHNC" in errors[0].getMessage()
        engine.add("r1", PREFIX)
        list(engine.run())
        engine.add("r2", [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6])
        steps = list(engine.run())
        assert next(s for s in steps if "r2" in s.num_scheduled_tokens).num_scheduled_tokens == {"r2": 72}  # no hit
        sched = engine.scheduler.connector._scheduler
        assert sched.disabled is True
        assert sched.directory.used_bytes("cpu") == 0  # r1's planned saves were forgotten
        assert not [spec for meta in engine.metadata[1:] for spec in meta.saves]  # no saves planned after step 1
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == kcc.num_blocks - 1  # no leaked blocks
    finally:
        engine.close()


def test_strict_mode_fails_the_start_on_kv_tensors_kvtier_cannot_read(kit: Any, make_vllm_config: Any,
                                                                      kvtier_config_file: Any) -> None:
    from kvtier.errors import ConnectorError

    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file(), strict=True, serve_without_prefix_caching=True),
                           prefix_caching=False)
    kcc = kit.planned_kv_cache_config(hybrid=True)
    with pytest.raises(ConnectorError, match="LBHNC"):
        Engine(cfg, kcc, kit, registered=legacy_tensors(kcc, kit))


@pytest.mark.parametrize(("chunked_prefill", "opt_in", "hits"), [(False, False, False), (False, True, False),
                                                                  (True, False, False), (True, True, True)])
def test_an_engine_that_cannot_prefill_after_a_cached_prefix_gets_no_hits_and_saves_nothing(
        chunked_prefill: bool, opt_in: bool, hits: bool, kit: Any, make_vllm_config: Any, kvtier_config_file: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM turns prefix caching and chunked prefill both off when its attention cannot compute on a cached
    prefix (its CPU platform does so for MLA without AMX): kvtier then loads and saves nothing, and says so once,
    whatever its config says. Prefix caching alone off (vLLM's choice for some models, or the operator's) is
    served only with ``serve_without_prefix_caching: true``; then the engine hits."""
    transfer = kit.kvtier_transfer(kvtier_config_file(), serve_without_prefix_caching=opt_in)
    cfg = make_vllm_config(transfer, prefix_caching=False, chunked_prefill=chunked_prefill)
    kcc = kit.planned_kv_cache_config(hybrid=True)
    with caplog.at_level("WARNING"):
        engine = Engine(cfg, kcc, kit)
    try:
        said = [r.getMessage() for r in caplog.records if "kvtier loads and saves nothing" in r.getMessage()]
        assert len(said) == (0 if hits else 1)
        if not hits:
            assert ("chunked prefill both off" if not chunked_prefill else "serve_without_prefix_caching") in said[0]
        engine.add("r1", PREFIX)
        list(engine.run())
        engine.add("r2", [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6])
        steps = list(engine.run())
        computed = next(s for s in steps if "r2" in s.num_scheduled_tokens).num_scheduled_tokens["r2"]
        loads = [spec for meta in engine.metadata for spec in meta.loads]
        saves = [spec for meta in engine.metadata for spec in meta.saves]
        if hits:
            assert computed == 8 and loads and saves
        else:
            assert computed == 72 and not loads and not saves
    finally:
        engine.close()


def _first_engine_saves_the_prefix(kit: Any, make_vllm_config: Any, kvtier_config_file: Any, tiers: str,
                                   kcc: Any) -> None:
    """An engine with kvtier on ``tiers`` computes PREFIX and stops (its saves land in the tiers)."""
    first = Engine(make_vllm_config(kit.kvtier_transfer(kvtier_config_file(tiers=tiers))), kcc, kit)
    try:
        first.add("r1", PREFIX)
        list(first.run())
    finally:
        first.close()


def test_with_the_engines_prefix_cache_on_a_new_engine_hits_from_kvtier(
        kit: Any, make_vllm_config: Any, kvtier_config_file: Any, tmp_path: Any) -> None:
    """The deployed setting: vLLM's prefix cache on. A second engine (a new Scheduler, its own cache empty) gets
    the first one's prefix from kvtier's disk tier."""
    tiers = TIERS["disk"] % (tmp_path / "kv")
    kcc = kit.planned_kv_cache_config(hybrid=True)
    _first_engine_saves_the_prefix(kit, make_vllm_config, kvtier_config_file, tiers, kcc)
    second = Engine(make_vllm_config(kit.kvtier_transfer(kvtier_config_file(tiers=tiers))), kcc, kit)
    try:
        second.add("r2", [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6])
        steps = list(second.run())
        assert next(s for s in steps if "r2" in s.num_scheduled_tokens).num_scheduled_tokens == {"r2": 8}
        assert {spec.group for meta in second.metadata for spec in meta.loads} == {0, 1}
    finally:
        second.close()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_request_hits_the_prefix_of_one_still_decoding(tier: str, kit: Any, make_vllm_config: Any,
                                                         kvtier_config_file: Any, tmp_path: Any) -> None:
    """vLLM's prefix cache off: r1 prefills the prefix and goes on decoding; r2, sent meanwhile, loads r1's chunks
    from kvtier as soon as the worker reports them written (vLLM's own cache would serve them then too), not when
    r1 ends: r2 computes only its 8 new tokens while r1 is still running, and its blocks hold r1's KV before its
    forward pass."""
    tiers = TIERS[tier] % (tmp_path / "kv") if tier == "disk" else TIERS[tier]
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file(tiers=tiers), serve_without_prefix_caching=True),
                           prefix_caching=False)
    kcc = kit.planned_kv_cache_config(hybrid=True)
    engine = Engine(cfg, kcc, kit)
    try:
        engine.add("r1", PREFIX, max_tokens=400)  # decodes long enough for r2's asynchronous load
        assert engine.step().num_scheduled_tokens == {"r1": 64}
        half = engine.scheduler.connector._scheduler

        def written() -> bool:  # every group's 4 chunks reported written by the worker (one job per group)
            return all(half.directory.lookup(keys[:4], [tier]) == [tier] * 4 for keys in half._requests["r1"].keys)

        for _ in range(200):  # decode steps until the worker's reports of the written chunks have arrived
            if written():
                break
            assert engine.step().num_scheduled_tokens == {"r1": 1}
            time.sleep(0.005)
        assert written() and "r1" in engine.scheduler.requests
        loaded: list[bool] = []

        def check_after_load(so: Any) -> None:
            if "r2" in so.num_scheduled_tokens:
                ids = engine.scheduler.kv_cache_manager.get_block_ids("r2")
                loaded.extend(expected_blocks(kit, engine.kv, name, ids[g][:4], PREFIX)
                              for g, group in enumerate(kcc.kv_cache_groups) for name in group.layer_names)

        engine.after_load = check_after_load  # type: ignore[method-assign]
        engine.add("r2", [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6])
        for _ in range(200):
            so = engine.step()
            if "r2" in so.num_scheduled_tokens:
                break
            time.sleep(0.005)
        assert so.num_scheduled_tokens["r2"] == 8 and "r1" in engine.scheduler.requests  # r1 still decoding
        assert loaded and all(loaded)
        list(engine.run())
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == kcc.num_blocks - 1  # no leaked blocks
    finally:
        engine.close()


def test_the_connector_hooks_vllm_034_added(kit: Any, make_vllm_config: Any, kvtier_config_file: Any,
                                            tmp_path: Any) -> None:
    """vLLM 0.34 asks ``may_load_async`` (yes for a prefix on disk, no for one nowhere) and
    ``supports_lookahead_block_hashes`` (no: kvtier keys chunks from tokens, so its hit is the same whatever block
    hashes vLLM gives the request, none, plain or with lookahead tokens); on 0.33, where vLLM never asks, the
    answers are the same."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    tiers = TIERS["disk"] % (tmp_path / "kv")
    kcc = kit.planned_kv_cache_config(hybrid=False)
    _first_engine_saves_the_prefix(kit, make_vllm_config, kvtier_config_file, tiers, kcc)
    cfg = make_vllm_config(kit.kvtier_transfer(kvtier_config_file(tiers=tiers)))
    assert KVTierConnector.supports_lookahead_block_hashes(cfg.kv_transfer_config) is False
    second = Engine(cfg, kcc, kit)
    try:
        connector = second.scheduler.connector
        init_none_hash(sha256)
        hashers = [None, get_request_block_hasher(kit.BLOCK_SIZE, sha256),
                   get_request_block_hasher(kit.BLOCK_SIZE, sha256, num_hash_lookahead_tokens=5)]
        prompt = [*PREFIX, 3, 1, 4]
        requests = [Request(f"h{i}", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
                    for i, hasher in enumerate(hashers)]
        assert len({tuple(r.block_hashes) for r in requests}) >= 2  # vLLM's hashes differ...
        assert {connector.get_num_new_matched_tokens(r, 0) for r in requests} == {(len(PREFIX), True)}  # ...not kvtier's
        assert all(connector.may_load_async(r) for r in requests)
        elsewhere = Request("new", [(5 * i) % 900 + 2 for i in range(64)], SamplingParams(max_tokens=1), None)
        assert connector.may_load_async(elsewhere) is False
    finally:
        second.close()
