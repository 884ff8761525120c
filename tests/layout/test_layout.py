"""Layout model: bytes per token and chunk for each spec kind, and conversion from vLLM-shaped objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.layout import (
    FullAttentionSpec,
    GroupKind,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    dtype_name,
    from_vllm,
    simple_config,
)


def test_full_attention_bytes() -> None:
    spec = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert spec.bytes_per_token_per_layer() == 2 * 8 * 128 * 2
    assert spec.page_size_bytes == 16 * 4096
    group = KVCacheGroupSpec(tuple(f"l{i}" for i in range(32)), spec)
    assert group.kind is GroupKind.FULL_ATTENTION
    assert group.bytes_per_token() == 32 * 4096
    assert group.bytes_per_chunk(256) == 256 * 32 * 4096  # 32 MiB: Llama-3-8B, one 256-token chunk


def test_sliding_window_bytes_match_full_attention() -> None:
    swa = SlidingWindowSpec(16, 4, 64, "float16", sliding_window=1024)
    assert swa.kind is GroupKind.SLIDING_WINDOW
    assert swa.bytes_per_token_per_layer() == 2 * 4 * 64 * 2
    assert swa.describe()["sliding_window"] == 1024


def test_mla_stores_one_latent_per_token() -> None:
    mla = MLAAttentionSpec(64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert mla.kind is GroupKind.MLA
    assert mla.bytes_per_token_per_layer() == 576 * 2
    assert KVCacheGroupSpec(("a", "b"), mla).bytes_per_chunk(128) == 128 * 2 * 1152


def test_mamba_state_is_per_request_not_per_token() -> None:
    spec = MambaSpec(16, shapes=((4, 128), (8, 64, 16)), dtypes=("float32", "bfloat16"))
    per_layer = 4 * 128 * 4 + 8 * 64 * 16 * 2
    assert spec.state_bytes_per_layer() == per_layer == spec.page_size_bytes
    group = KVCacheGroupSpec(("m0", "m1", "m2"), spec)
    assert group.bytes_per_token() == 0
    assert group.bytes_per_chunk(256) == group.bytes_per_chunk(16) == 3 * per_layer


def test_float8_bytes() -> None:
    assert FullAttentionSpec(16, 8, 128, "float8_e4m3fn").bytes_per_token_per_layer() == 2 * 8 * 128


def test_simple_config_with_sliding_window_layers() -> None:
    cfg = simple_config(4, 2, 64, "bf16", block_size=16, sliding_window=128, swa_layers=[1, 3], num_blocks=10)
    full, swa = cfg.kv_cache_groups
    assert full.layer_names == ("model.layers.0.self_attn", "model.layers.2.self_attn")
    assert swa.kind is GroupKind.SLIDING_WINDOW and len(swa.layer_names) == 2
    assert cfg.group_of_layer()["model.layers.3.self_attn"] == 1 and cfg.num_blocks == 10
    with pytest.raises(ValueError, match="sliding_window"):
        simple_config(2, 1, 8, swa_layers=[0])


@pytest.mark.parametrize("given,want", [
    (torch.bfloat16, "bfloat16"), ("torch.float16", "float16"), ("fp8", "float8_e4m3fn"), ("auto", "bfloat16"),
    (torch.float8_e5m2, "float8_e5m2"), ("half", "float16"),
])
def test_dtype_names(given: Any, want: str) -> None:
    assert dtype_name(given) == want


def test_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        dtype_name("complex64")


# Duck-typed stand-ins with vLLM's class names and fields (vLLM itself is tested in the integration suite).
@dataclass
class FullAttentionSpecV:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    sliding_window: int | None = None


class SlidingWindowSpecV(FullAttentionSpecV):
    pass


class MLAAttentionSpecV(FullAttentionSpecV):
    pass


@dataclass
class MambaSpecV:
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class VllmConfig:
    kv_cache_groups: list[Group] = field(default_factory=list)
    num_blocks: int = 0


def test_from_vllm_duck_typed() -> None:
    vcfg = VllmConfig([
        Group(["a.0", "a.1"], FullAttentionSpecV(16, 8, 128, torch.bfloat16)),
        Group(["s.0"], SlidingWindowSpecV(16, 8, 128, torch.bfloat16, sliding_window=512)),
        # HMA off: vLLM merges sliding-window layers into a FullAttentionSpec carrying a window; restoring
        # every chunk (full attention) is always correct for it
        Group(["w.0"], FullAttentionSpecV(16, 8, 128, "float16", sliding_window=256)),
        Group(["m.0"], MLAAttentionSpecV(32, 1, 576, torch.bfloat16)),
        Group(["x.0"], MambaSpecV(16, ((2, 4), (3,)), (torch.float32, torch.bfloat16))),
    ], num_blocks=77)
    cfg = from_vllm(vcfg)
    kinds = [g.kind for g in cfg.kv_cache_groups]
    assert kinds == [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.FULL_ATTENTION, GroupKind.MLA,
                     GroupKind.MAMBA]
    assert cfg.num_blocks == 77 and cfg.kv_cache_groups[0].layer_names == ("a.0", "a.1")
    assert cfg.kv_cache_groups[0].bytes_per_token() == 2 * 2 * 8 * 128 * 2
    swa = cfg.kv_cache_groups[1].kv_cache_spec
    assert isinstance(swa, SlidingWindowSpec) and swa.sliding_window == 512
    assert cfg.kv_cache_groups[3].bytes_per_chunk(64) == 64 * 576 * 2
    assert cfg.kv_cache_groups[4].bytes_per_chunk(999) == 2 * 4 * 4 + 3 * 2
    assert from_vllm(cfg) is cfg


def test_describe_is_plain_and_stable() -> None:
    spec = FullAttentionSpec(16, 8, 128, "bfloat16")
    assert spec.describe() == {"kind": "full_attention", "block_size": 16, "num_kv_heads": 8, "head_size": 128,
                               "dtype": "bfloat16"}
    assert KVCacheConfig((KVCacheGroupSpec(("a",), spec),)).group_of_layer() == {"a": 0}


class ChunkedLocalAttentionSpecV(FullAttentionSpecV):
    pass


@dataclass
class UniformTypeKVCacheSpecsV:
    block_size: int
    kv_cache_specs: dict[str, Any]


@dataclass
class LayoutConfig:
    kv_cache_groups: list[Group]
    num_blocks: int = 0
    kv_cache_layout: Any = None


def test_from_vllm_keeps_the_layout_and_marks_caches_kvtier_does_not_serve() -> None:
    full = FullAttentionSpecV(32, 2, 64, torch.float32)
    compressed = MLAAttentionSpecV(64, 1, 576, torch.bfloat16)
    compressed.tokens_per_state = 4  # type: ignore[attr-defined]  (DeepSeek-V4-style compressed states)
    vcfg = LayoutConfig([
        Group(["a"], full),
        Group(["u.0", "u.1"], UniformTypeKVCacheSpecsV(32, {"u.0": full, "u.1": full})),
        Group(["m.0", "m.1"], UniformTypeKVCacheSpecsV(32, {"m.0": full, "m.1": FullAttentionSpecV(32, 4, 64,
                                                                                                   torch.float32)})),
        Group(["c"], ChunkedLocalAttentionSpecV(32, 2, 64, torch.float32)),
        Group(["x"], compressed),
    ], num_blocks=8, kv_cache_layout="LBHNC")
    cfg = from_vllm(vcfg)
    assert cfg.kv_layout == "LBHNC" and cfg.num_blocks == 8
    kinds = [g.kind for g in cfg.kv_cache_groups]
    assert kinds == [GroupKind.FULL_ATTENTION, GroupKind.FULL_ATTENTION, GroupKind.OTHER, GroupKind.OTHER,
                     GroupKind.OTHER]
    assert [getattr(g.kv_cache_spec, "name", None) for g in cfg.kv_cache_groups[2:]] == [
        "UniformTypeKVCacheSpecsV(mixed)", "ChunkedLocalAttentionSpecV", "MLAAttentionSpecV"]


class KVCacheLayoutV(Enum):  # vLLM's KVCacheLayout members are read by name
    LBHNC = 0
    LBNHC = 1


def _engine(cache_layout: Any = None, device: str | None = "cuda") -> Any:
    from kvtier.connector.settings import read_settings

    return read_settings(SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=cache_layout),
                                         device_config=SimpleNamespace(device_type=device)))


def test_from_vllm_resolves_the_layout_once_from_the_kv_cache_config_or_the_cache_config() -> None:
    """The KV-cache config's layout wins, else the cache config's; by canonical name, with the device type as the
    packing; no layout means no packing. A converted config passes through unchanged."""
    groups = [Group(["a"], FullAttentionSpecV(16, 2, 64, torch.float16))]
    own = LayoutConfig(groups, 4, KVCacheLayoutV.LBHNC)
    assert from_vllm(own).kv_layout == "LBHNC" and from_vllm(own).kv_packing is None
    resolved = from_vllm(own, _engine("LBNHC"))
    assert (resolved.kv_layout, resolved.kv_packing, resolved.num_blocks) == ("LBHNC", "cuda", 4)
    legacy = from_vllm(LayoutConfig(groups, 4), _engine("NHD", device="cpu"))
    assert (legacy.kv_layout, legacy.kv_packing) == ("LBNHC", "cpu")
    unknown = from_vllm(LayoutConfig(groups, 4), _engine("xyz", device=None))
    assert (unknown.kv_layout, unknown.kv_packing) == ("XYZ", None)  # refused where the worker reads a view
    none = from_vllm(LayoutConfig(groups, 4), _engine())
    assert (none.kv_layout, none.kv_packing) == (None, None)
    assert from_vllm(resolved) is resolved and from_vllm(resolved, _engine("LBNHC")) == resolved
    assert from_vllm(from_vllm(own), _engine(device="cpu")).kv_packing == "cpu"


@dataclass
class FullAttentionSpecPackedV(FullAttentionSpecV):
    """vLLM >= 0.32's attention spec fields for how a page is packed."""

    head_size_v: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None


def test_page_packing_joins_the_namespace_and_registered_views_must_follow_it() -> None:
    """Two specs whose pages have one shape (2 head slots of 512 bytes per token) but pack them differently (V's
    head size 64 vs 32) never share records, nor with a spec that does not say how it packs; a view that does not
    follow its spec is refused."""
    from kvtier.connector.keying import Identity, group_namespace
    from kvtier.connector.worker.registration import check_packing
    from kvtier.errors import ConnectorError

    heads_then_kv = FullAttentionSpecPackedV(32, 2, 64, torch.float32, None, 64, 2, 512)
    kv_then_heads = FullAttentionSpecPackedV(32, 2, 64, torch.float32, None, 64, 2, 512)
    kv_then_heads.head_size_v = 32  # another packing of the same page shape: differs in what C holds
    plain = from_vllm(VllmConfig([Group(["a"], FullAttentionSpecV(32, 2, 64, torch.float32))]))
    packed = [from_vllm(VllmConfig([Group(["a"], s)])) for s in (heads_then_kv, kv_then_heads)]
    spec = packed[0].kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, FullAttentionSpec)
    assert (spec.head_size_v, spec.head_slots, spec.content_bytes) == (64, 2, 512)
    assert spec.describe()["content_bytes"] == 512 and "content_bytes" not in plain.kv_cache_groups[0].kv_cache_spec.describe()
    assert spec.bytes_per_token_per_layer() == 2 * 512
    ident = Identity("m")
    digests = {group_namespace(ident, cfg.kv_cache_groups[0], 64) for cfg in (plain, *packed)}
    assert len(digests) == 3

    check_packing("a", torch.zeros(4, 2, 32, 128), spec)  # 2 slots x 128 float32 = 512 bytes: follows the spec
    with pytest.raises(ConnectorError, match="head slots"):
        check_packing("a", torch.zeros(4, 4, 32, 64), spec)
