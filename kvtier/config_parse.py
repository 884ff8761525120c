"""Parsing helpers of :mod:`kvtier.config`: scalars (sizes, durations, paths, URLs), key checks with
"did you mean" hints, the ``KVTIER_*`` environment layer and the deep merge of config layers.

Every helper takes the key path of the value it reads and raises :class:`ConfigError` naming that path.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import fields
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from kvtier.errors import ConfigError

ENV_PREFIX = "KVTIER_"

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


def parse_size(value: Any, path: str) -> int:
    """Bytes from an int or a string such as ``512MiB``, ``2GiB``, ``1.5GB``, ``64KiB``, ``10kB``, ``123``."""
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
    """Seconds from a number or a string such as ``50ms``, ``2s``, ``5m``, ``1h``, ``1h30m``, ``100us``."""
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
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(path, f"bad port in {host!r} of Redis URL {url!r}", hint)
    db = parts.path.strip("/")
    if db and (not db.isdigit() or parts.scheme == "redis+cluster"):
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


# ---- layers -----------------------------------------------------------------------------------------------

def plain(value: Any) -> Any:
    """Deep copy of mappings and lists into dicts and lists (leaves scalars)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def plain_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, leaving out None values and turning enums into their values."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            out[f.name] = value.value if isinstance(value, Enum) else value
    return out


def read_yaml(file: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML config file into a dict; every failure is a ConfigError naming the file."""
    name = os.fspath(file)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file {name!r} not found") from None
    except (OSError, ValueError) as exc:  # ValueError: undecodable text, or a NUL byte in the path
        raise ConfigError("", f"cannot read config file {name!r}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{name}: invalid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError("", f"{name}: YAML nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{name}: the top level must be a mapping, got {type_name(data)}")
    return data


def merge(base: dict[str, Any], over: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Deep-merge ``over`` into a copy of ``base``; the ``tiers`` lists merge by tier name."""
    out = dict(base)
    for key, value in over.items():
        sub = join(path, str(key))
        if key == "tiers" and not path and key in out and isinstance(unwrap(value), list | tuple):
            out[key] = merge_tiers(out[key], unwrap(value))
        elif isinstance(out.get(key), Mapping) and isinstance(value, Mapping):
            out[key] = merge(dict(out[key]), value, sub)
        else:
            out[key] = plain(value)
    return out


def merge_tiers(base: Any, over: list[Any] | tuple[Any, ...]) -> list[Any]:
    """Tiers of ``over`` update the tier of ``base`` with the same name, or are appended."""
    tiers = as_list(base, "tiers")
    for i, tier in enumerate(over):
        entry = as_mapping(tier, f"tiers[{i}]")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"tiers[{i}].name", "every tier given as an override needs a name",
                              "tiers are merged by name")
        for j, old in enumerate(tiers):
            if isinstance(old, Mapping) and old.get("name") == name:
                tiers[j] = merge(dict(old), entry, f"tiers[{j}]")
                break
        else:
            tiers.append(plain(entry))
    return tiers


def env_layer(env: Mapping[str, str], sections: Iterable[str],
              skip: Iterable[str] = ()) -> list[tuple[str, list[str], EnvScalar]]:
    """``KVTIER_A__B=v`` variables whose first part is a config section: (var, [a, b], value), sorted."""
    sections, skip = set(sections), set(skip)
    out = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in skip:
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX):].split("__")]
        if parts[0] in sections:
            out.append((var, parts, EnvScalar(var, env[var])))
    return out


def apply_env(data: dict[str, Any], var: str, parts: list[str], value: EnvScalar) -> dict[str, Any]:
    """Set one env variable's value into ``data``; ``tiers`` are addressed by (case-insensitive) name."""
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _tier_by_name(node, part, var)
        else:
            if part not in node or node[part] is None:
                node[part] = [] if (depth, part) == (0, "tiers") else {}
            node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(".".join(parts[: depth + 1]), f"{var} sets a key inside a {type_name(node)}")
    if isinstance(node, list):
        raise ConfigError(".".join(parts), f"{var} must name a key inside a tier",
                          "e.g. KVTIER_TIERS__CPU__CAPACITY=4GiB")
    parsed = value.parsed
    node[parts[-1]] = plain(parsed) if isinstance(parsed, Mapping | list) else value
    return data


def _tier_by_name(tiers: list[Any], name: str, var: str) -> dict[str, Any]:
    names = []
    for tier in tiers:
        if isinstance(tier, dict) and isinstance(tier.get("name"), str):
            names.append(tier["name"])
            if tier["name"].lower().replace("-", "_") == name:
                return tier
    raise ConfigError("tiers", f"{var}: no tier named {name!r}", suggest(name, [n.lower() for n in names]))
