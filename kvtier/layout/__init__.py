"""Engine-neutral model of an engine's KV-cache layout (mirrors vLLM's ``kv_cache_interface``).

A ``KVCacheConfig`` holds groups; each group is a set of layers sharing one block table and one spec. The
spec says how many bytes one token (attention) or one state (Mamba) takes per layer. ``from_vllm`` converts
vLLM objects by duck typing, so this module never imports vllm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

from kvtier.layout.geometry import canonical_layout

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ('bfloat16') from a torch dtype, numpy dtype or string ('torch.bfloat16', 'bf16')."""
    text = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
               "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "auto": "bfloat16"}
    text = aliases.get(text, text)
    if text not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; use one of {sorted(DTYPE_SIZES)}")
    return text


class GroupKind(StrEnum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"
    OTHER = "other"  # a cache kvtier cannot serve (never saved or loaded; requests of such models never hit)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer of a group stores per block."""

    block_size: int
    kind: GroupKind = field(init=False, default=GroupKind.FULL_ATTENTION)

    def bytes_per_token_per_layer(self) -> int:
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token_per_layer()

    def describe(self) -> dict[str, Any]:
        """Plain description used in namespaces (must be stable across processes)."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Attention KV. ``head_size_v``, ``head_slots`` and ``content_bytes`` say how the engine packs a page (vLLM
    >= 0.32: V's head size, the H axis of a layer's ``[B, H, N, C]`` view and C in bytes when packed); None where
    the engine does not say. They join the namespace: two backends whose pages have one shape but pack K and V
    differently never share records."""

    num_kv_heads: int = 1
    head_size: int = 64
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    head_slots: int | None = None
    content_bytes: int | None = None
    kind: GroupKind = field(init=False, default=GroupKind.FULL_ATTENTION)

    def bytes_per_token_per_layer(self) -> int:
        if self.content_bytes is not None:
            return (self.head_slots or self.num_kv_heads) * self.content_bytes
        head_v = self.head_size if self.head_size_v is None else self.head_size_v
        return self.num_kv_heads * (self.head_size + head_v) * DTYPE_SIZES[self.dtype]

    def describe(self) -> dict[str, Any]:
        packing = {"head_size_v": self.head_size_v, "head_slots": self.head_slots,
                   "content_bytes": self.content_bytes}
        return {"kind": str(self.kind), "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_size": self.head_size, "dtype": self.dtype,
                **{k: v for k, v in packing.items() if v is not None}}


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 4096
    kind: GroupKind = field(init=False, default=GroupKind.SLIDING_WINDOW)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sliding_window": self.sliding_window}


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token (no separate K and V)."""

    kind: GroupKind = field(init=False, default=GroupKind.MLA)

    def bytes_per_token_per_layer(self) -> int:
        if self.content_bytes is not None:
            return (self.head_slots or self.num_kv_heads) * self.content_bytes
        return self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state: a fixed-size state per request, not per token."""

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    kind: GroupKind = field(init=False, default=GroupKind.MAMBA)

    def state_bytes_per_layer(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = 1
            for d in shape:
                n *= d
            total += n * DTYPE_SIZES[dtype]
        return total

    def bytes_per_token_per_layer(self) -> int:
        return 0

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes_per_layer()

    def describe(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "block_size": self.block_size,
                "shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes)}


@dataclass(frozen=True)
class OtherSpec(KVCacheSpec):
    """A cache of a kind kvtier does not know (the engine's spec class named in ``name``)."""

    name: str = ""
    kind: GroupKind = field(init=False, default=GroupKind.OTHER)

    def bytes_per_token_per_layer(self) -> int:
        return 0

    def describe(self) -> dict[str, Any]:
        return {"kind": str(self.kind), "block_size": self.block_size, "name": self.name}


UNSERVED = (GroupKind.OTHER,)  # group kinds kvtier never stores (a cache it does not know)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    @property
    def kind(self) -> GroupKind:
        return self.kv_cache_spec.kind

    def bytes_per_token(self) -> int:
        """Bytes of KV one token takes across all layers of the group (0 for Mamba)."""
        return self.kv_cache_spec.bytes_per_token_per_layer() * len(self.layer_names)

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        """Blocks one stored chunk reads: every block of its tokens, or the one block holding a recurrent group's
        state at the chunk's end."""
        if isinstance(self.kv_cache_spec, MambaSpec):
            return 1
        return chunk_tokens // self.kv_cache_spec.block_size

    def bytes_per_chunk(self, chunk_tokens: int) -> int:
        """Bytes of one stored chunk of this group: tokens x layers, or one state per layer for Mamba."""
        spec = self.kv_cache_spec
        if isinstance(spec, MambaSpec):
            return spec.state_bytes_per_layer() * len(self.layer_names)
        return chunk_tokens * self.bytes_per_token()


@dataclass(frozen=True)
class KVCacheConfig:
    """The engine's KV-cache layout: groups of layers with their specs, and the block pool size."""

    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    num_blocks: int = 0
    kv_layout: str | None = None  # vLLM >= 0.32: the resolved KVCacheLayout name (layer views [B, H, N, C])
    # what else decides how a page's bytes are packed (vLLM: the device type, whose attention backends pack K and
    # V differently within a page of the same shape); part of every key's namespace with kv_layout
    kv_packing: str | None = None

    def group_of_layer(self) -> dict[str, int]:
        return {name: gid for gid, g in enumerate(self.kv_cache_groups) for name in g.layer_names}


def simple_config(num_layers: int, num_kv_heads: int, head_size: int, dtype: str = "bfloat16",
                  block_size: int = 16, sliding_window: int | None = None,
                  swa_layers: Sequence[int] = (), num_blocks: int = 0) -> KVCacheConfig:
    """A config for a plain model: one full-attention group, plus one sliding-window group for swa_layers."""
    dtype = dtype_name(dtype)
    full = tuple(f"model.layers.{i}.self_attn" for i in range(num_layers) if i not in set(swa_layers))
    groups = [KVCacheGroupSpec(full, FullAttentionSpec(block_size, num_kv_heads, head_size, dtype))]
    if swa_layers:
        if sliding_window is None:
            raise ValueError("sliding_window is required when swa_layers is given")
        swa = tuple(f"model.layers.{i}.self_attn" for i in swa_layers)
        groups.append(KVCacheGroupSpec(swa, SlidingWindowSpec(block_size, num_kv_heads, head_size, dtype,
                                                              sliding_window=sliding_window)))
    return KVCacheConfig(tuple(groups), num_blocks)


# vLLM's spec classes kvtier serves (by name prefix: vllm is not imported), with MambaSpec (recurrent state);
# any other (chunked-local, cross, encoder-only, sink, circular-buffer, ...) becomes an ``OtherSpec``
SERVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec", "SlidingWindowMLASpec")


def _spec_from_vllm(spec: Any) -> KVCacheSpec:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: layers of one kind, per-layer specs
    if isinstance(inner, dict) and inner:
        first = next(iter(inner.values()))
        if any(s != first for s in inner.values()):
            return OtherSpec(int(spec.block_size), name=f"{type(spec).__name__}(mixed)")
        spec = first
    cls = type(spec).__name__
    block = int(spec.block_size)
    try:
        if "Mamba" in cls:
            return MambaSpec(block, tuple(tuple(int(d) for d in s) for s in spec.shapes),
                             tuple(dtype_name(d) for d in spec.dtypes))
        heads, head, dtype = int(spec.num_kv_heads), int(spec.head_size), dtype_name(spec.dtype)
    except (AttributeError, TypeError, ValueError):  # a kind of cache (or dtype) kvtier does not model
        return OtherSpec(block, name=cls)
    if not cls.startswith(SERVED_SPECS) or getattr(spec, "tokens_per_state", 1) != 1:
        return OtherSpec(block, name=cls)  # another kind, or compressed / pooled states (not one per token)
    packing = _packing(spec)
    if "SlidingWindow" in cls:  # sliding-window MLA too: only the window is restored (pages move as bytes)
        return SlidingWindowSpec(block, heads, head, dtype, **packing, sliding_window=int(spec.sliding_window))
    if "MLA" in cls:
        return MLAAttentionSpec(block, heads, head, dtype, **packing)
    # With HMA off vLLM merges sliding-window layers into one FullAttentionSpec that carries
    # ``sliding_window``; restoring every chunk of such a group is always correct.
    return FullAttentionSpec(block, heads, head, dtype, **packing)


def _packing(spec: Any) -> dict[str, int | None]:
    """How a vLLM attention spec packs a page (``head_size_v``, ``num_head_slots``, ``state_content_bytes``, where
    the version has them), as kvtier's spec fields."""
    def number(name: str) -> int | None:
        value = getattr(spec, name, None)
        return int(value) if isinstance(value, int) else None

    return {"head_size_v": number("head_size_v"), "head_slots": number("num_head_slots"),
            "content_bytes": number("state_content_bytes")}


class EngineLayout(Protocol):
    """What ``from_vllm`` reads of the engine's settings (kvtier.connector.settings.EngineSettings has it)."""

    @property
    def kv_cache_layout(self) -> Any: ...

    @property
    def device_type(self) -> str | None: ...


def from_vllm(kv_cache_config: Any, engine: EngineLayout | None = None) -> KVCacheConfig:
    """Convert a vLLM ``KVCacheConfig`` (any version with ``kv_cache_groups``) to kvtier's model, its layout
    resolved once for the whole start: the ``KVCacheLayout`` on the KV-cache config (vLLM >= 0.32), else the
    cache config's, by canonical name (:func:`kvtier.layout.geometry.canonical_layout`). Given the engine's settings
    (kvtier.connector.settings), a resolved layout also records its packing (the device type); a kvtier
    ``KVCacheConfig`` is returned as it is unless there is such a layout to record."""
    if isinstance(kv_cache_config, KVCacheConfig):
        base = kv_cache_config
    else:
        groups = tuple(KVCacheGroupSpec(tuple(g.layer_names), _spec_from_vllm(g.kv_cache_spec))
                       for g in kv_cache_config.kv_cache_groups)
        base = KVCacheConfig(groups, int(getattr(kv_cache_config, "num_blocks", 0)),
                             _layout_of(getattr(kv_cache_config, "kv_cache_layout", None)))
    if engine is None:
        return base
    resolved = base.kv_layout or _layout_of(engine.kv_cache_layout)
    if resolved is None:
        return base
    return replace(base, kv_layout=resolved, kv_packing=engine.device_type)


def _layout_of(layout: Any) -> str | None:
    """A layout's canonical name; None for no layout."""
    return canonical_layout(layout) if layout is not None else None
