"""What computes the KV, as a digest that joins every key's namespace: the model's config, dtype, quantization,
KV-cache dtype and the weights. Records written by other weights at the same path are then never read.

Weight modes (``namespace.weights``):

- ``auto`` (default): the hub snapshot's commit when the weights are a Hugging Face hub snapshot (a hub id
  resolved in the local hub cache, or a path inside ``.../models--org--name/snapshots/<commit>``), else ``stat``.
- ``stat``: per weight file its name, size and mtime in nanoseconds. Costs one ``stat`` per file. Catches weights
  copied, downloaded or written over the path (each sets a new mtime); two hosts share records when their files
  carry the same mtimes (``rsync -a``, ``cp -p``, one image).
- ``content``: an XXH3-128 hash of every weight file's bytes. Same weights, same records on any host and path;
  costs reading the weights at start, once in the scheduler's process and once in each tensor-parallel worker
  of rank 1 and up (``kvtier bench fingerprint``).
- ``off``: the weights are left out; the operator vouches for them through ``namespace.revision``.

Weights kvtier cannot find or read raise :class:`FingerprintError` (never a name-only identity): the connector
then serves nothing rather than risk another model's KV.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.config.tree import WEIGHT_MODES

# the files an engine loads, in the order vLLM prefers them: the first kind present at the top level is the weights
WEIGHT_KINDS = ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",), (".ckpt", ".h5", ".msgpack", ".npz"))
# what vLLM's load formats read first (``pt`` and ``npcache`` take .bin/.pt files even beside safetensors)
LOAD_FORMAT_KINDS = {"pt": (".bin", ".pt", ".pth"), "npcache": (".bin", ".pt", ".pth"),
                     "safetensors": (".safetensors",), "gguf": (".gguf",)}
HUB_SNAPSHOT = re.compile(r"models--[^/]+--[^/]+/snapshots/([0-9a-f]{40})(?:/|$)")
READ_BYTES = 8 << 20


class FingerprintError(ValueError):
    """The weights could not be found or read."""


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
    download_dir: str | None = None  # the hub cache the engine downloads into, when not the default
    weights_path: str | None = None  # where the weights are when not beside the config (vLLM: model_weights)
    weights_identity: str | None = None  # an engine's own name for weights it generates (kvtier's reference engine)


def fingerprint(facts: ModelFacts, mode: str = "auto") -> str:
    """A hex digest of everything in ``facts`` and the weights under ``mode``; raises ``FingerprintError``."""
    body = {"config": _config_digest(facts.hf_config), "dtype": facts.dtype, "quantization": facts.quantization,
            "kv_cache_dtype": facts.kv_cache_dtype, "load_format": facts.load_format,
            "weights": (f"engine:{facts.weights_identity}" if facts.weights_identity is not None and mode != "off"
                        else weights_id(facts.weights_path or facts.model, facts.revision, mode, facts.download_dir,
                                        facts.load_format))}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def weights_id(model: str, revision: str | None = None, mode: str = "auto", download_dir: str | None = None,
               load_format: str | None = None) -> str:
    """The weights' identity under ``mode``: ``hub:<commit>``, ``stat:<digest>``, ``content:<digest>`` or ``off``."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights fingerprint mode {mode!r}; use one of {', '.join(WEIGHT_MODES)}")
    if mode == "off":
        return "off"
    local = local_weights(model, revision, download_dir)
    if local is None:
        raise FingerprintError(f"no local copy of {model!r} (revision {revision}) to fingerprint")
    if mode == "auto":
        match = HUB_SNAPSHOT.search(os.path.realpath(local))
        if match is not None:
            return f"hub:{match.group(1)}"
    files = weight_files(local, load_format)
    if not files:
        raise FingerprintError(f"no weight files under {local!r}")
    if mode == "content":
        return f"content:{_content_digest(local, files)}"
    return f"stat:{_stat_digest(local, files)}"


def hub_commit(model: str, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """The commit of the hub snapshot ``model`` is (a path inside a hub cache) or resolves to (a hub id)."""
    local = local_weights(model, revision, download_dir)
    match = HUB_SNAPSHOT.search(os.path.realpath(local)) if local is not None else None
    return match.group(1) if match is not None else None


def local_weights(model: str, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """A local path of the weights: ``model`` itself when it exists, else the hub cache's snapshot of the hub id
    ``model`` at ``revision`` (None when there is none or ``model`` is no valid hub id)."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception:  # not installed, not a hub id, not cached: nothing local to read
        return None


def weight_files(model: str, load_format: str | None = None) -> list[str]:
    """The weight files of ``model`` as an engine loads them: the first kind of :data:`WEIGHT_KINDS` found among
    the regular, non-hidden files at its top level (the kind ``load_format`` names first: vLLM's ``pt`` and
    ``npcache`` load ``.bin``/``.pt`` files even beside safetensors), sorted; every such file if none is of a
    known kind (then the config and tokenizer files count too); a file path is its own weights."""
    if os.path.isfile(model):
        return [model]
    if not os.path.isdir(model):
        return []
    found = sorted(os.path.join(model, n) for n in os.listdir(model)
                   if not n.startswith(".") and os.path.isfile(os.path.join(model, n)))
    first = LOAD_FORMAT_KINDS.get(load_format or "")
    for suffixes in ((first,) if first else ()) + WEIGHT_KINDS:
        chosen = [f for f in found if f.endswith(suffixes)]
        if chosen:
            return chosen
    return found


def _name(model: str, path: str) -> str:
    return os.path.relpath(path, model) if os.path.isdir(model) else ""


def _stat_digest(model: str, files: Iterable[str]) -> str:
    rows = []
    for path in files:
        st = os.stat(path)
        rows.append([_name(model, path), st.st_size, st.st_mtime_ns])
    return hashlib.blake2b(json.dumps(rows).encode(), digest_size=16).hexdigest()


def _content_digest(model: str, files: Iterable[str]) -> str:
    """XXH3-128 of every file's bytes (several GB/s: the disk is the limit, not the hash). Not cryptographic: it
    tells weights apart, it does not stand up to someone who can write the checkpoint."""
    import xxhash

    h = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    for path in files:
        h.update(_name(model, path).encode() + b"\0")
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                h.update(view[:n])
    return h.hexdigest()


def _config_digest(config: Any) -> str:
    """The model config's digest, without private keys (``_name_or_path``: the same config at another path) and
    the version of the library that wrote it."""
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if not str(k).startswith("_") and k != "transformers_version"}
    text = json.dumps(_str_keys(config), sort_keys=True, default=_plain) if config is not None else ""
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _str_keys(value: Any) -> Any:
    """Mappings with text keys all the way down (keys of mixed types cannot be sorted)."""
    if isinstance(value, dict):
        return {str(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_str_keys(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """A value JSON does not know, as something that is the same in every process: sets sorted, no object
    addresses."""
    if isinstance(value, set | frozenset):
        return sorted(str(v) for v in value)
    text = str(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text
