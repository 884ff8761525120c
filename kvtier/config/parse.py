"""Parsing helpers of :mod:`kvtier.config`: scalars (sizes, durations, paths, URLs), and key checks with
"did you mean" hints. The layers and their merge: :mod:`kvtier.config.layers`.

Every helper takes the key path of the value it reads and raises :class:`ConfigError` naming that path.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvtier.errors import ConfigError

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_UNITS: dict[str, int] = {"": 1, "B": 1}
for _i, _p in enumerate("KMGTP", start=1):
    _SIZE_UNITS.update({f"{_p}B": 1000**_i, _p: 1000**_i, f"{_p}iB": 1024**_i, f"{_p}i": 1024**_i})
_SIZE_UNITS.update({"kB": 1000, "k": 1000})

_DURATION_UNITS: dict[str, float] = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0,
                                     "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(us|µs|ms|s|min|m|h|d)")
_ENV_VAR = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


class EnvScalar:
    """A value from a ``KVTIER_*`` variable: the raw text (used where a string is expected) and its YAML parse."""

    __slots__ = ("parsed", "raw", "var")

    def __init__(self, var: str, raw: str) -> None:
        self.var, self.raw = var, raw
        try:
            self.parsed: Any = yaml.safe_load(raw) if raw.strip() else raw
        except (yaml.YAMLError, RecursionError):
            self.parsed = raw

    def __repr__(self) -> str:
        return f"{self.var}={self.raw!r}"


def unwrap(value: Any, want_text: bool = False) -> Any:
    """The value to validate: an env variable's raw text where text is wanted, else its YAML parse."""
    if isinstance(value, EnvScalar):
        return value.raw if want_text else value.parsed
    return value


def type_name(value: Any) -> str:
    """Short YAML-ish name of a value's type for error messages."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return names.get(type(value), type(value).__name__)


# ---- scalars ----------------------------------------------------------------------------------------------

def as_str(value: Any, path: str) -> str:
    """A string (an env variable's raw text counts)."""
    value = unwrap(value, want_text=True)
    if not isinstance(value, str):
        raise ConfigError(path, f"expected a string, got {type_name(value)}", "quote the value in YAML")
    return value


def as_bool(value: Any, path: str) -> bool:
    """A boolean (YAML true/false)."""
    value = unwrap(value)
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {value!r}")
    return value


def as_int(value: Any, path: str, *, minimum: int | None = None) -> int:
    """An integer, at least ``minimum`` when given."""
    value = unwrap(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(path, f"must be at least {minimum}, got {value}")
    return value


def as_float(value: Any, path: str) -> float:
    """A finite number."""
    value = unwrap(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(path, f"expected a finite number, got {value!r}")
    return float(value)


def _bare(value: Any) -> str | None:
    """The text of a number written without a unit (``"256"``, a ``KVTIER_*`` variable's ``1.5``), else None. A
    number from Python code (a mapping given to ``load_config``) is taken as bytes or seconds: it was not written
    as text (a YAML file's numbers are turned into their text first: ``kvtier.config.written_numbers``)."""
    if isinstance(value, EnvScalar):  # any YAML number form (+256, 1_000, 0x100, 1e9) counts
        parsed = value.parsed
        if isinstance(parsed, int | float) and not isinstance(parsed, bool):
            return str(parsed)
        value = value.raw
    if isinstance(value, str) and re.fullmatch(r"\d+(\.\d*)?|\.\d+", text := value.strip()):
        return text
    return None


def refuse_bare_size(value: Any, path: str) -> None:
    """A size written as a bare number is refused with a did-you-mean (``save_backlog: 256`` read as 256 bytes
    was the trap): configs and flags name their unit."""
    bare = _bare(value)
    if bare is None:
        return
    n = float(bare)
    if n >= 1 << 20 and n.is_integer():
        guess = f"{bare}B ({format_size(int(n))})?"
    else:
        guess = f"{bare}MiB or {bare}GiB?" + (f" {bare}B is bytes" if n.is_integer() else "")
    raise ConfigError(path, f"{bare} has no unit", f"did you mean {guess}")


def refuse_bare_duration(value: Any, path: str) -> None:
    """A duration written as a bare number other than 0 is refused with a did-you-mean (``timeout: 50`` read as
    50 s was the trap): configs and flags name their unit."""
    bare = _bare(value)
    if bare is None or float(bare) == 0:
        return
    guess = f"{bare}ms? {bare}s is seconds" if float(bare) >= 100 else f"{bare}s or {bare}ms?"
    raise ConfigError(path, f"{bare} has no unit", f"did you mean {guess}")


def parse_size(value: Any, path: str) -> int:
    """Bytes from an int or a string such as ``512MiB``, ``2GiB``, ``1.5GB``, ``64KiB``, ``10kB``, ``123``
    (:func:`refuse_bare_size` first where the unit must be named)."""
    value = unwrap(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    hint = "write bytes as an integer or with a unit: 512MiB, 2GiB, 1.5GB, 64KiB, 100MB"
    if not isinstance(value, str):
        raise ConfigError(path, f"expected a size, got {value!r}", hint)
    match = _SIZE_RE.fullmatch(value)
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ConfigError(path, f"bad size {value!r}", hint)
    return int(Decimal(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_duration(value: Any, path: str) -> float:
    """Seconds from a number or a string such as ``50ms``, ``2s``, ``5m``, ``1h``, ``1h30m``, ``100us``
    (:func:`refuse_bare_duration` first where the unit must be named)."""
    value = unwrap(value)
    hint = "write seconds as a number or with a unit: 100us, 50ms, 2s, 5m, 1h"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(path, f"bad duration {value!r}", hint)
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(path, f"expected a duration, got {value!r}", hint)
    text = value.replace(" ", "")
    try:
        return float(Decimal(text)) if re.fullmatch(r"\d+(\.\d*)?|\.\d+", text) else _duration_units(text)
    except ValueError:
        raise ConfigError(path, f"bad duration {value!r}", hint) from None


def _duration_units(text: str) -> float:
    parts = list(_DURATION_PART.finditer(text))
    if not parts or "".join(p.group(0) for p in parts) != text:
        raise ValueError(text)
    return sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)


def format_size(n: int) -> str:
    """Human-readable binary size: ``2 GiB``, ``1.5 MiB``, ``100 B``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if size.is_integer() else f"{size:.2f} {unit}".replace(".00 ", " ")
        size /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """Compact duration text that :func:`parse_duration` reads back: ``50ms``, ``1h``, ``1.5s``."""
    for unit, scale in (("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 1e-3)):
        count = seconds / scale
        if count >= 1 and abs(count - round(count)) < 1e-9:
            return f"{round(count)}{unit}"
    return f"{seconds!r}"


# ---- paths and URLs ---------------------------------------------------------------------------------------

def expand_path(value: Any, path: str, env: Mapping[str, str]) -> str:
    """Expand ``$VAR`` / ``${VAR}`` (from ``env``; unset is an error) and a leading ``~``."""
    if isinstance(unwrap(value), os.PathLike):
        value = os.fspath(unwrap(value))
    text = as_str(value, path)

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ConfigError(path, f"environment variable ${name} in {text!r} is not set", "set it or "
                              "write the path out")
        return env[name]

    text = _ENV_VAR.sub(repl, text)
    if text.startswith("~"):
        home = env.get("HOME")
        text = (home + text[1:]) if home and text[1:2] in ("", "/") else os.path.expanduser(text)
    if not text:
        raise ConfigError(path, "empty path")
    return text


def default_cache_dir(env: Mapping[str, str]) -> str:
    """``$KVTIER_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    if env.get("KVTIER_CACHE_DIR"):
        return expand_path(env["KVTIER_CACHE_DIR"], "KVTIER_CACHE_DIR", env)
    if env.get("XDG_CACHE_HOME"):
        return str(Path(env["XDG_CACHE_HOME"]) / "kvtier")
    return str(Path(expand_path("~", "HOME", env)) / ".cache" / "kvtier")


REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "unix")


def redact_url(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***`` (for messages: secrets never shown)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}"


def has_password(url: str) -> bool:
    """Whether ``url``'s user info holds a non-empty password (``redis://:secret@host``, ``redis://u:secret@h``)."""
    _, sep, rest = url.partition("://")
    userinfo, at, _ = rest.rpartition("@")
    return bool(sep and at and userinfo.partition(":")[2])


def check_redis_url(raw_url: str, path: str) -> bool:
    """Validate a Redis URL; return whether it names a cluster (``redis+cluster://h:p,h:p``). Error messages
    show the URL with its password redacted."""
    hint = "use redis://host:port/db, rediss://host:port/db, redis+cluster://host:port,host:port or unix:///path"
    url = redact_url(raw_url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(path, f"bad Redis URL {url!r}: {exc}", hint) from None
    if parts.scheme not in REDIS_SCHEMES:
        raise ConfigError(path, f"unsupported Redis URL scheme {parts.scheme!r} in {url!r}", hint)
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(path, f"unix URL {url!r} has no socket path", hint)
        return False
    hosts = parts.netloc.rpartition("@")[2]
    if not hosts:
        raise ConfigError(path, f"Redis URL {url!r} has no host", hint)
    for host in hosts.split(","):
        port = host.rpartition(":")[2] if ":" in host.lstrip("[").split("]")[-1] else "6379"
        if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ConfigError(path, f"bad port in {host!r} of Redis URL {url!r}", hint)
    db = parts.path.strip("/")
    if db and (not (db.isascii() and db.isdigit()) or parts.scheme == "redis+cluster"):
        raise ConfigError(path, f"bad database {db!r} in Redis URL {url!r}", "a database number; clusters "
                          "have only database 0")
    if parts.scheme != "redis+cluster" and "," in hosts:
        raise ConfigError(path, f"several hosts in {url!r}", "use redis+cluster:// for a cluster")
    return parts.scheme == "redis+cluster"


# ---- mappings and keys ------------------------------------------------------------------------------------

def as_mapping(value: Any, path: str) -> dict[str, Any]:
    """A mapping with string keys, as a plain dict."""
    value = unwrap(value)
    if not isinstance(value, Mapping):
        raise ConfigError(path or "config", f"expected a mapping, got {type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(join(path, str(key)), f"keys must be strings, got {type_name(key)}")
    return dict(value)


def as_list(value: Any, path: str) -> list[Any]:
    """A list (a YAML sequence)."""
    value = unwrap(value)
    if not isinstance(value, list | tuple):
        raise ConfigError(path, f"expected a list, got {type_name(value)}", "write [a, b] or one '- item' a line")
    return list(value)


def join(path: str, key: str) -> str:
    """``tiers[1]`` + ``capacity`` -> ``tiers[1].capacity``."""
    return f"{path}.{key}" if path else key


def suggest(word: str, valid: Iterable[str]) -> str:
    """'did you mean 'x'?' for the closest valid word, else the list of valid words."""
    valid = sorted(valid)
    close = difflib.get_close_matches(word, valid, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"


def check_keys(mapping: Mapping[str, Any], valid: Iterable[str], path: str) -> None:
    """Unknown keys are errors naming the key path and the closest valid key."""
    valid = set(valid)
    for key in mapping:
        if key not in valid:
            raise ConfigError(join(path, key), "unknown key", suggest(key, valid))


def choice(value: Any, path: str, valid: Iterable[str], what: str) -> str:
    """A string among ``valid``."""
    text = as_str(value, path)
    valid = list(valid)
    if text not in valid:
        raise ConfigError(path, f"unknown {what} {text!r}", suggest(text, valid))
    return text
