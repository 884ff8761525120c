"""The conformance harness and the engine's connector call order, with the dict-backed test connector."""

from __future__ import annotations

import itertools

import pytest
from dict_connector import DictConnector, NonHMADictConnector, RecordingDictConnector

from kvtier.engine import Engine, EngineArgs, ModelConfig, RequestSpec, run_conformance
from kvtier.engine.types import KVTransferConfig
from kvtier.errors import ConnectorError

_ids = itertools.count()


def _ktc(name: str = "DictConnector", **extra: object) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config={"store": f"s{next(_ids)}", **extra})


FULL, HYBRID = ModelConfig(), ModelConfig(sliding_window=48)


@pytest.mark.parametrize("model", [FULL, HYBRID], ids=["full", "hybrid"])
@pytest.mark.parametrize("extra", [{}, {"async_load": True}, {"delay_free": True},
                                   {"async_load": True, "delay_free": True}],
                         ids=["sync", "async", "delay_free", "async+delay_free"])
def test_dict_connector_passes_the_harness(model: ModelConfig, extra: dict) -> None:
    result = run_conformance(DictConnector, args=EngineArgs(model=model), kv_transfer_config=_ktc(**extra))
    assert result.passed, result.summary()
    assert result.logits_identical and result.max_logit_diff == 0.0
    assert result.external_hit_tokens > 0 and result.requests_with_hits >= 3
    assert result.leaked_blocks == 0 and result.finished == result.num_requests == 8


def test_released_window_blocks_pass_the_harness() -> None:
    args = EngineArgs(model=HYBRID, release_swa_blocks=True, max_num_batched_tokens=64)
    result = run_conformance(DictConnector, args=args, kv_transfer_config=_ktc(async_load=True))
    assert result.passed, result.summary()


@pytest.mark.parametrize("model", [FULL, HYBRID, ModelConfig(dtype="bfloat16", sliding_window=48)],
                         ids=["full", "hybrid", "hybrid-bf16"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_load_errors_are_recomputed_with_identical_outputs(model: ModelConfig, async_load: bool) -> None:
    result = run_conformance(DictConnector, args=EngineArgs(model=model), expect_load_failures=True,
                             kv_transfer_config=_ktc(fail_loads=2, async_load=async_load))
    assert result.passed, result.summary()
    assert result.load_failures == 2 and result.tokens_identical


def test_preemption_with_a_connector_passes() -> None:
    args = EngineArgs(model=HYBRID, num_blocks=90, max_num_batched_tokens=64)
    result = run_conformance(DictConnector, args=args, kv_transfer_config=_ktc(delay_free=True))
    assert result.passed, result.summary()
    assert result.preemptions > 0


def test_harness_catches_a_connector_that_loads_wrong_kv() -> None:
    result = run_conformance(DictConnector, kv_transfer_config=_ktc(corrupt_silently=True))
    assert not result.passed
    assert not result.logits_identical and result.max_logit_diff > 0


def test_harness_reports_missing_hits_and_missing_failures() -> None:
    result = run_conformance(DictConnector, waves=[[RequestSpec("only", tuple(range(1, 40)), 3)]],
                             kv_transfer_config=_ktc(), expect_load_failures=True)
    assert any("no external hit" in f for f in result.failures)
    assert any("no load failure" in f for f in result.failures)


def test_connector_built_through_the_factory_by_module_path() -> None:
    ktc = _ktc()
    ktc.kv_connector_module_path = "dict_connector"
    result = run_conformance(None, kv_transfer_config=ktc)
    assert result.passed, result.summary()


def test_non_hma_connector_is_refused_for_a_hybrid_model_and_works_without() -> None:
    with pytest.raises(ConnectorError, match="SupportsHMA"):
        Engine(EngineArgs(model=HYBRID), NonHMADictConnector, _ktc())
    result = run_conformance(NonHMADictConnector, kv_transfer_config=_ktc(delay_free=True))
    assert result.passed, result.summary()


def _steps(log: list[str]) -> list[list[str]]:
    """Split a call log into worker steps (each starts at bind_connector_metadata)."""
    steps: list[list[str]] = [[]]
    for call in log:
        if call == "worker.bind_connector_metadata":
            steps.append([])
        steps[-1].append(call)
    return steps


def test_hooks_are_called_in_vllm_order() -> None:
    log: list[str] = []
    engine = Engine(EngineArgs(model=HYBRID), RecordingDictConnector, _ktc(call_log=log, async_load=True))
    engine.run([RequestSpec("a", tuple(range(1, 60)), 2)])
    engine.run([RequestSpec("b", (*tuple(range(1, 60)), 7, 8), 2)])
    engine.close()
    sched = [c for c in log if c.startswith("scheduler.")]
    assert log[0] == "worker.register_kv_caches"
    assert sched[:3] == ["scheduler.get_num_new_matched_tokens", "scheduler.update_state_after_alloc",
                         "scheduler.build_connector_meta"]
    assert sched.count("scheduler.request_finished_all_groups") == 2
    assert "scheduler.request_finished" not in sched
    worker_steps = _steps([c for c in log if c.startswith("worker.")])[1:]
    for step in worker_steps:
        tail = ["worker.get_finished", "worker.get_block_ids_with_load_errors", "worker.get_kv_connector_stats",
                "worker.clear_connector_metadata"]
        assert step[:2] == ["worker.bind_connector_metadata", "worker.start_load_kv"]
        assert step[-4:] == tail
        body = step[2:-4]
        if body:  # a forward pass: per layer wait, save; then wait_for_save
            assert body == ["worker.wait_for_layer_load", "worker.save_kv_layer"] * 4 + ["worker.wait_for_save"]
    # the async load parks "b": some steps have no forward pass, and update_state_after_alloc runs twice for it
    assert any(len(step) == 6 for step in worker_steps)
    b_allocs = [c for c in sched if c == "scheduler.update_state_after_alloc"]
    assert len(b_allocs) == 3  # "a" once, "b" twice (allocation, then after its load finished)


def test_fail_policy_finishes_the_affected_request_with_an_error() -> None:
    ktc = _ktc(fail_loads=1)
    args = EngineArgs(kv_load_failure_policy="fail")
    engine = Engine(args, DictConnector, ktc)
    prompt = tuple(range(1, 80))
    first = engine.run([RequestSpec("a", prompt, 2)])
    second = engine.run([RequestSpec("b", prompt, 2)])
    engine.close()
    assert first["a"].finish_reason == "length"
    assert second["b"].finish_reason == "error" and second["b"].output_token_ids == []
    assert engine.leaked_blocks() == 0
