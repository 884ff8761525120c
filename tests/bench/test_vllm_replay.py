"""The replay's workload and modes: one-off prompts mixed into the trace, and the learned-admission mode's config."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench.vllm_replay import _kvtier_yaml, with_one_offs
from kvtier.config import load_config


def test_one_off_prompts_are_mixed_in_at_the_share_asked_and_never_repeat() -> None:
    prompts = [[i] * 4 for i in range(2000)]
    mixed = with_one_offs(prompts, 0.5, 64)
    one_offs = [p for p in mixed if len(p) == 64]
    assert [p for p in mixed if len(p) == 4] == prompts  # the trace's prompts, in order
    assert 850 < len(one_offs) < 1150  # 0.5 per trace prompt
    assert len({tuple(p) for p in one_offs}) == len(one_offs)
    assert with_one_offs(prompts, 0.0, 64) == prompts


def test_the_learned_mode_is_the_cpu_mode_with_the_learned_admission(tmp_path: Path) -> None:
    learned = load_config(_kvtier_yaml(tmp_path, "kvtier_cpu_learned", 32, 1 << 30))
    plain = load_config(_kvtier_yaml(tmp_path, "kvtier_cpu", 32, 1 << 30))
    assert (learned.policy.admission, plain.policy.admission) == ("learned", "all")
    assert learned.tiers == plain.tiers
