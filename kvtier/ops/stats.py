"""Show what a config's disk and Redis tiers store, per tier and per namespace, without the engine running.

For each namespace: records, bytes, the oldest and newest record (disk: file times; Redis: estimated from the
TTL left when the tier has a ttl, else n/a) and what the namespace holds (model, revision, dtype, layout),
from its manifest. Memory tiers (cpu, gpu) exist only inside a running process and are listed as such.
Tensor-parallel ranks' directories (tp<rank>-of-<size>) are shown as tp0-of-2/<namespace>.

Exit code: 0; 1 when a tier could not be read (e.g. Redis unreachable; the other tiers are still shown);
2 for a bad config or option.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from kvtier.ops.catalog import add_common, label, load, size, table, when

if TYPE_CHECKING:
    from kvtier.tiers.catalog import TierSummary



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvtier stats``."""
    add_common(parser)


def render(config: str, summaries: list[TierSummary]) -> str:
    """The plain-text report."""
    lines = [f"config: {config}"]
    for t in summaries:
        where = f", {t.location}" if t.location else ""
        if t.status != "ok":
            state = f"unreachable: {t.error}" if t.status == "unreachable" else str(t.error)
            lines.append(f"{t.name} ({t.kind}{where}): {state}")
            continue
        if t.kind == "disk" and not os.path.isdir(t.location):
            lines.append(f"{t.name} ({t.kind}{where}): no such directory: nothing stored there yet (the disk tier "
                         f"creates it at start){_cache_dir_note(t.location)}")
            continue
        held = [n for n in t.namespaces if n.records]
        lines.append(f"{t.name} ({t.kind}{where}): {len(held)} namespace(s), {t.records} records, {size(t.bytes)}")
        rows = [(label(n.namespace, n.where), n.records, n.bytes, when(n.oldest), when(n.newest), n.description)
                for n in held]
        if rows:
            lines += table(("namespace", "records", "bytes", "oldest", "newest", "holds"), rows)
        if empty := len(t.namespaces) - len(held):
            lines.append(f"  and {empty} namespace(s) with no records (a manifest left by a purge or an eviction)")
    return "\n".join(lines)


def _cache_dir_note(path: str) -> str:
    """Where ``path`` comes from $KVTIER_CACHE_DIR, says so."""
    base = os.environ.get("KVTIER_CACHE_DIR")
    if base and os.path.abspath(path).startswith(os.path.abspath(os.path.expanduser(base))):
        return f"; its parent is $KVTIER_CACHE_DIR ({base})"
    return ""


def run(args: argparse.Namespace) -> int:
    """Print the report; 1 when a tier could not be read."""
    from kvtier.ops.catalog import open_sources
    from kvtier.tiers.catalog import summarize

    cfg = load(args.config)
    summaries = []
    for source in open_sources(cfg, args.tier):
        try:
            summaries.append(summarize(source))
        finally:
            source.close()
    name = args.config or "(default config)"
    ok = all(t.status != "unreachable" for t in summaries)
    if args.json:
        print(json.dumps({"config": name, "ok": ok, "tiers": [t.as_dict() for t in summaries]}, indent=2))
    else:
        print(render(name, summaries))
    return 0 if ok else 1
