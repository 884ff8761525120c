"""argparse types of kvtier's command lines (``kvtier`` and ``kvtier bench``, the scripts in benchmarks/).

Every numeric option that makes no sense at zero or below is read through one of these types, so that a bad
value is a usage error (one line, exit code 2, from kvtier.ops.cli.KvtierParser) before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from kvtier.errors import ConfigError, KvtierError


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def positive_size(text: str) -> int:
    """argparse type: a size above 0 bytes with its unit (512MiB, 2GiB, 4096B)."""
    from kvtier.config.parse import parse_size, refuse_bare_size

    try:
        value = parse_size(text, "size")
    except KvtierError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0 such as 64KiB, 512MiB or 2GiB, got {text!r}")
    try:
        refuse_bare_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} has no unit ({exc.hint})") from None
    return value


N = TypeVar("N", int, float)


def _number(kind: Callable[[str], N], low: N, inclusive: bool, what: str) -> Callable[[str], N]:
    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_float = _number(float, 0.0, False, "a positive number")
non_negative_float = _number(float, 0.0, True, "a number >= 0")


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma list of positive integers: ``512,1024``."""
    return tuple(positive_int(v.strip()) for v in text.split(",") if v.strip()) or _empty(text)


def positive_sizes(text: str) -> tuple[int, ...]:
    """A comma list of sizes above zero: ``32MiB,2MiB``."""
    return tuple(positive_size(v.strip()) for v in text.split(",") if v.strip()) or _empty(text)


def names_from(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A type reading a comma list whose every item is one of ``choices``."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in text.split(",") if v.strip()) or _empty(text)
        unknown = sorted(set(names) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (choose from {', '.join(choices)})")
        return names

    return parse


def existing_dir(text: str) -> str:
    """A directory that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def existing_path(text: str) -> str:
    """A file or directory that exists."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return text


def key_value(text: str) -> str:
    """A ``KEY=VALUE`` item with a non-empty key."""
    if "=" not in text or not text.split("=", 1)[0].strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return text


def _empty(text: str) -> NoReturn:
    raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
