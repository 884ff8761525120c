"""The fit rule (kvtier.records.fit.check_fit): chunk_size is a multiple of every group's block size (attention and
recurrent state), and every tier holds one chunk record of each group placed on it; errors name the key path and
the fix."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.layout import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    simple_config,
)
from kvtier.records.fit import check_fit


def config(chunk_size: int = 256, tiers: list[dict[str, Any]] | None = None, **extra: Any) -> KvtierConfig:
    """A config of ``chunk_size`` tokens a chunk; one 1 GiB cpu tier unless ``tiers`` are given."""
    tiers = tiers or [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"}]
    return load_config({"chunk_size": chunk_size, "tiers": tiers, **extra}, env={})


def test_check_fit_chunk_multiple_of_block_size() -> None:
    cfg = config(chunk_size=100)
    with pytest.raises(ConfigError) as info:
        check_fit(cfg, simple_config(2, 1, 8, block_size=16))
    assert info.value.path == "chunk_size" and "block size 16" in str(info.value)
    assert "multiple of 16" in str(info.value)
    check_fit(config(chunk_size=96), simple_config(2, 1, 8, block_size=16))
    mixed = simple_config(4, 1, 8, block_size=32, sliding_window=64, swa_layers=[1])
    with pytest.raises(ConfigError, match="chunk_size"):
        check_fit(config(chunk_size=48), mixed)


def test_check_fit_tier_smaller_than_a_chunk() -> None:
    cfg = config(tiers=[{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}])
    with pytest.raises(ConfigError) as info:
        check_fit(cfg, simple_config(32, 8, 128))  # 32 MiB per chunk
    assert info.value.path == "tiers[0].capacity"


def test_a_recurrent_group_needs_chunks_on_its_state_boundaries() -> None:
    """A recurrent (Mamba) group holds a state every block_size tokens (vLLM's align mode): a chunk boundary must be
    one of them, so its block size counts like an attention group's (vLLM aligns the two, e.g. 160 and 160)."""
    kcc = KVCacheConfig((KVCacheGroupSpec(("a",), FullAttentionSpec(16, 1, 8, "float32")),
                         KVCacheGroupSpec(("m",), MambaSpec(48, ((4,),), ("float32",)))))
    check_fit(config(chunk_size=96), kcc)
    with pytest.raises(ConfigError) as info:
        check_fit(config(chunk_size=64), kcc)
    assert info.value.path == "chunk_size" and "block size 48 of KV-cache group 1 (mamba)" in str(info.value)
    assert info.value.hint == "use a multiple of 48, e.g. 48"


def test_a_hybrid_of_block_sizes_16_and_48_suggests_their_lcm() -> None:
    kcc = KVCacheConfig((KVCacheGroupSpec(("a",), FullAttentionSpec(16, 1, 8, "float32")),
                         KVCacheGroupSpec(("s",), SlidingWindowSpec(48, 1, 8, "float32", sliding_window=96))))
    with pytest.raises(ConfigError) as info:
        check_fit(config(chunk_size=64), kcc)
    assert info.value.path == "chunk_size"
    assert "block size 48 of KV-cache group 1 (sliding_window)" in str(info.value)
    assert info.value.hint == "use a multiple of 48, e.g. 48"
    check_fit(config(chunk_size=96), kcc)


def test_a_tier_too_small_for_one_record_names_its_capacity() -> None:
    """A cpu tier holds the chunk's bytes in a 4 KiB-aligned slot: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes x 256
    tokens = 32 MiB; the second tier (4 MiB) cannot hold it. A tier not holding the group is not checked."""
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": "1GiB"},
             {"name": "small", "kind": "cpu", "capacity": "4MiB"}]
    with pytest.raises(ConfigError) as info:
        check_fit(config(tiers=tiers), simple_config(32, 8, 128))
    assert info.value.path == "tiers[1].capacity"
    assert "4 MiB cannot hold one chunk of group 0" in str(info.value)
    assert info.value.hint == "raise capacity or lower chunk_size"
    check_fit(config(tiers=tiers, placement={"full_attention": ["cpu"]}), simple_config(32, 8, 128))


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize(("kind", "slot_bytes"), [("cpu", None), ("cpu", 12000), ("disk", None)])
def test_fit_kvtier_check_and_the_tier_agree_on_what_one_chunk_costs(kind: str, slot_bytes: int | None, signed: bool,
                                                                     tmp_path: Any) -> None:
    """One size rule (kvtier.records.codec.stored_size) for the fit check, ``kvtier check`` and the tier itself: a
    tier of exactly one chunk's cost fits and holds one chunk; a byte less fails the fit and holds none. A signed
    record carries its MAC (32 bytes) on disk and in Redis; a memory tier holds the raw payload in whole slots,
    aligned to 4 KiB (5 KiB: 8 KiB; with ``slot_bytes`` 12000: one 12 KiB slot)."""
    from kvtier.ops.check import ModelShape, report
    from kvtier.records.codec import HEADER_SIZE, MAC_BYTES
    from kvtier.tiers import make_tier

    shape = ModelShape(2, 1, 40, "float16", block_size=16)  # 320 B a token, 5 KiB a 16-token chunk
    payload = shape.bytes_per_token * 16
    want = {("cpu", None): 8192, ("cpu", 12000): 12288}.get((kind, slot_bytes),
                                                             payload + HEADER_SIZE + (MAC_BYTES if signed else 0))
    security = {"security": {"hmac_key_env": "KVTIER_TEST_KEY"}} if signed else {}
    for capacity, chunks in ((want, 1), (want - 1, 0)):
        tier = {"name": "t", "kind": kind, "capacity": capacity, **({"path": str(tmp_path)} if kind == "disk" else {}),
                **({"slot_bytes": slot_bytes} if slot_bytes else {})}
        cfg = config(chunk_size=16, tiers=[tier], **security)
        assert make_tier(cfg.tiers[0], hmac_key=b"k" * 32 if signed else None).stored_size(payload) == want
        assert [t["chunks"] for t in report(cfg, shape, "test")["tiers"]] == [chunks]
        if chunks:
            check_fit(cfg, shape.layout())
        else:
            with pytest.raises(ConfigError, match="cannot hold one chunk"):
                check_fit(cfg, shape.layout())
