"""Reference CPU engine: a tiny paged-attention transformer and a vLLM-like scheduler loop that drives any
kvtier connector in vLLM's call order, plus the conformance harness and the ``kvtier demo`` workload.

    from kvtier.engine import Engine, EngineArgs, ModelConfig, KVTierPair, run_conformance
"""

from __future__ import annotations

from kvtier.engine.core import Engine, EngineArgs, KVTierPair, RequestSpec, factory_connector
from kvtier.engine.harness import ConformanceResult, run_conformance
from kvtier.engine.model import ModelConfig, TinyTransformer, reference_logits
from kvtier.engine.scheduler import EngineRequest, RequestStatus
from kvtier.engine.workload import ChatSpec, chat_conversations, run_chat, shared_prefix_waves

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
