"""Reference CPU engine: a tiny paged-attention transformer and a vLLM-like scheduler loop that drives any
kvtier connector in vLLM's call order, plus the conformance harness and the ``kvtier demo`` workload.

    from kvtier.engine import Engine, EngineArgs, ModelConfig, KVTierPair, run_conformance
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.engine.core import Engine, EngineArgs, KVTierPair, RequestSpec, factory_connector
    from kvtier.engine.harness import ConformanceResult, run_conformance
    from kvtier.engine.model import ModelConfig, TinyTransformer, reference_logits
    from kvtier.engine.scheduler import EngineRequest, RequestStatus
    from kvtier.engine.workload import ChatSpec, chat_conversations, run_chat, shared_prefix_waves

# imported on first use (torch is heavy): ``kvtier demo --help`` loads none of it
_WHERE = {
    "Engine": "core", "EngineArgs": "core", "KVTierPair": "core", "RequestSpec": "core", "factory_connector": "core",
    "ConformanceResult": "harness", "run_conformance": "harness", "ModelConfig": "model",
    "TinyTransformer": "model", "reference_logits": "model", "EngineRequest": "scheduler",
    "RequestStatus": "scheduler", "ChatSpec": "workload", "chat_conversations": "workload", "run_chat": "workload",
    "shared_prefix_waves": "workload",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(name)
    return getattr(import_module(f"kvtier.engine.{_WHERE[name]}"), name)


__all__ = [
    "ChatSpec",
    "ConformanceResult",
    "Engine",
    "EngineArgs",
    "EngineRequest",
    "KVTierPair",
    "ModelConfig",
    "RequestSpec",
    "RequestStatus",
    "TinyTransformer",
    "chat_conversations",
    "factory_connector",
    "reference_logits",
    "run_chat",
    "run_conformance",
    "shared_prefix_waves",
]
