"""List a namespace's records in a config's disk and Redis tiers, or show and verify records, offline.

--namespace HEX lists the records (newest first, --limit of them): key, size, time (disk: file mtime; Redis:
estimated from the TTL left, n/a without a ttl) and the header's dtype, shape and codec; with --verify it also
verifies every record of the namespace, in one pass. --key HEX [HEX ...] (the 64 hex digits of a record's file
name; as many as wanted) shows each record's header in each tier holding it and verifies its payload checksum
(and its signature when the config's security.hmac_key_env is set in the environment).

Exit code: 0; 1 when a record fails verification, a --key is found in no tier, or a tier could not be read;
2 for a bad config or option.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError, TierUnavailable
from kvtier.ops.argtypes import non_negative_int
from kvtier.ops.catalog import add_common, codec_of, hex_arg, label, load, table, when

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig
    from kvtier.tiers.catalog import RecordInfo, Source



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvtier inspect``."""
    add_common(parser)
    parser.add_argument("--namespace", metavar="HEX", help="namespace to list (32 hex digits, from kvtier stats)")
    parser.add_argument("--key", metavar="HEX", nargs="+", action="extend",
                        help="records to show and verify, in one pass (64 hex digits each; as many as wanted)")
    parser.add_argument("--verify", action="store_true",
                        help="with --namespace: also verify every record of the namespace, in one pass")
    parser.add_argument("--limit", type=non_negative_int, default=20, metavar="N",
                        help="records listed per tier (default 20)")


def _entry(tier: str, r: RecordInfo) -> dict[str, Any]:
    h = r.header
    return {"tier": tier, "where": r.where, "key": r.key.hex(), "size": r.size, "mtime": r.mtime, "ref": r.ref,
            "dtype": h.dtype if h else None, "shape": list(h.shape) if h else None, "codec": codec_of(h),
            "raw_bytes": h.raw_len if h else None, "error": r.error}


def _listing(source: Source, namespace: str, limit: int, verify: bool, hmac_key: bytes | None) -> dict[str, Any]:
    found = sorted(source.records(namespace), key=lambda r: -(r.mtime or 0.0))
    shown = [_entry(source.name, source.detail(r)) for r in found[:limit]]
    block = {"tier": source.name, "records": len(found), "bytes": sum(r.size for r in found), "shown": shown}
    if verify:
        checks = [c for k in dict.fromkeys(r.key for r in found) for c in _show_key(source, k, hmac_key)]
        block["verified"] = len(checks)
        block["failed"] = [{"key": c["key"], "where": c["where"], "check": c["check"]}
                           for c in checks if not c["check"].startswith("ok")]
    return block


def _verify(record: RecordInfo, data: bytes, hmac_key: bytes | None) -> str:
    from kvtier.errors import CorruptRecord
    from kvtier.records import codec

    try:
        header = codec.decode_header(data, expected_key=record.key)
        codec.verify_payload(memoryview(data), header, hmac_key=hmac_key)
    except CorruptRecord as exc:
        return f"FAILED: {exc}"
    return "ok" + (", signature ok" if hmac_key else ", signature not checked" if header.signed else "")


def _signing_key(cfg: KvtierConfig) -> bytes | None:
    from kvtier.records.security import load_hmac_key

    try:
        return load_hmac_key(cfg.security)
    except ConfigError as exc:
        print(f"kvtier: warning: signatures not checked: {exc}", file=sys.stderr)
        return None


def _show_key(source: Source, key: bytes, hmac_key: bytes | None) -> list[dict[str, Any]]:
    return [{**_entry(source.name, source.detail(record)), "check": _verify(record, data, hmac_key)}
            for record, data in source.read(key)]


def _render_listing(block: dict[str, Any]) -> list[str]:
    lines = [f"{block['tier']}: {block['records']} records, {block['bytes']} bytes"
             + (f" (newest {len(block['shown'])} shown)" if len(block["shown"]) < block["records"] else "")]
    rows = [(label(e["key"], e["where"]), e["size"], when(e["mtime"]), e["dtype"] or "?",
             "x".join(map(str, e["shape"] or [])) or "?", e["codec"] + (f"  {e['error']}" if e["error"] else ""))
            for e in block["shown"]]
    lines += table(("key", "bytes", "time", "dtype", "shape", "codec"), rows) if rows else []
    if "verified" in block:
        lines.append(f"  verified {block['verified']} records: "
                     + (f"{len(block['failed'])} FAILED" if block["failed"] else "all ok"))
        lines += [f"  {label(f['key'], f['where'])}: check {f['check']}" for f in block["failed"]]
    return lines


def _render_copy(e: dict[str, Any]) -> list[str]:
    return [f"{e['tier']}: {e['ref']}", f"  size {e['size']} bytes, time {when(e['mtime'])}",
            f"  dtype {e['dtype']}, shape {e['shape']}, codec {e['codec']}, raw payload {e['raw_bytes']} bytes",
            f"  check {e['check']}"]


def run(args: argparse.Namespace) -> int:
    """List or verify; see the module docstring for exit codes."""
    from kvtier.ops.catalog import offline_sources

    namespace = hex_arg(args.namespace, 16, "--namespace")
    keys = list(dict.fromkeys(k for k in (hex_arg(k, 32, "--key") for k in args.key or []) if k))
    if (namespace is None) == (not keys):
        raise ConfigError("inspect", "give either --namespace HEX or --key HEX [HEX ...]")
    if args.verify and namespace is None:
        raise ConfigError("--verify", "verifies the records of a --namespace", "--key verifies its records always")
    cfg = load(args.config)
    hmac_key = _signing_key(cfg) if keys or args.verify else None
    out: dict[str, Any] = {"tiers": [], "unreachable": {}}
    lines: list[str] = []
    with offline_sources(cfg, args.tier) as (sources, _):
        for source in sources:
            try:
                if keys:
                    copies = [c for k in keys for c in _show_key(source, bytes.fromhex(k), hmac_key)]
                    out["tiers"] += copies
                    lines += [line for c in copies for line in _render_copy(c)]
                else:
                    block = _listing(source, namespace or "", args.limit, args.verify, hmac_key)
                    out["tiers"].append(block)
                    lines += _render_listing(block)
            except TierUnavailable as exc:
                out["unreachable"][source.name] = str(exc)
                lines.append(f"{source.name}: unreachable: {exc}")
    return _finish(args, out, lines, keys)


def _finish(args: argparse.Namespace, out: dict[str, Any], lines: list[str], keys: list[str]) -> int:
    ok = not out["unreachable"]
    if keys:
        found = {c["key"] for c in out["tiers"]}
        failed = {c["key"] for c in out["tiers"] if not c["check"].startswith("ok")}
        out["missing"] = [k for k in keys if k not in found]
        ok = ok and not out["missing"] and not failed
        lines += [f"record {k} is in no tier" for k in out["missing"]]
        if len(keys) > 1:
            lines.append(f"{len(keys)} keys: {len(found - failed)} ok, {len(failed)} failed verification, "
                         f"{len(out['missing'])} in no tier")
    else:
        ok = ok and not any(block.get("failed") for block in out["tiers"])
    print(json.dumps({"ok": ok, **out}, indent=2) if args.json else "\n".join(lines))
    return 0 if ok else 1
