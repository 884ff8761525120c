"""The one reader of an engine's settings: kvtier's part of the transfer config, and what kvtier needs of the
engine's ``vllm_config`` (prefix caching, chunked prefill, parallel sizes, the model that computes the KV).

No other kvtier module reads ``vllm_config`` or ``kv_connector_extra_config``: they take an ``EngineSettings``
(or the values read here). An engine without a field (kvtier's reference engine, a test's bare namespace) gets
the default, so one code path serves vLLM 0.32, vLLM 0.33 and the reference engine. Torch-free.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConnectorError
from kvtier.layout import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, dtype_name
from kvtier.records.fingerprint import ModelFacts


@dataclass(frozen=True)
class EngineSettings:
    """What kvtier reads of an engine's config, once per connector."""

    extra: Mapping[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    prefix_caching: bool | None = None  # None: the engine does not say (it may resume from a cached prefix)
    chunked_prefill: bool | None = None
    pipeline_size: int = 1
    tp_size: int = 1
    rank: int = 0  # the parallel config's rank (its tensor-parallel rank is ``rank % tp_size``)
    model: str | None = None  # the engine's model name or path
    kv_cache_layout: Any = None  # the cache config's KV-cache layout, if it names one (kvtier.layout.from_vllm)
    device_type: str | None = None  # where the KV cache lives ("cpu", "cuda"): how pages are packed
    mamba_cache_mode: str | None = None  # vLLM's recurrent-state caching ("align": a state every block)
    kv_events: bool = False  # the engine publishes KV-cache events (vLLM's kv_events_config)
    source: Any = field(default=None, repr=False, compare=False)  # the engine's config, for model_facts

    def model_facts(self) -> ModelFacts | None:
        """What the engine says about the model that computes the KV (kvtier.records.fingerprint); None without a model
        config. Reads the model's config, so call it only where a fingerprint is taken."""
        return model_facts(self.source)


def read_settings(vllm_config: Any) -> EngineSettings:
    """The settings of ``vllm_config`` (None: an engine that says nothing)."""
    if vllm_config is None:
        return EngineSettings()
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return EngineSettings(
        extra=extra_config(getattr(vllm_config, "kv_transfer_config", None)),
        prefix_caching=getattr(cache, "enable_prefix_caching", None),
        chunked_prefill=getattr(getattr(vllm_config, "scheduler_config", None), "enable_chunked_prefill", None),
        pipeline_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        rank=int(getattr(parallel, "rank", 0) or 0),
        model=None if model is None else str(model),
        kv_cache_layout=getattr(cache, "kv_cache_layout", None),
        mamba_cache_mode=_text(getattr(cache, "mamba_cache_mode", None)),
        device_type=str(device) if device else None,
        kv_events=bool(getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False)),
        source=vllm_config)


def extra_config(kv_transfer_config: Any) -> dict[str, Any]:
    """A transfer config's ``kv_connector_extra_config`` (a copy; empty when it has none)."""
    return dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})


def child_fields(kv_transfer_config: Any) -> list[dict[str, Any]]:
    """The fields of each child of a chained connector (``extra_config["connectors"]``), each inheriting the
    parent's ``engine_id`` unless it names its own; a missing or malformed list is a ``ConnectorError``."""
    children = extra_config(kv_transfer_config).get("connectors")
    if not children or not isinstance(children, list):
        raise ConnectorError(
            "MultiConnector needs kv_connector_extra_config['connectors']: a non-empty list of connector configs "
            "such as {'kv_connector': 'KVTierConnector', 'kv_role': 'kv_both'}")
    fields = []
    for i, child in enumerate(children):
        if not isinstance(child, Mapping):
            raise ConnectorError(f"kv_connector_extra_config['connectors'][{i}] must be a dict, got {child!r}")
        fields.append({**child, "engine_id": child.get("engine_id", kv_transfer_config.engine_id)})
    return fields


def child_configs(config: Any) -> list[Any]:
    """One shallow copy of the engine's ``config`` per configured child, each with its own transfer config (of
    the parent's type)."""
    ktc = config.kv_transfer_config
    configs = []
    for i, fields in enumerate(child_fields(ktc)):
        try:
            child_ktc = type(ktc)(**fields)
        except (TypeError, ValueError) as exc:
            raise ConnectorError(f"kv_connector_extra_config['connectors'][{i}]: {exc}") from exc
        sub = copy.copy(config)
        sub.kv_transfer_config = child_ktc
        configs.append(sub)
    return configs


def model_facts(vllm_config: Any) -> ModelFacts | None:
    """What a vLLM config says about the model that computes the KV (None without a model config)."""
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "model", None)
    if model is None:
        return None
    hf_config = getattr(model_config, "hf_config", None)
    to_dict = getattr(hf_config, "to_dict", None)
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    load_config = getattr(vllm_config, "load_config", None)
    return ModelFacts(str(model), _text(getattr(model_config, "revision", None)),
                      to_dict() if callable(to_dict) else None, str(getattr(model_config, "dtype", "")),
                      _text(getattr(model_config, "quantization", None)), _text(cache_dtype),
                      _text(getattr(load_config, "load_format", None)),
                      _text(getattr(load_config, "download_dir", None)),
                      _text(getattr(model_config, "model_weights", None)) or None,
                      _text(getattr(model_config, "weights_identity", None)))


def layout_from_model(vllm_config: Any) -> KVCacheConfig:
    """A one-group layout from the engine's model and cache config, for schedulers given no KV-cache config."""
    try:
        model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        dtype = cache.cache_dtype if cache.cache_dtype not in (None, "auto") else model.dtype
        spec = FullAttentionSpec(int(cache.block_size), int(model.get_num_kv_heads(parallel)),
                                 int(model.get_head_size()), dtype_name(dtype))
        layers = int(model.get_num_layers(parallel))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConnectorError("KVTierConnector needs a kv_cache_config, or a vllm_config with model_config, "
                             f"parallel_config and cache_config to derive one ({exc})") from exc
    return KVCacheConfig((KVCacheGroupSpec(tuple(f"layer.{i}" for i in range(layers)), spec),))


def _text(value: Any) -> str | None:
    return None if value is None else str(getattr(value, "value", value))
