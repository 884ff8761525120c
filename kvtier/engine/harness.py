"""Conformance harness: run a workload with and without a connector and compare everything that matters.

    result = run_conformance(KVTierPair(cfg), waves, EngineArgs(model=ModelConfig(sliding_window=64)))
    assert result.passed, result.failures

Waves run one after another (a wave starts when the previous one finished and its saves came back), so a later
wave can hit what an earlier one stored. Checks: every request finishes; generated tokens identical to the
no-connector run; logits exactly equal in float32 (within ``tolerance`` in bfloat16); no block leaked; external
hits where expected; load failures (if expected) happened and were recomputed with identical outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.engine.core import ConnectorBuilder, Engine, EngineArgs, RequestSpec
from kvtier.engine.scheduler import EngineRequest
from kvtier.engine.types import KVTransferConfig
from kvtier.engine.workload import shared_prefix_waves

BF16_TOLERANCE = 0.05  # absolute, on logits of order 1; bfloat16 runs are exact in practice, this is a bound


@dataclass(frozen=True)
class RunRecord:
    """One engine run of a workload."""

    requests: dict[str, EngineRequest]
    leaked_blocks: int
    steps: int
    stats: dict[str, Any]


@dataclass
class ConformanceResult:
    """Figures of one conformance run; ``failures`` lists every failed check in words."""

    num_requests: int
    finished: int
    tokens_identical: bool
    logits_identical: bool
    max_logit_diff: float
    tolerance: float
    leaked_blocks: int
    external_hit_tokens: int
    requests_with_hits: int
    load_failures: int
    preemptions: int
    steps: int
    stats: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)
        return (f"{verdict} | {self.finished}/{self.num_requests} finished, tokens identical "
                f"{self.tokens_identical}, max logit diff {self.max_logit_diff:.3g} (tol {self.tolerance}), "
                f"external hit tokens {self.external_hit_tokens} in {self.requests_with_hits} requests, "
                f"load failures {self.load_failures}, preemptions {self.preemptions}, leaked blocks "
                f"{self.leaked_blocks}")


WaveHook = Callable[[int], None]
StepHook = Callable[[Engine], None]


def run_waves(engine: Engine, waves: Sequence[Sequence[RequestSpec]], between_waves: WaveHook | None = None,
              on_step: StepHook | None = None) -> RunRecord:
    """Run each wave to completion on ``engine`` (``between_waves(i)`` after wave ``i``), then close it."""
    done: dict[str, EngineRequest] = {}
    try:
        for i, wave in enumerate(waves):
            done.update(engine.run(wave, on_step))
            if between_waves is not None:
                between_waves(i)
        return RunRecord(done, engine.leaked_blocks(), engine.num_steps, dict(engine.stats.data))
    finally:
        engine.close()


def compare(base: RunRecord, other: RunRecord, tolerance: float) -> tuple[bool, bool, float, list[str]]:
    """(tokens identical, logits identical, max |diff|, failures) of ``other`` against ``base``."""
    failures: list[str] = []
    tokens_same, logits_same, worst = True, True, 0.0
    for req_id, ref in base.requests.items():
        got = other.requests.get(req_id)
        if got is None:
            failures.append(f"{req_id} did not finish")
            tokens_same = False
            continue
        if got.output_token_ids != ref.output_token_ids:
            tokens_same = False
            failures.append(f"{req_id}: tokens {got.output_token_ids} != {ref.output_token_ids}")
        n = min(len(ref.logits), len(got.logits))
        a, b = torch.stack(ref.logits[:n]), torch.stack(got.logits[:n])
        if n != len(ref.logits) or n != len(got.logits) or not torch.equal(a, b):
            logits_same = False
            worst = max(worst, float((a - b).abs().max()) if n else float("inf"))
    if worst > tolerance:
        failures.append(f"logits differ by {worst:.3g} > tolerance {tolerance}")
    return tokens_same, logits_same, worst, failures


def run_conformance(connector: ConnectorBuilder | None, waves: Sequence[Sequence[RequestSpec]] | None = None,
                    args: EngineArgs | None = None, *, kv_transfer_config: KVTransferConfig | None = None,
                    expect_hits: bool = True, expect_load_failures: bool = False,
                    tolerance: float | None = None, between_waves: WaveHook | None = None,
                    on_step: StepHook | None = None) -> ConformanceResult:
    """Run ``waves`` without a connector and with ``connector`` (a class or builder; or None with a
    ``kv_transfer_config`` naming one for the factory) and check the connector run against the baseline.

    ``between_waves`` / ``on_step`` run in the connector run only (to inject faults: corrupt records, kill a
    server)."""
    args = args or EngineArgs()
    waves = waves if waves is not None else shared_prefix_waves(args.model)
    if tolerance is None:
        tolerance = 0.0 if args.model.torch_dtype == torch.float32 else BF16_TOLERANCE
    base = run_waves(Engine(args), waves)
    other = run_waves(Engine(args, connector, kv_transfer_config), waves, between_waves, on_step)
    tokens_same, logits_same, worst, failures = compare(base, other, tolerance)
    reqs = list(other.requests.values())
    result = ConformanceResult(
        num_requests=sum(len(w) for w in waves), finished=sum(r.finish_reason == "length" for r in reqs),
        tokens_identical=tokens_same, logits_identical=logits_same, max_logit_diff=worst, tolerance=tolerance,
        leaked_blocks=other.leaked_blocks, external_hit_tokens=sum(r.external_tokens for r in reqs),
        requests_with_hits=sum(r.external_tokens > 0 for r in reqs),
        load_failures=sum(r.num_load_failures for r in reqs), preemptions=sum(r.num_preemptions for r in reqs),
        steps=other.steps, stats=other.stats, failures=failures)
    _check_counts(result, base.leaked_blocks, expect_hits, expect_load_failures)
    return result


def _check_counts(result: ConformanceResult, base_leaks: int, expect_hits: bool, expect_failures: bool) -> None:
    if result.finished != result.num_requests:
        result.failures.append(f"{result.num_requests - result.finished} requests did not finish normally")
    if result.leaked_blocks or base_leaks:
        result.failures.append(f"{result.leaked_blocks} blocks leaked ({base_leaks} without the connector)")
    if expect_hits and result.external_hit_tokens == 0:
        result.failures.append("no external hit although later waves share prefixes with earlier ones")
    if expect_failures and result.load_failures == 0:
        result.failures.append("no load failure was reported although one was expected")
