"""The hit rule per group kind (kvtier.connector.scheduler.hits): what each group must find for a hit of ``n`` chunks."""

from __future__ import annotations

from kvtier.connector.scheduler.hits import GroupNeed, best_hit, hit_limit
from kvtier.layout import GroupKind

C = 16
FULL, MAMBA = GroupNeed(GroupKind.FULL_ATTENTION), GroupNeed(GroupKind.MAMBA)


def test_a_recurrent_group_needs_only_its_state_at_the_hit_point() -> None:
    assert list(MAMBA.needed(3, C)) == [2] and list(MAMBA.needed(0, C)) == []
    assert MAMBA.accepts(3, [False, False, True], C) and not MAMBA.accepts(2, [False, False, True], C)


def test_a_hybrid_hit_is_the_longest_boundary_where_kv_and_state_are_both_present() -> None:
    kv = [True] * 5
    assert best_hit([FULL, MAMBA], [kv, [False, True, False, True, False]], C, limit=5) == 4
    assert best_hit([FULL, MAMBA], [[*kv[:3], False, True], [False, True, False, True, False]], C, limit=5) == 2
    # a state whose attention prefix is missing is useless, and the reverse
    assert best_hit([FULL, MAMBA], [[False, True, True], [True, True, True]], C, limit=3) == 0
    assert best_hit([FULL, MAMBA], [[True] * 3, [False] * 3], C, limit=3) == 0


def test_every_state_group_must_have_its_state() -> None:
    kv, states = [True] * 4, [False, True, True, True]
    assert best_hit([FULL, MAMBA, MAMBA], [kv, states, [False, True, False, False]], C, limit=4) == 2


def test_the_limit_keeps_one_token_to_compute() -> None:
    assert hit_limit(4 * C, C) == 3
    assert best_hit([FULL, MAMBA], [[True] * 4, [True] * 4], C, limit=hit_limit(4 * C, C)) == 3
    assert best_hit([FULL, MAMBA], [[True] * 4, [False, False, False, True]], C, limit=3) == 0
