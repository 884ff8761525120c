"""What computes the KV, as a digest that joins every key's namespace: the model's config, dtype, quantization,
KV-cache dtype and the weights. Records written by other weights at the same path are then never read.

Weight modes (``namespace.weights``):

- ``auto`` (default): the hub snapshot's commit when the model comes from a Hugging Face hub cache (a hub id,
  or a path inside ``.../models--org--name/snapshots/<commit>``), else ``stat``.
- ``stat``: per weight file its name, size and mtime in nanoseconds. Costs one ``stat`` per file. Catches weights
  copied, downloaded or written over the path (each sets a new mtime); two hosts share records when their files
  carry the same mtimes (``rsync -a``, ``cp -p``, one image).
- ``content``: an XXH3-128 hash of every weight file's bytes. Same weights, same records on any host and path;
  costs reading the whole checkpoint once per engine process at start (``kvtier bench fingerprint``).
- ``off``: the weights are left out; the operator vouches for them through ``namespace.revision``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

WEIGHT_MODES = ("auto", "stat", "content", "off")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")
HUB_SNAPSHOT = re.compile(r"models--[^/]+--[^/]+/snapshots/([0-9a-f]{40})(?:/|$)")
READ_BYTES = 8 << 20


@dataclass(frozen=True)
class ModelFacts:
    """What the engine says about the model (plain values, so no engine import is needed here)."""

    model: str  # a local path or a hub id
    revision: str | None = None  # the hub revision asked for
    hf_config: Any = None  # the model's config as a mapping (vLLM: hf_config.to_dict())
    dtype: str = ""
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    load_format: str | None = None


def fingerprint(facts: ModelFacts, mode: str = "auto") -> str:
    """A hex digest of everything in ``facts`` and the weights under ``mode``."""
    body = {"config": _config_digest(facts.hf_config), "dtype": facts.dtype, "quantization": facts.quantization,
            "kv_cache_dtype": facts.kv_cache_dtype, "load_format": facts.load_format,
            "weights": weights_id(facts.model, facts.revision, mode)}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def weights_id(model: str, revision: str | None = None, mode: str = "auto") -> str:
    """The weights' identity under ``mode``: ``hub:<commit>``, ``stat:<digest>``, ``content:<digest>`` or ``off``."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights fingerprint mode {mode!r}; use one of {', '.join(WEIGHT_MODES)}")
    if mode == "off":
        return "off"
    if mode == "auto":
        commit = hub_commit(model, revision)
        if commit is not None:
            return f"hub:{commit}"
    files = weight_files(model)
    if not files:
        return f"path:{model}"  # nothing local to read (a hub id whose snapshot is not cached): its name only
    digest = _content_digest(model, files) if mode == "content" else _stat_digest(model, files)
    return f"{'content' if mode == 'content' else 'stat'}:{digest}"


def hub_commit(model: str, revision: str | None = None) -> str | None:
    """The commit of the hub snapshot ``model`` is (a path inside a hub cache) or resolves to (a hub id)."""
    match = HUB_SNAPSHOT.search(os.path.realpath(model)) if os.path.exists(model) else None
    if match is not None:
        return match.group(1)
    if os.path.exists(model) or model.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json", revision=revision)
    match = HUB_SNAPSHOT.search(found) if isinstance(found, str) else None
    return match.group(1) if match is not None else None


def weight_files(model: str) -> list[str]:
    """The weight files under ``model`` (by suffix; every regular non-hidden file if none has one), sorted."""
    if not os.path.isdir(model):
        return [model] if os.path.isfile(model) else []
    found: list[str] = []
    for root, dirs, names in os.walk(model):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(root, n) for n in names if not n.startswith("."))
    weights = [f for f in found if f.endswith(WEIGHT_SUFFIXES)]
    return sorted(weights or [f for f in found if os.path.isfile(f)])


def _stat_digest(model: str, files: Iterable[str]) -> str:
    rows = []
    for path in files:
        st = os.stat(path)
        rows.append([os.path.relpath(path, model) if os.path.isdir(model) else "", st.st_size, st.st_mtime_ns])
    return hashlib.blake2b(json.dumps(rows).encode(), digest_size=16).hexdigest()


def _content_digest(model: str, files: Iterable[str]) -> str:
    """XXH3-128 of every file's bytes (several GB/s: the disk is the limit, not the hash). Not cryptographic: it
    tells weights apart, it does not stand up to someone who can write the checkpoint."""
    import xxhash

    h = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    for path in files:
        h.update((os.path.relpath(path, model) if os.path.isdir(model) else "").encode() + b"\0")
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                h.update(view[:n])
    return h.hexdigest()


def _config_digest(config: Any) -> str:
    """The model config's digest, without private keys (``_name_or_path``: the same config at another path) and
    the version of the library that wrote it."""
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(config, sort_keys=True, default=_plain) if config is not None else ""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _plain(value: Any) -> str:
    """A value JSON does not know, as text that is the same in every process (no object addresses)."""
    text = str(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text
