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
from typing import TYPE_CHECKING

from kvtier.ops.catalog import add_common, label, load, size, table, when

if TYPE_CHECKING:
    from kvtier.tiers.catalog import TierSummary

HELP = "show what the disk and Redis tiers store, per namespace (offline)"


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
        lines.append(f"{t.name} ({t.kind}{where}): {len(t.namespaces)} namespace(s), {t.records} records, "
                     f"{size(t.bytes)}")
        rows = [(label(n.namespace, n.where), n.records, n.bytes, when(n.oldest), when(n.newest), n.description)
                for n in t.namespaces]
        if rows:
            lines += table(("namespace", "records", "bytes", "oldest", "newest", "holds"), rows)
    return "\n".join(lines)


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
