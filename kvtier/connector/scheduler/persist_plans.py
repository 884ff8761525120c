"""Scheduler side of persisting (kvtier.control.persist): each step, copies of the chunks that step saves into a memory
tier are planned into the persistent tier below it in their group's placement, and shipped with the step's metadata.

Lifecycle (``TieredConnector`` calls it around the scheduler half, under write-back with ``persist_after_idle`` or
``persist_at_close`` set):
    attach(meta)     after ``build_connector_meta``: the step's engine saves into memory tiers get a copy planned
                     (``plan_copies``: the disk reserves the bytes, its victims are chosen and demoted); a save
                     that evicts from memory a chunk whose copy has not run gets a move of it into the copy's tier
                     first (the demotion the directory did not plan: it holds the copy's room); returned as
                     ``PersistingMetadata`` (the step's plans plus ``persists``)
    note(report)     from ``update_connector_output``: each copy becomes READY once every worker rank reported it
                     (its copy, or the save that moved it; written by at least one), or is forgotten when none
                     wrote it

The worker runs the copies while the engine is idle and at shutdown (kvtier.connector.worker.persisting); the directory
counts each from its plan on, as any write, so capacity stays counted and placement never plans the chunk twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvtier.config import KvtierConfig
from kvtier.connector.plans import KVTierMetadata, PersistingMetadata, SaveSpec
from kvtier.connector.report import WorkerReport
from kvtier.control.directory import Directory, StorePlan
from kvtier.control.persist import copy_target, enabled, plan_copies
from kvtier.layout import KVCacheConfig
from kvtier.records.keys import Key
from kvtier.tiers.base import Tier


class PersistPlanner:
    """Plans the copies of memory chunks into disk and settles them from the workers' reports."""

    def __init__(self, cfg: KvtierConfig, kcc: KVCacheConfig, directory: Directory, tiers: Mapping[str, Tier], *,
                 tp_size: int = 1, reports: bool = True) -> None:
        """``reports=False`` when the workers' store shares ``directory`` (one process): it completes the copies
        there itself."""
        self._directory = directory
        self._tiers = dict(tiers)
        self._tp_size = max(1, tp_size)
        self._reports = reports
        self._nbytes = [g.bytes_per_chunk(cfg.chunk_size) for g in kcc.kv_cache_groups]
        self._targets: list[dict[str, tuple[str, list[str]]]] = []
        for group in kcc.kv_cache_groups:
            chain = [n for n in cfg.tiers_for(group.kind) if n in self._tiers]
            found = {n: copy_target(chain, n, self._persistent) for n in chain if self._tiers[n].is_memory}
            self._targets.append({n: t for n, t in found.items() if t is not None})
        self._copies: dict[Key, _Copy] = {}  # planned and not settled
        self._reported: dict[Key, dict[str, bool]] = {}  # rank -> written, of copies some ranks reported

    @property
    def active(self) -> bool:
        """Whether any group's placement has a memory tier with a persistent tier below it."""
        return any(self._targets)

    def _persistent(self, name: str) -> bool:
        tier = self._tiers[name]
        return not tier.is_memory and not tier.is_shared

    def attach(self, meta: KVTierMetadata) -> KVTierMetadata:
        """``meta`` with the copies of its saves into memory tiers planned, and every eviction of a chunk whose
        copy has not run yet preceded by its move into the copy's tier (unchanged when there is neither)."""
        saves = [self._with_moves(spec) for spec in meta.saves]
        persists = self.plan(saves)
        if not persists and all(a is b for a, b in zip(saves, meta.saves, strict=True)):
            return meta
        out = PersistingMetadata.of(meta, persists)
        out.saves = saves
        return out

    def _with_moves(self, spec: SaveSpec) -> SaveSpec:
        """``spec`` with a move (``source`` the memory tier) before each plan evicting chunks whose copy waits: the
        save job writes them as a demotion would (in order, off the engine's step), and the copy is dropped."""
        plans: list[StorePlan] = []
        for plan in spec.plans:
            moved: dict[str, list[Key]] = {}
            for key in plan.evicted:
                copy = self._copies.get(key)
                if copy is not None and copy.source == plan.tier and not copy.moved:
                    moved.setdefault(copy.target, []).append(key)
                    copy.moved = True
                    if not self._reports:  # one process: the store completes the move itself
                        del self._copies[key]
            plans.extend(StorePlan(target, tuple(keys), (), plan.tier) for target, keys in moved.items())
            plans.append(plan)
        return spec if len(plans) == len(spec.plans) else replace(spec, plans=tuple(plans))

    def plan(self, saves: Sequence[SaveSpec]) -> list[StorePlan]:
        """Copy plans of the chunks ``saves`` write from the engine into a memory tier, where a persistent tier
        lies below it and does not hold them yet."""
        plans: list[StorePlan] = []
        for spec in saves:
            targets = self._targets[spec.group] if spec.group < len(self._targets) else {}
            for save in spec.plans:
                target = targets.get(save.tier)
                if target is None or save.source is not None:
                    continue
                name, below = target
                size = self._tiers[name].stored_size(self._nbytes[spec.group])
                entries = [(k, size, self._directory.parent(save.tier, k)) for k in save.store
                           if not self._directory.holds(name, k)]
                made = plan_copies(self._directory, save.tier, name, below, entries) if entries else []
                self._copies.update((k, _Copy(save.tier, name)) for p in made if p.source == save.tier
                                    for k in p.store)
                plans.extend(made)
        return plans

    def note(self, report: WorkerReport | None) -> None:
        """Settle the copies the workers reported, by their copy or, once moved, by the save that moved them:
        READY once every rank reported (and one wrote it), else forgotten."""
        if report is None:
            return
        rows = [(tier, key, rank, ok, False) for tier, key, rank, ok in report.persisted]
        rows += [(tier, key, rank, True, True) for _, tier, key, rank in report.stored_saves]
        rows += [(tier, key, rank, False, True) for _, tier, key, rank in report.failed_saves]
        done: dict[tuple[str, bool], list[Key]] = {}
        for tier, key, rank, ok, by_save in rows:
            copy = self._copies.get(key)
            if copy is None or copy.target != tier or copy.moved != by_save:
                continue
            ranks = self._reported.setdefault(key, {})
            ranks[rank] = ranks.get(rank, False) or ok
            if len(ranks) >= self._tp_size or not self._reports:
                del self._reported[key], self._copies[key]
                done.setdefault((tier, any(ranks.values())), []).append(key)
        for (tier, ok), keys in done.items():
            if self._reports:  # one process: the store has completed them itself
                self._directory.complete_store(tier, keys, ok)


@dataclass
class _Copy:
    """A copy planned from ``source`` into ``target``; ``moved``: an eviction made it a move in a save job."""

    source: str
    target: str
    moved: bool = False

def planner_for(cfg: KvtierConfig, kcc: KVCacheConfig, directory: Directory, tiers: Mapping[str, Tier], *,
                tp_size: int = 1, reports: bool = True) -> PersistPlanner | None:
    """A planner when ``cfg`` persists and some group's placement has a memory tier with a disk below it."""
    if not enabled(cfg.policy):
        return None
    planner = PersistPlanner(cfg, kcc, directory, tiers, tp_size=tp_size, reports=reports)
    return planner if planner.active else None
