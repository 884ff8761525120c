"""What ``kvtier stats``, ``inspect`` and ``purge`` share: the sources of a config's tiers (each medium's offline
reader, kvtier.tiers.disk.catalog and kvtier.tiers.redis.catalog; the records' model in kvtier.tiers.catalog),
their common options, config loading, input checks and plain-text formatting (times, sizes, tables)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError, KvtierError
from kvtier.tiers.catalog import InProcess, Source

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig
    from kvtier.records.codec import RecordHeader


def open_sources(cfg: KvtierConfig, tier: str | None = None, env: Mapping[str, str] | None = None,
                 ) -> list[Source | InProcess]:
    """One source per tier of ``cfg`` (only ``tier`` when given; an unknown name raises ``KvtierError``)."""
    from kvtier.config import DiskTierConfig, RedisTierConfig

    names = [t.name for t in cfg.tiers]
    if tier is not None and tier not in names:
        raise ConfigError("--tier", f"no tier named {tier!r} in the config", f"one of {', '.join(names)}")
    out: list[Source | InProcess] = []
    for section in cfg.tiers:
        if tier is not None and section.name != tier:
            continue
        if isinstance(section, DiskTierConfig):
            from kvtier.tiers.disk.catalog import DiskSource

            out.append(DiskSource(section))
        elif isinstance(section, RedisTierConfig):
            from kvtier.tiers.redis.catalog import RedisSource

            out.append(RedisSource(section, env))
        else:
            out.append(InProcess(section.name, section.kind.value))
    return out


@contextmanager
def offline_sources(cfg: KvtierConfig, tier: str | None = None) -> Iterator[tuple[list[Source], list[str]]]:
    """``open_sources`` split for ``kvtier inspect`` and ``purge``: the sources readable offline and the names of the
    in-process tiers passed over; the sources are closed when the block ends."""
    found = open_sources(cfg, tier)
    live = [s for s in found if not isinstance(s, InProcess)]
    try:
        yield live, [s.name for s in found if isinstance(s, InProcess)]
    finally:
        for source in live:
            source.close()


CONFIG_HELP = ("YAML config file naming the tiers (default: $KVTIER_CONFIG, else the built-in default: "
               "cpu + disk under the user cache dir); KVTIER_* environment variables apply")


def add_common(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--tier`` and ``--json``."""
    parser.add_argument("--config", metavar="FILE", default=None, help=CONFIG_HELP)
    parser.add_argument("--tier", metavar="NAME", default=None, help="only this tier (default: every tier)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def load(path: str | None) -> KvtierConfig:
    """The config, or ``KvtierError`` with a one-line message."""
    from kvtier.config import load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise KvtierError(" ".join(str(exc).split())) from None


def hex_arg(text: str | None, nbytes: int, option: str) -> str | None:
    """``text`` as lower-case hex of ``nbytes`` bytes (None stays None), else ``ConfigError`` naming ``option``."""
    if text is None:
        return None
    value = text.strip().lower()
    try:
        ok = len(bytes.fromhex(value)) == nbytes
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(option, f"expected {2 * nbytes} hex digits, got {text!r}",
                          "copy it from kvtier stats or kvtier inspect")
    return value


def duration_arg(text: str | None, option: str) -> float | None:
    """``7d``, ``12h``, ``30m``, ``90s`` (or a combination, ``1d12h``) in seconds; ``ConfigError`` if invalid."""
    if text is None:
        return None
    from kvtier.config.parse import parse_duration

    bare = text.strip()
    if bare.replace(".", "", 1).isdigit():  # a destructive option never guesses the unit
        raise ConfigError(option, f"{bare!r} has no unit", f"did you mean {bare}d, {bare}h, {bare}m or {bare}s?")
    try:
        seconds = parse_duration(text.strip().lower(), option)
    except ConfigError:
        raise ConfigError(option, f"bad duration {text!r}", "e.g. 7d, 12h, 30m, 1d12h") from None
    if seconds <= 0:
        raise ConfigError(option, "must be positive", "e.g. 7d, 12h")
    return seconds


def when(t: float | None) -> str:
    return "n/a" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def size(n: int) -> str:
    from kvtier.config.parse import format_size

    return format_size(n)


def codec_of(header: RecordHeader | None) -> str:
    """``raw``, ``lz4`` or ``zstd``, with ``+hmac`` when signed."""
    if header is None:
        return "?"
    from kvtier.records.codec import FLAG_LZ4, FLAG_ZSTD

    name = "lz4" if header.flags & FLAG_LZ4 else "zstd" if header.flags & FLAG_ZSTD else "raw"
    return name + ("+hmac" if header.signed else "")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> list[str]:
    """Left-aligned text columns, numbers right-aligned; the last column is not padded."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], int) for row in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for r in cells:
        out = [c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out[-1] = r[-1] if not numeric[-1] else out[-1]
        lines.append((indent + "  ".join(out)).rstrip())
    return lines


def label(namespace: str, where: str) -> str:
    """A namespace with its rank directory, as listed: ``<hex>`` or ``tp0-of-2/<hex>``."""
    return os.path.join(where, namespace) if where else namespace
