"""The figures of ``kvtier bench serve``: per mode, latency and throughput from the clients' replies, the token hit
rate by source from the server's ``/metrics`` (vLLM's prefix cache, kvtier by tier) with kvtier's own counters
reconciled against vLLM's, the completions compared with the reference mode's, and the simulation's prediction
of the hit rates (``kvtier bench hit-rate``'s directory replay at the same scaled capacities).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvtier.bench.hitrate import DEFAULT_POLICY, replay_policy
from kvtier.bench.output import figure
from kvtier.bench.serve_client import Reply
from kvtier.bench.workloads import Workload
from kvtier.ops.vllm_server import Samples, metric_sum

SOURCES = "vllm:prompt_tokens_by_source_total"
PREFILL_COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"  # per finished request: prompt less cached tokens
ADMISSION = "kvtier_save_admission_chunks_total"  # chunks offered for saving, by the admission's decision
GAP_POINTS = 2.0  # a simulation gap above this many points is flagged with its likely causes


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def latency_summary(replies: Sequence[Reply]) -> dict[str, Any]:
    """TTFT and latency quantiles, and prompt and generated tokens per second over the replay's span."""
    good = [r for r in replies if r.error is None]
    ttft = [r.ttft_s for r in good]
    e2e = [r.latency_s for r in good]
    span = max((r.sent_s + r.latency_s for r in good), default=0.0) - min((r.sent_s for r in good), default=0.0)
    prompt, generated = sum(r.prompt_tokens for r in good), sum(len(r.tokens) for r in good)
    return {"requests": len(replies), "errors": len(replies) - len(good),
            **{f"ttft_p{q}_s": percentile(ttft, q / 100) for q in (50, 90, 99)},
            **{f"e2e_p{q}_s": percentile(e2e, q / 100) for q in (50, 90, 99)},
            "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0, "span_s": span,
            "queued_p50_s": percentile([r.queued_s for r in good], 0.5),
            "prompt_tokens": prompt, "generated_tokens": generated,
            "prompt_tokens_per_s": prompt / span if span > 0 else 0.0,
            "generated_tokens_per_s": generated / span if span > 0 else 0.0}


def _delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def _label_values(samples: Samples, name: str, label: str) -> list[str]:
    return sorted({dict(ls)[label] for n, ls in samples if n == name and label in dict(ls)})


def hit_summary(before: Samples, after: Samples) -> dict[str, Any]:
    """Prompt tokens by source between two scrapes, kvtier's hit tokens by tier reconciled with vLLM's
    ``external_kv_transfer`` count, kvtier's load/store bytes and failures."""
    by_source = {s: int(_delta(after, before, SOURCES, source=s))
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    prompt = sum(by_source.values())
    tiers = {t: int(_delta(after, before, "kvtier_hit_tokens_total", tier=t))
             for t in _label_values(after, "kvtier_hit_tokens_total", "tier")}
    kvtier = sum(tiers.values())
    external = by_source["external_kv_transfer"]

    def rate(n: float) -> float:
        return n / prompt if prompt else 0.0

    return {"prompt_tokens": prompt, "tokens_by_source": by_source,
            "hit_rate": rate(by_source["local_cache_hit"] + external),
            "engine_hit_rate": rate(by_source["local_cache_hit"]), "kvtier_hit_rate": rate(external),
            "kvtier_hit_tokens": tiers, "kvtier_tier_hit_rate": {t: rate(n) for t, n in tiers.items()},
            "kvtier_hit_tokens_total": kvtier, "reconcile_difference": kvtier - external,
            "reconciled": kvtier == external,
            "kvtier_load_bytes": int(_delta(after, before, "kvtier_load_bytes_total")),
            "kvtier_stored_bytes": {t: int(_delta(after, before, "kvtier_stored_bytes_total", tier=t))
                                    for t in _label_values(after, "kvtier_stored_bytes_total", "tier")},
            "kvtier_load_failures": int(_delta(after, before, "kvtier_load_failures_total")),
            "kvtier_store_failures": {k: int(_delta(after, before, "kvtier_store_failures_total", kind=k))
                                      for k in _label_values(after, "kvtier_store_failures_total", "kind")},
            "kvtier_tier_read_bytes": {t: int(_delta(after, before, "kvtier_tier_read_bytes_total", tier=t))
                                       for t in _label_values(after, "kvtier_tier_read_bytes_total", "tier")},
            "kvtier_tier_errors": int(_delta(after, before, "kvtier_tier_errors_total")),
            "kvtier_tier_errors_by_kind": {  # timeout / error / server, per tier: what a failure count is made of
                f"{t}:{k}": n for t in _label_values(after, "kvtier_tier_errors_total", "tier")
                for k in _label_values(after, "kvtier_tier_errors_total", "kind")
                if (n := int(_delta(after, before, "kvtier_tier_errors_total", tier=t, kind=k)))},
            "kvtier_admission_chunks": {d: int(_delta(after, before, ADMISSION, decision=d))
                                        for d in _label_values(after, ADMISSION, "decision")},
            "prefill_computed_tokens": int(_delta(after, before, PREFILL_COMPUTED)),
            "prefix_cache_queries": int(_delta(after, before, "vllm:prefix_cache_queries_total")),
            "prefix_cache_hits": int(_delta(after, before, "vllm:prefix_cache_hits_total"))}


def mismatches(replies: Sequence[Reply], reference: Sequence[Reply]) -> list[int]:
    """Indices of the requests whose tokens differ from the reference's (a failed request counts)."""
    return [a.index for a, b in zip(replies, reference, strict=True)
            if a.error is not None or b.error is not None or a.tokens != b.tokens]


def mode_summary(replies: Sequence[Reply], before: Samples, after: Samples,
                 reference: Sequence[Reply] | None) -> dict[str, Any]:
    """Everything the report shows for one mode at one memory point."""
    diff = mismatches(replies, reference) if reference is not None else []
    cached = [r.cached_tokens for r in replies if r.cached_tokens is not None]
    hits = hit_summary(before, after)
    return {**latency_summary(replies), **hits, "saved_per_loaded": saved_per_loaded(hits),
            "mismatches": len(diff), "mismatched_requests": diff[:20],
            "client_cached_tokens": sum(cached) if cached else None}


def saved_per_loaded(hits: Mapping[str, Any]) -> float | None:
    """Bytes kvtier stored, in every tier, per byte it loaded into the engine (None when it loaded nothing)."""
    stored = sum(hits["kvtier_stored_bytes"].values())
    return stored / hits["kvtier_load_bytes"] if hits["kvtier_load_bytes"] else None


def add_ratios(modes: dict[str, dict[str, Any]], base: str = "prefix") -> None:
    """Each mode's TTFT, latency and throughput as ratios to ``base`` measured in the same run (``vs_prefix``)."""
    ref = modes.get(base)
    if ref is None:
        return
    for row in modes.values():
        row["vs_prefix"] = {k: row[k] / ref[k] if ref[k] else None
                            for k in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "generated_tokens_per_s",
                                      "prompt_tokens_per_s")}


def simulate(workload: Workload, engine_blocks: int, tiers: Mapping[str, Sequence[int]],
             prefix: Mapping[str, bool]) -> dict[str, dict[str, float]]:
    """Predicted hit rates per mode: vLLM's cache as an LRU of ``engine_blocks``; a kvtier mode as kvtier's
    default policy over its tiers (``tiers[mode]``, chunks per tier), less what the engine in front already hit
    when the mode has vLLM's prefix cache on (``prefix[mode]``)."""
    engine = replay_policy(workload, "lru", [engine_blocks]).hit_rate if engine_blocks > 0 else 0.0
    out: dict[str, dict[str, float]] = {}
    for mode, caps in tiers.items():
        front = engine if prefix.get(mode) else 0.0
        if not caps:
            out[mode] = {"hit_rate": front, "engine_hit_rate": front, "kvtier_hit_rate": 0.0}
            continue
        total = max(front, replay_policy(workload, DEFAULT_POLICY, list(caps)).hit_rate)
        out[mode] = {"hit_rate": total, "engine_hit_rate": front, "kvtier_hit_rate": total - front}
    return out


def in_flight_share(workload: Workload, replies: Sequence[Reply]) -> float:
    """Share of the prompt tokens that a sequential replay can hit but a server cannot yet: per request (in the
    order they were sent), the prefix blocks that earlier requests hold, less those that one of them had
    prefilled (its first token) by the time this one was sent: the rest is not computed, let alone saved."""
    ready: dict[Hashable, float] = {}  # block -> when a request holding it first had it prefilled
    lost = total = 0
    for reply in sorted(replies, key=lambda r: r.sent_s):
        chunks = workload.requests[reply.index].chunks
        total += workload.requests[reply.index].input_len
        seen = next((i for i, c in enumerate(chunks) if c not in ready), len(chunks))
        done = next((i for i, c in enumerate(chunks[:seen]) if ready[c] > reply.sent_s), seen)
        lost += (seen - done) * workload.chunk_tokens
        for chunk in chunks:
            ready[chunk] = min(ready.get(chunk, math.inf), reply.sent_s + reply.ttft_s)
    return lost / total if total else 0.0


def explain(row: Mapping[str, Any], sim: Mapping[str, float], in_flight: float) -> list[str]:
    """The likely causes of a gap between the measured and the predicted hit rate, each with its measured size."""
    causes = []
    front = (row["engine_hit_rate"] - sim["engine_hit_rate"]) * 100
    if abs(front) >= 0.5:
        causes.append(f"the engine cache in front: vLLM's prefix cache hit {row['engine_hit_rate'] * 100:.1f}% "
                      f"against {sim['engine_hit_rate'] * 100:.1f}% for an LRU of its size ({front:+.1f} points)")
    if in_flight * 100 >= 0.5:
        causes.append(f"concurrency: {in_flight * 100:.1f} points of prompt tokens were in blocks that no earlier "
                      "request had prefilled yet when the request was sent")
    failed = sum(row.get("kvtier_store_failures", {}).values()) + row.get("kvtier_load_failures", 0)
    if failed:
        causes.append(f"failures: {failed} chunks not stored or not loaded")
    gap = (row["hit_rate"] - sim["hit_rate"]) * 100
    if gap < 0:
        if not causes:
            causes.append("none of the causes measured here (the engine cache in front, prefills in flight, "
                          "failures): unexplained")
    else:
        causes.append("two caches in series: the engine's cache keeps recent blocks that the tier's policy evicted, "
                      "which the simulation (the larger of the two alone) does not count")
    return causes


def compare(measured: Mapping[str, Mapping[str, Any]], predicted: Mapping[str, Mapping[str, float]],
            in_flight: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Simulation against reality per mode, in points of token hit rate; a gap above ``GAP_POINTS`` is flagged
    and explained (``in_flight``: each mode's ``in_flight_share``)."""
    out = {}
    for mode, sim in predicted.items():
        if mode not in measured:
            continue
        row = measured[mode]
        gap = (row["kvtier_hit_rate"] - sim["kvtier_hit_rate"]) * 100
        total_gap = (row["hit_rate"] - sim["hit_rate"]) * 100
        flagged = abs(gap) > GAP_POINTS or abs(total_gap) > GAP_POINTS
        share = (in_flight or {}).get(mode, 0.0)
        out[mode] = {"measured_kvtier_hit_rate": row["kvtier_hit_rate"], "predicted_kvtier_hit_rate":
                     sim["kvtier_hit_rate"], "measured_hit_rate": row["hit_rate"], "predicted_hit_rate":
                     sim["hit_rate"], "measured_engine_hit_rate": row["engine_hit_rate"],
                     "predicted_engine_hit_rate": sim["engine_hit_rate"], "kvtier_gap_points": gap,
                     "total_gap_points": total_gap, "in_flight_points": share * 100, "flagged": flagged,
                     "explanation": explain(row, sim, share) if flagged else []}
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def _ratio(row: Mapping[str, Any], key: str) -> str:
    value = (row.get("vs_prefix") or {}).get(key)
    return "-" if value is None else f"{value:.2f}"


def table(point: Mapping[str, Any]) -> str:
    """One memory point's modes as text: latency, throughput, hit rate by source, ratios to ``prefix``."""
    head = (f"{'mode':<17} {'TTFT p50':>8} {'p90':>6} {'p99':>6} {'e2e p50':>7} {'gen tok/s':>9} "
            f"{'hit %':>6} {'engine':>6} {'kvtier':>6}  {'by tier':<22} {'TTFT/pfx':>8} {'tok/s/pfx':>9} "
            f"{'saved/loaded':>12} {'recon':>5} {'diff':>4}")
    lines = [f"engine KV memory {point['memory']:.0%} of the working set ({point['engine_blocks']} blocks)", head]
    for mode, row in point["modes"].items():
        tiers = " ".join(f"{t} {r * 100:.1f}" for t, r in row["kvtier_tier_hit_rate"].items()) or "-"
        lines.append(f"{mode:<17} {_ms(row['ttft_p50_s']):>8} {_ms(row['ttft_p90_s']):>6} "
                     f"{_ms(row['ttft_p99_s']):>6} {_ms(row['e2e_p50_s']):>7} {row['generated_tokens_per_s']:9.1f} "
                     f"{row['hit_rate'] * 100:6.1f} {row['engine_hit_rate'] * 100:6.1f} "
                     f"{row['kvtier_hit_rate'] * 100:6.1f}  {tiers:<22} {_ratio(row, 'ttft_p50_s'):>8} "
                     f"{_ratio(row, 'generated_tokens_per_s'):>9} {_times(row.get('saved_per_loaded')):>12} "
                     f"{'yes' if row['reconciled'] else 'NO':>5} "
                     f"{row['mismatches']:>4}")
    for mode, sim in point.get("simulation", {}).items():
        flag = "  (gap > 2 points)" if sim["flagged"] else ""
        lines.append(f"simulation {mode:<17} kvtier hit {sim['measured_kvtier_hit_rate'] * 100:5.1f}% measured, "
                     f"{sim['predicted_kvtier_hit_rate'] * 100:5.1f}% predicted; total "
                     f"{sim['measured_hit_rate'] * 100:5.1f}% vs {sim['predicted_hit_rate'] * 100:5.1f}%{flag}")
        lines += [f"    - {cause}" for cause in sim.get("explanation", [])]
    return "\n".join(lines)


def plot(doc: Mapping[str, Any], path: Any) -> Any:
    """TTFT CDF per mode (smallest memory point); hit rate, TTFT p50 and generated tokens/s against engine
    memory."""
    points = doc["points"]
    with figure(path, 2, 2, figsize=(12, 8)) as (fig, ((cdf, hits), (ttft, speed))):
        first = points[0]
        for mode, ttfts in first["ttft_s"].items():
            xs = sorted(t * 1e3 for t in ttfts)
            cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=mode, drawstyle="steps-post")
        cdf.set_xlabel(f"TTFT (ms), engine memory {first['memory']:.0%}")
        cdf.set_ylabel("share of requests")
        memories = [p["memory"] * 100 for p in points]
        panels = ((hits, "hit_rate", 100, "token hit rate (%), engine + kvtier"),
                  (ttft, "ttft_p50_s", 1e3, "TTFT p50 (ms)"),
                  (speed, "generated_tokens_per_s", 1, "generated tokens/s"))
        for mode in first["modes"]:
            rows = [p["modes"].get(mode) for p in points]
            for ax, key, factor, _ in panels:
                ax.plot(memories, [r[key] * factor if r else math.nan for r in rows], marker="o", label=mode)
        for ax, _, _, label in panels:
            ax.set_xlabel("engine KV memory (% of the working set)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
        for ax in (cdf, hits, ttft, speed):
            ax.legend(fontsize=7)
        fig.suptitle(f"{doc['settings']['requests']} requests of {doc['settings']['trace_name']} through vLLM's "
                     f"OpenAI server, {doc['settings']['concurrency']} concurrent clients")
    return path
