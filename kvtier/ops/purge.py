"""Delete stored records from a config's disk and Redis tiers, by model, namespace or age, offline.

Filters combine (a record must match every one given): --model NAME (the model named in the namespace's
manifest; namespaces without a manifest never match), --namespace HEX, --older-than DURATION (7d, 12h, 30m:
by file time on disk; in Redis by the write time estimated from the TTL left, so only for a tier with a ttl:
records of unknown age are kept). --all deletes every record. --tier NAME limits it to one tier.

Without --yes it prints what it would delete and asks when stdin is a terminal; otherwise it refuses (exit 2).
--dry-run only prints. Deleting beside a running engine is safe: a record that vanished is a miss for it.
On disk only record files are removed (directories and manifests stay); a shared usage ledger is left to the
disk tier, which reconciles it at its next start. Memory tiers (cpu, gpu) live in their process and are not
touched.

Exit code: 0; 1 when a tier could not be read; 2 for a bad config or option, or a refusal.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, KvtierError, TierUnavailable
from kvtier.ops.catalog import add_common, duration_arg, hex_arg, load, size
from kvtier.tiers.catalog import IN_PROCESS

if TYPE_CHECKING:
    from kvtier.tiers.catalog import RecordInfo, Selection, Source



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvtier purge``."""
    add_common(parser)
    parser.add_argument("--model", metavar="NAME", help="records of namespaces whose manifest names this model")
    parser.add_argument("--namespace", metavar="HEX", help="records of this namespace (32 hex digits)")
    parser.add_argument("--older-than", metavar="DURATION", help="records older than this: 7d, 12h, 30m "
                        "(disk: file time; Redis: only tiers with a ttl, estimated from the TTL left)")
    parser.add_argument("--all", action="store_true", help="every record of the tiers")
    parser.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    parser.add_argument("--yes", action="store_true", help="delete without asking")


def selection(args: argparse.Namespace) -> Selection:
    """The filters of ``args``; ``ConfigError`` when none (or --all with others) is given."""
    from kvtier.tiers.catalog import Selection

    chosen = Selection(model=args.model, namespace=hex_arg(args.namespace, 16, "--namespace"),
                       older_than=duration_arg(args.older_than, "--older-than"))
    given = [v for v in (chosen.model, chosen.namespace, chosen.older_than) if v is not None]
    if args.all and given:
        raise ConfigError("purge", "--all deletes everything: do not combine it with other filters")
    if not args.all and not given:
        raise ConfigError("purge", "say what to delete", "--model NAME, --namespace HEX, --older-than 7d or --all")
    return chosen


def _confirm(count: int, nbytes: int) -> bool:
    if not sys.stdin.isatty():
        raise KvtierError(f"would delete {count} records ({size(nbytes)}); not asking without a terminal: "
                          f"pass --yes to delete, or --dry-run to preview")
    answer = input(f"delete {count} records ({size(nbytes)})? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _plans(sources: list[Source], chosen: Selection, report: dict[str, Any]) -> list[tuple[Source, list[RecordInfo]]]:
    from kvtier.tiers.catalog import plan

    plans = []
    for source in sources:
        try:
            records = plan(source, chosen)
        except TierUnavailable as exc:
            report["unreachable"][source.name] = str(exc)
            print(f"{source.name}: unreachable: {exc}", file=sys.stderr)
            continue
        plans.append((source, records))
        report["tiers"][source.name] = {"planned": len(records), "planned_bytes": sum(r.size for r in records),
                                        "deleted": 0, "deleted_bytes": 0}
    return plans


def _delete(plans: list[tuple[Source, list[RecordInfo]]], report: dict[str, Any]) -> None:
    for source, records in plans:
        entry = report["tiers"][source.name]
        try:
            entry["deleted"], entry["deleted_bytes"] = source.delete(records)
        except TierUnavailable as exc:
            report["unreachable"][source.name] = str(exc)
        entry["notes"] = source.notes()


def _lines(report: dict[str, Any], done: bool) -> list[str]:
    lines = [f"{name}: {IN_PROCESS} (not touched)" for name in report["skipped"]]
    for name, e in report["tiers"].items():
        if done:
            lines.append(f"{name}: deleted {e['deleted']} records, {e['deleted_bytes']} bytes "
                         f"({size(e['deleted_bytes'])})")
            lines += [f"{name}: {note}" for note in e.get("notes", []) if e["deleted"]]
        else:
            lines.append(f"{name}: would delete {e['planned']} records, {e['planned_bytes']} bytes "
                         f"({size(e['planned_bytes'])})")
    return lines


def run(args: argparse.Namespace) -> int:
    """Plan, confirm, delete, report; see the module docstring for exit codes."""
    from kvtier.ops.catalog import offline_sources

    chosen = selection(args)
    with offline_sources(load(args.config), args.tier) as (live, skipped):
        report: dict[str, Any] = {"tiers": {}, "unreachable": {}, "skipped": skipped}
        plans = _plans(live, chosen, report)
        count = sum(len(r) for _, r in plans)
        nbytes = sum(x.size for _, r in plans for x in r)
        go = not args.dry_run
        if go and count and not args.yes:
            if not args.json:
                print("\n".join(_lines(report, done=False)))
            go = _confirm(count, nbytes)
            if not go:
                print("nothing deleted")
                return 0
        if go:
            _delete(plans, report)
    report["dry_run"], report["deleted"] = bool(args.dry_run), go
    lines = _lines(report, done=go) + (["dry run: nothing deleted"] if args.dry_run else [])
    print(json.dumps(report, indent=2) if args.json else "\n".join(lines))
    return 1 if report["unreachable"] else 0
