"""The replay behind ``kvtier bench hit-rate``: a workload through kvtier's own directory and policies, chunk by
chunk, without moving bytes. What it measures and how: :mod:`kvtier.bench.hitrate_cli`, the command (its docstring
is the benchmark's ``--help``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from kvtier.bench.belady import BeladyPolicy, belady_schedule
from kvtier.bench.workloads import Workload
from kvtier.config.tree import PolicyConfig
from kvtier.connector.scheduler.admission import SIZE_BUCKETS, SaveAdmission, request_class
from kvtier.connector.scheduler.hits import hit_limit
from kvtier.control.directory import Directory, TierSlot
from kvtier.control.metrics import snapshot
from kvtier.control.policy import EvictionPolicy, make_policy
from kvtier.ops.progress import progress_bar
from kvtier.records.keys import Key


class DirectoryStack:
    """Tiers of one-chunk slots managed by kvtier's own ``Directory``, each ordered by its own policy."""

    def __init__(self, policies: Sequence[EvictionPolicy], capacities: Sequence[int]) -> None:
        if len(policies) != len(capacities) or not policies:
            raise ValueError("need one capacity per policy, and at least one tier")
        self.capacities = list(capacities)
        self.names = [f"tier{i}" for i in range(len(capacities))]
        slots = [TierSlot(n, c, p) for n, c, p in zip(self.names, capacities, policies, strict=True)]
        self.directory = Directory(slots)
        self._index = {n: i for i, n in enumerate(self.names)}

    def hit_tiers(self, chunks: Sequence[Hashable]) -> list[int]:
        """Tier index of each chunk of the longest held prefix."""
        return [self._index[n] for n in self.directory.lookup(cast("list[Key]", chunks))]

    def _tier_of(self, key: Key) -> str | None:
        for name in self.names:
            if self.directory.contains(name, key):
                return name
        return None

    def store_missing(self, chunks: Sequence[Hashable], parents: Mapping[Hashable, Hashable] | None = None) -> int:
        """Store in tier 0 the chunks no tier holds, in the order given (a prefix's: first chunk first), touching
        none (the scheduler half's save plans skip what a tier holds); how many were stored. A chunk's parent is
        the one before it, or its entry in ``parents`` when given (chunks that are not one prefix)."""
        directory, top, chain = self.directory, self.names[0], self.names[1:]
        stored, parent = 0, None
        for key in cast("list[Key]", chunks):
            if parents is not None:
                parent = cast("Key | None", parents.get(key))
            if self._tier_of(key) is None:
                for plan in directory.prepare_store(top, [(key, 1, parent)], demote_chain=chain):
                    directory.complete_store(plan.tier, plan.store, True)
                stored += 1
            parent = key
        return stored

    def access(self, chunks: Sequence[Hashable]) -> list[Key]:
        """Insert or touch every chunk in prefix order; a hit below tier 0 is promoted to tier 0. Returns the
        chunks tier 0 evicted to make room, in eviction order."""
        directory, top, chain = self.directory, self.names[0], self.names[1:]
        parent: Key | None = None
        evicted: list[Key] = []
        for key in cast("list[Key]", chunks):
            tier = self._tier_of(key)
            if tier == top:
                directory.touch(top, (key,))
            else:
                if tier is not None:
                    directory.remove(tier, (key,))
                for plan in directory.prepare_store(top, [(key, 1, parent)], demote_chain=chain):
                    if plan.tier == top:
                        evicted.extend(plan.evicted)
                    directory.complete_store(plan.tier, plan.store, True)
            parent = key
        return evicted


@dataclass
class ReplayStats:
    """Counters of one replay; rates are fractions of the workload's input tokens or requests."""

    policy: str
    capacities: list[int]
    total_tokens: int = 0
    total_chunks: int = 0
    hit_chunks: int = 0
    hit_tokens: int = 0
    requests: int = 0
    hit_requests: int = 0
    tier_tokens: list[int] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # the directory's (kvtier.control.metrics snapshot)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def chunk_hit_rate(self) -> float:
        """Hit chunks over requested chunks (the per-block rate of the trace README)."""
        return self.hit_chunks / self.total_chunks if self.total_chunks else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    def tier_rates(self, names: Sequence[str]) -> dict[str, float]:
        """Token hit rate attributed to each tier."""
        total = self.total_tokens or 1
        return {n: t / total for n, t in zip(names, self.tier_tokens, strict=True)}


def replay(workload: Workload, stack: DirectoryStack, name: str = "",
           progress: Callable[[int], Any] | None = None) -> ReplayStats:
    """Replay ``workload`` through ``stack``; ``progress(n)`` is called every 1,000 requests. Chunks asked and hit
    are the directory's own counts (one lookup per request): the replay counts tokens and requests."""
    stats = ReplayStats(name, list(stack.capacities), tier_tokens=[0] * len(stack.capacities))
    ct = workload.chunk_tokens
    before = stack.directory.stats.lookups, stack.directory.stats.hits
    for i, req in enumerate(workload.requests, 1):
        tiers = stack.hit_tiers(req.chunks)
        stats.requests += 1
        stats.total_tokens += req.input_len
        if tiers:
            stats.hit_requests += 1
            for j, tier in enumerate(tiers):
                tokens = min(ct, req.input_len - j * ct)
                if tokens > 0:
                    stats.tier_tokens[tier] += tokens
                    stats.hit_tokens += tokens
        stack.access(req.chunks)
        if progress is not None and i % 1000 == 0:
            progress(1000)
    after = stack.directory.stats
    stats.total_chunks, stats.hit_chunks = after.lookups - before[0], after.hits - before[1]
    stats.counters = snapshot(directory=after)
    return stats


def replay_policy(workload: Workload, policy: str, capacities: Sequence[int],
                  progress: Callable[[int], Any] | None = None) -> ReplayStats:
    """Replay with the registered ``policy`` on every tier (capacities in chunks, fastest tier first)."""
    stack = DirectoryStack([make_policy(policy, c) for c in capacities], capacities)
    return replay(workload, stack, policy, progress)


def belady_hit_rate(workload: Workload, capacity: int) -> float:
    """Token hit rate of Belady's offline policy with one tier of ``capacity`` chunks."""
    stack = DirectoryStack([BeladyPolicy(iter(belady_schedule(workload)), capacity)], [capacity])
    return replay(workload, stack, "belady").hit_rate


def ideal_hit_rate(workload: Workload) -> float:
    """Token hit rate of an infinite cache."""
    return ideal_stats(workload).hit_rate


def ideal_stats(workload: Workload) -> ReplayStats:
    """The replay counters of an infinite cache."""
    seen: set[Hashable] = set()
    stats = ReplayStats("infinite", [])
    for req in workload.requests:
        n = 0
        for key in req.chunks:
            if key not in seen:
                break
            n += 1
        stats.requests += 1
        stats.hit_requests += n > 0
        stats.hit_chunks += n
        stats.total_chunks += len(req.chunks)
        stats.hit_tokens += min(n * workload.chunk_tokens, req.input_len)
        stats.total_tokens += req.input_len
        seen.update(req.chunks)
    return stats


# ---- the engine's cache in front, and the save admission ---------------------------------------------


Admission = Literal["all", "learned", "oracle", "evict"]


@dataclass
class AdmissionStats:
    """One replay with vLLM's prefix cache in front of one kvtier tier: what each served, and what kvtier saved
    (chunks written that the tier did not hold) to load what it loaded (chunks past the engine's hit). A learned
    replay also keeps the admission's lag at the end and its classes with at least 1% of the offers."""

    admission: Admission
    engine_chunks: int
    tier_chunks: int
    total_tokens: int = 0
    engine_tokens: int = 0
    kvtier_tokens: int = 0
    saved_chunks: int = 0
    loaded_chunks: int = 0
    offered_chunks: int = 0
    declined_chunks: int = 0
    lag: int | None = None
    classes: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        """The JSON row: counts, and the rates as fractions of the input tokens."""
        total = self.total_tokens or 1
        return {**self.__dict__, "engine_hit_rate": self.engine_tokens / total,
                "kvtier_hit_rate": self.kvtier_tokens / total,
                "hit_rate": (self.engine_tokens + self.kvtier_tokens) / total,
                "saved_per_loaded": self.saved_chunks / self.loaded_chunks if self.loaded_chunks else None}

    def judged(self, gate: SaveAdmission) -> None:
        """Keep ``gate``'s lag and its large classes: offers and reuses in all, as matched now, and the decision."""
        self.lag = gate.lag()
        for cls, offers in enumerate(gate.offers):
            if offers and offers >= self.offered_chunks / 100:
                self.classes.append({"depth_bucket": cls // SIZE_BUCKETS, "size_bucket": cls % SIZE_BUCKETS,
                                     "offers": offers, "reuses": gate.reuses[cls], "matched": list(gate.matched(cls)),
                                     "admitted": gate.admits(cls)})


def replay_admission(workload: Workload, engine_chunks: int, tier_chunks: int, admission: Admission,
                     min_reuse: float = PolicyConfig.admission_min_reuse, loads: set[Hashable] | None = None,
                     only: set[Hashable] | None = None) -> AdmissionStats:
    """Replay ``workload`` through vLLM's prefix cache (an LRU of ``engine_chunks`` blocks, one per chunk, a request's
    freed tail first) in front of one kvtier tier of ``tier_chunks`` (the default policy), as the scheduler half
    plans (kvtier.connector.scheduler.half): a hit stops a chunk short of the prompt's end; kvtier refreshes its
    copies of the engine's hit, serves past it and refreshes what it loads; a request offers the full chunks past
    its reach (the engine's hit and the admission's ghosts) and stores those of its prompt's full chunks the tier
    lacks when ``admission`` is ``all``, or when ``learned`` admits its class; a declined request stores nothing.
    ``loads`` collects the chunks of every prefix kvtier served (its lookup holds them from the first chunk on);
    with ``only`` (``oracle``: the loads of an ``all`` replay, known in advance) a request stores only those.
    ``evict`` saves nothing when a chunk is computed, and each chunk when the engine's cache evicts it, where the
    tier lacks it (offload on evict, the peers' lazy offload: SGLang's HiCache, LMCache's), and looks the tier up
    from the engine's hit on."""
    if (admission == "oracle") != (only is not None):
        raise ValueError("the oracle, and only the oracle, saves only the chunks it is given")
    engine = DirectoryStack([make_policy("lru", engine_chunks)], [engine_chunks])
    tier = DirectoryStack([make_policy(DEFAULT_POLICY, tier_chunks)], [tier_chunks])
    learned = SaveAdmission(tier_chunks, min_reuse) if admission == "learned" else None
    stats = AdmissionStats(admission, engine_chunks, tier_chunks)
    ct = workload.chunk_tokens
    parents: dict[Hashable, Hashable] = {}  # ``evict``: each chunk's parent, for the chunks saved out of order
    for req in workload.requests:
        limit, full = min(len(req.chunks), hit_limit(req.input_len, ct)), min(len(req.chunks), req.input_len // ct)
        keys = cast("list[Key]", list(req.chunks))
        hit = len(engine.hit_tiers(keys[:limit]))
        held = _held(tier, keys[:limit], hit, past_hit=admission == "evict")
        stats.total_tokens += req.input_len
        stats.engine_tokens += hit * ct
        tier.directory.touch(tier.names[0], keys[:hit])  # the engine's own hit: kvtier's copies are in use
        if held > hit:
            stats.loaded_chunks += held - hit
            stats.kvtier_tokens += (held - hit) * ct
            tier.directory.touch(tier.names[0], keys[hit:held])  # the load's hold
            if loads is not None:
                loads.update(keys[:held])
        admitted = learned is None or _admits(learned, stats, keys[:full], hit, limit, req.input_len // ct)
        saves = keys[:full] if admitted and admission != "evict" else []  # declined: only what it loaded, held
        stats.saved_chunks += tier.store_missing([k for k in saves if only is None or k in only])
        evicted = engine.access(keys[full - 1::-1] if full else [])
        if admission == "evict":
            stats.saved_chunks += _save_evicted(tier, keys[:full], evicted, parents)
    if learned is not None:
        stats.judged(learned)
    return stats


def _admits(learned: SaveAdmission, stats: AdmissionStats, keys: Sequence[Key], hit: int, limit: int,
            prompt_chunks: int) -> bool:
    """Whether the learned admission saves a request whose full chunks are ``keys``: its class, by the reach of
    its lookup (the engine's hit and the admission's ghosts) and its prompt's length; it offers the chunks past
    its reach, counted in ``stats``."""
    reach = hit + learned.asked(keys[hit:limit])
    cls = request_class(reach, prompt_chunks)
    admitted = learned.admits(cls)
    learned.offer(cls, keys[reach:])
    stats.offered_chunks += len(keys[reach:])
    stats.declined_chunks += 0 if admitted else len(keys[reach:])
    return admitted


def _held(tier: DirectoryStack, keys: Sequence[Key], hit: int, past_hit: bool) -> int:
    """The chunks of ``keys`` the engine's ``hit`` and the tier serve together: the tier's prefix from the first
    chunk (what kvtier's lookup asks), or with ``past_hit`` its run from the engine's hit on (``evict``: the tier
    lacks what the engine holds, so it is looked up past the engine's hit, as the peers' lazy offload is)."""
    if past_hit:
        return hit + len(tier.hit_tiers(keys[hit:]))
    return len(tier.hit_tiers(keys))


def _save_evicted(tier: DirectoryStack, mine: Sequence[Key], evicted: Sequence[Key],
                  parents: dict[Hashable, Hashable]) -> int:
    """``evict``: save in ``tier`` what the engine evicted for the request whose full chunks are ``mine`` and the
    tier lacks; how many were saved. The request's own chunks are not evicted (its blocks are in use: the LRU
    replay may drop and reinsert one it hit), and a run freed tail first is saved first chunk first."""
    parents.update(zip(mine[1:], mine[:-1], strict=False))
    own = set(mine)
    return tier.store_missing([k for k in reversed(evicted) if k not in own], parents)


def admission_sweep(workload: Workload, engine_shares: Sequence[float], tier_factor: float) -> dict[str, Any]:
    """Per engine memory share (of the unique chunks): the replay with every chunk saved, with the learned
    admission, with an oracle that saves only what the first replay loaded (the bound of any admission), and
    with every chunk saved when the engine evicts it instead of when it is computed,
    kvtier's tier ``tier_factor`` times the engine's memory; the result document."""
    unique = workload.unique_chunks()
    rows = []
    for share in engine_shares:
        engine = max(1, round(share * unique))
        tier = max(1, round(tier_factor * engine))
        loads: set[Hashable] = set()
        every = replay_admission(workload, engine, tier, "all", loads=loads)
        rows += [{"engine_share": share, **stats.row()} for stats in (
            every, replay_admission(workload, engine, tier, "learned"),
            replay_admission(workload, engine, tier, "oracle", only=loads),
            replay_admission(workload, engine, tier, "evict"))]
    return {"workload": workload.name, "chunk_tokens": workload.chunk_tokens, "requests": len(workload.requests),
            "unique_chunks": unique, "tier_factor": tier_factor, "admission": rows}


def admission_table(doc: dict[str, Any]) -> str:
    """A plain-text table of an admission sweep."""
    lines = [f"{doc['workload']}: {doc['requests']} requests, {doc['unique_chunks']} unique chunks of "
             f"{doc['chunk_tokens']} tokens; kvtier's tier {doc['tier_factor']:g}x the engine's memory",
             f"{'engine':>7} {'admission':<9}{'hit %':>7}{'engine':>8}{'kvtier':>8}{'saved':>9}{'loaded':>9}"
             f"{'saved/loaded':>13}{'declined':>10}"]
    for r in doc["admission"]:
        ratio = "-" if r["saved_per_loaded"] is None else f"{r['saved_per_loaded']:.1f}x"
        declined = f"{r['declined_chunks'] / r['offered_chunks']:.0%}" if r["offered_chunks"] else "-"
        lines.append(f"{r['engine_share']:>7.0%} {r['admission']:<9}{100 * r['hit_rate']:>7.1f}"
                     f"{100 * r['engine_hit_rate']:>8.1f}{100 * r['kvtier_hit_rate']:>8.1f}{r['saved_chunks']:>9}"
                     f"{r['loaded_chunks']:>9}{ratio:>13}{declined:>10}")
    return "\n".join(lines)


# ---- sweeps and report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepSpec:
    """What to replay: policies x single-tier capacities, plus optional multi-tier set-ups."""

    policies: tuple[str, ...]
    capacities: tuple[int, ...]
    tier_setups: tuple[tuple[int, ...], ...] = ()
    belady: bool = True


def sweep(workload: Workload, spec: SweepSpec, progress: bool = False) -> dict[str, Any]:
    """Replay every policy at every capacity (and tier set-up); the result document of the JSON output."""
    unique = workload.unique_chunks()
    runs: list[tuple[str, tuple[int, ...]]] = [(p, (c,)) for c in spec.capacities for p in spec.policies]
    runs += [(p, t) for t in spec.tier_setups for p in spec.policies]
    belady: dict[int, float] = {}
    results = []
    with progress_bar(len(runs) * len(workload.requests), unit="req", enabled=progress, leave=False) as update:
        for policy, caps in runs:
            stats = replay_policy(workload, policy, caps, update)
            update(len(workload.requests) % 1000)
            total = sum(caps)
            if spec.belady and total not in belady:
                belady[total] = belady_hit_rate(workload, total)
            results.append({
                "policy": policy, "capacity_chunks": total, "capacity_fraction": total / unique if unique else 0.0,
                "tier_capacities": list(caps), "hit_rate": stats.hit_rate,
                "request_hit_rate": stats.request_hit_rate, "chunk_hit_rate": stats.chunk_hit_rate,
                "belady_hit_rate": belady.get(total),
                "tiers": stats.tier_rates([f"tier{i}" for i in range(len(caps))]),
                "counters": stats.counters,
            })
    ideal = ideal_stats(workload)
    return {"workload": workload.name, "chunk_tokens": workload.chunk_tokens, "requests": len(workload.requests),
            "unique_chunks": unique, "input_tokens": ideal.total_tokens, "ideal_hit_rate": ideal.hit_rate,
            "ideal_chunk_hit_rate": ideal.chunk_hit_rate, "results": results}


def table(doc: dict[str, Any]) -> str:
    """A plain-text table of a sweep document."""
    lines = [f"{doc['workload']}: {doc['requests']} requests, {doc['unique_chunks']} unique chunks of "
             f"{doc['chunk_tokens']} tokens; infinite cache {doc['ideal_hit_rate']:.1%}",
             f"{'policy':<12}{'capacity':>20}{'hit rate':>10}{'req hit':>9}{'belady':>9}  tiers"]
    for r in doc["results"]:
        caps = "+".join(str(c) for c in r["tier_capacities"])
        bel = "" if r["belady_hit_rate"] is None else f"{r['belady_hit_rate']:.1%}"
        tiers = " ".join(f"{k}={v:.1%}" for k, v in r["tiers"].items()) if len(r["tiers"]) > 1 else ""
        caps += f" ({r['capacity_fraction']:.0%})"
        lines.append(f"{r['policy']:<12}{caps:>20}{r['hit_rate']:>10.1%}"
                     f"{r['request_hit_rate']:>9.1%}{bel:>9}  {tiers}")
    return "\n".join(lines)


def bars(docs: Sequence[dict[str, Any]], policy: str) -> list[dict[str, Any]]:
    """Per workload and single-tier capacity: ``policy``'s hit rate beside LRU's and ARC's, and whether it is
    at least both (the bar the default policy must meet)."""
    out = []
    for doc in docs:
        rates: dict[tuple[str, int], float] = {(r["policy"], r["capacity_chunks"]): r["hit_rate"]
                                               for r in doc["results"] if len(r["tier_capacities"]) == 1}
        for (name, cap), rate in rates.items():
            if name == policy and ("lru", cap) in rates and ("arc", cap) in rates:
                lru, arc = rates["lru", cap], rates["arc", cap]
                out.append({"workload": doc["workload"], "capacity_chunks": cap, "capacity_fraction":
                            cap / doc["unique_chunks"], policy: rate, "lru": lru, "arc": arc,
                            "met": rate >= lru and rate >= arc})
    return out


# ---- what the command line (kvtier.bench.hitrate_cli) and the other benchmarks take as defaults ---------------

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"  # package data
TRACE_SOURCE = ("github.com/kvcache-ai/Mooncake, file FAST25-release/traces/conversation_trace.jsonl, saved as "
                "kvtier/bench/traces/mooncake_conversation_trace.jsonl; kvtier's package ships it")
DEFAULT_POLICY = PolicyConfig().eviction
