"""Integration tests against REAL vLLM on CPU, 0.33 and 0.34 (marked ``vllm``; scripts/test.sh runs them on both).

The environment is set before any ``vllm.`` submodule is imported (vLLM resolves its platform at import).
A missing vLLM makes collection FAIL (``import vllm`` below), never skip: CI must install it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "VLLM_CACHE_ROOT" not in os.environ:  # vLLM writes a model-info cache there; keep ~/.cache clean
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="kvtier-vllm-cache-")
    atexit.register(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], True)

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm  # (fails, not skips, when vLLM is missing)
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)


def _vllm_034_platform_shim() -> None:
    """TEST-ONLY SHIM, never needed by kvtier: vLLM 0.34's CPU platform refuses x86 CPUs without triton-cpu in
    ``CpuPlatform.check_and_update_config`` ("vLLM on x86 CPUs requires Triton (triton-cpu).") and no registry
    here has triton-cpu. These tests build vLLM's config objects and run its scheduler, allocator and factory but
    no kernel, so for that one check only Triton is reported present; everything else the check does runs as
    vLLM wrote it."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if triton_utils.HAS_TRITON or getattr(CpuPlatform, "_kvtier_test_shim", False):
        return
    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = False

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]
    CpuPlatform._kvtier_test_shim = True  # type: ignore[attr-defined]


VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split(".")[:2])
if VLLM_VERSION >= (0, 34):
    _vllm_034_platform_shim()


BLOCK_SIZE = 16
NUM_LAYERS = 4
KV_HEADS = 2
HEAD_SIZE = 32
DTYPE = torch.float16
NUM_BLOCKS = 64
SLIDING_WINDOW = 128
KVTIER_MODULE = "kvtier.integrations.vllm"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_SIZE, "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float16",
    "rms_norm_eps": 1e-5,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _spec(swa: bool) -> Any:
    if swa:
        return SlidingWindowSpec(BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE,
                                 sliding_window=SLIDING_WINDOW)
    return FullAttentionSpec(BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)


def planned_kv_cache_config(hybrid: bool, layout: str = "LBHNC", num_blocks: int = NUM_BLOCKS) -> Any:
    """vLLM's own planner's KVCacheConfig for the tiny model in ``layout`` (as the engine core resolves it):
    one full-attention group, or full (layers 0, 2) + sliding window (1, 3) sharing the same tensors."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    cfg = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_SIZE))
    cfg.cache_config.kv_cache_layout = layout
    if hybrid:
        groups = [KVCacheGroupSpec([layer_name(0), layer_name(2)], _spec(False)),
                  KVCacheGroupSpec([layer_name(1), layer_name(3)], _spec(True))]
    else:
        groups = [KVCacheGroupSpec([layer_name(i) for i in range(NUM_LAYERS)], _spec(False))]
    memory = num_blocks * NUM_LAYERS * _spec(False).page_size_bytes // len(groups)
    kcc = get_kv_cache_config_from_groups(cfg, groups, memory)
    kcc.kv_cache_layout = layout  # what the engine core records before the workers allocate
    return kcc


def kv_views(kcc: Any, kernel_block_size: int | None = None) -> dict[str, torch.Tensor]:
    """The per-layer ``[B, H, N, C]`` views vLLM's worker allocates for ``kcc`` (its own allocate_kv_cache)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kernels = None if kernel_block_size is None else [kernel_block_size] * len(kcc.kv_cache_groups)
    return allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[kcc.kv_cache_layout], kernels)


def token_cell(view: torch.Tensor, block: int, offset: int, kv: int) -> torch.Tensor:
    """K (kv=0) or V (1) of every head of one token of a manager block in a ``[B, H, N, C]`` view (C packs K
    then V), following kernel blocks when the view's blocks are smaller than ``BLOCK_SIZE``."""
    per = view.shape[2]
    ratio = BLOCK_SIZE // per
    kernel_block, kernel_offset = block * ratio + offset // per, offset % per
    return view[kernel_block, :, kernel_offset, kv * HEAD_SIZE:(kv + 1) * HEAD_SIZE]


def make_kv_cache_config(hybrid: bool, num_blocks: int = NUM_BLOCKS) -> Any:
    """vLLM KVCacheConfig by hand: one full-attention group, or full (layers 0, 2) + sliding window (1, 3)."""
    if not hybrid:
        layers = [layer_name(i) for i in range(NUM_LAYERS)]
        spec = _spec(False)
        tensors = [KVCacheTensor(size=spec.page_size_bytes * num_blocks, layers=[name], layer_stride=0,
                                 block_stride=spec.page_size_bytes) for name in layers]
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                             kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    full, swa = [layer_name(0), layer_name(2)], [layer_name(1), layer_name(3)]
    page = _spec(False).page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks, layers=[f, s], layer_stride=0, block_stride=page)
               for f, s in zip(full, swa, strict=True)]
    groups = [KVCacheGroupSpec(full, _spec(False)), KVCacheGroupSpec(swa, _spec(True))]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


@pytest.fixture(scope="session")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny LlamaForCausalLM described by a local config.json (no weights, no network)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float16", max_model_len=1024)


@pytest.fixture
def kvtier_config_file(tmp_path: Path) -> Callable[..., str]:
    """Write a kvtier YAML config (memory tiers, small chunks) and return its path."""

    def write(tiers: str = "[{name: cpu, kind: cpu, capacity: 4MiB}]", chunk_size: int = 16,
              placement: str | None = None) -> str:
        text = f"chunk_size: {chunk_size}\nnamespace: {{model: default, revision: main}}\ntiers: {tiers}\n"
        if placement:
            text += f"placement: {placement}\n"
        path = tmp_path / f"kvtier-{len(list(tmp_path.glob('kvtier-*.yaml')))}.yaml"
        path.write_text(text)
        return str(path)

    return write


@pytest.fixture
def make_vllm_config(model_config: Any) -> Callable[..., Any]:
    """A real VllmConfig around a kv_transfer_config dict; ``disable_hma`` None = vLLM's default decision."""

    def build(transfer: dict[str, Any], disable_hma: bool | None = None, with_model: bool = True,
              prefix_caching: bool = True, chunked_prefill: bool = True) -> Any:
        scheduler = SchedulerConfig.default_factory(disable_hybrid_kv_cache_manager=disable_hma)
        scheduler.enable_chunked_prefill = chunked_prefill
        return VllmConfig(model_config=model_config if with_model else None,
                          cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
                          scheduler_config=scheduler, kv_transfer_config=KVTransferConfig(**transfer))

    return build


def kvtier_transfer(config_file: str, **extra: Any) -> dict[str, Any]:
    """The kv_transfer_config dict a user gives vLLM for kvtier's connector."""
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": KVTIER_MODULE, "kv_role": "kv_both",
            "kv_buffer_device": "cpu", "kv_connector_extra_config": {"config_file": config_file, **extra}}


def kv_tensors(kcc: Any) -> dict[str, torch.Tensor]:
    """CPU paged KV tensors, one per layer, vLLM's ``[2, num_blocks, block_size, heads, head]`` layout."""
    return {name: torch.zeros(2, kcc.num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=DTYPE)
            for group in kcc.kv_cache_groups for name in group.layer_names}


class Kit:
    """The helpers above, for test modules (a fixture: importing ``conftest`` by name is ambiguous)."""

    BLOCK_SIZE = BLOCK_SIZE
    NUM_LAYERS = NUM_LAYERS
    KVTIER_MODULE = KVTIER_MODULE
    layer_name = staticmethod(layer_name)
    make_kv_cache_config = staticmethod(make_kv_cache_config)
    planned_kv_cache_config = staticmethod(planned_kv_cache_config)
    kv_views = staticmethod(kv_views)
    token_cell = staticmethod(token_cell)
    kvtier_transfer = staticmethod(kvtier_transfer)
    kv_tensors = staticmethod(kv_tensors)


@pytest.fixture(scope="session")
def kit() -> type[Kit]:
    return Kit


def pytest_report_header() -> str:
    """The vLLM these tests ran against, in the log (scripts/test.sh runs them on 0.33 and on 0.34)."""
    return f"vLLM {vllm.__version__} (integration tests)"
