"""Chunk keys: deterministic across processes, namespaced, chained (prefix property), partial chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.records.keys import DIGEST_BYTES, KEY_BYTES, Namespace, chunk_keys, key_hex, key_namespace

REPO = Path(__file__).resolve().parents[2]
NS = Namespace(model="m", kv_dtype="bfloat16", group={"kind": "full_attention", "block_size": 16},
               layer_names=("l0", "l1"), chunk_size=4)
TOKENS = list(range(1000, 1010))  # 2 full chunks of 4 and a partial one of 2


def test_keys_are_deterministic_and_well_formed() -> None:
    a = chunk_keys(NS.digest(), TOKENS, 4)
    b = chunk_keys(Namespace(**{**vars(NS)}).digest(), np.array(TOKENS, dtype=np.int64), 4)
    assert a == b and len(a) == 2
    assert all(len(k) == KEY_BYTES and key_namespace(k) == NS.digest() for k in a)
    assert len(set(a)) == 2 and key_hex(a[0]) == a[0].hex()


def test_same_keys_in_a_subprocess_with_another_hash_seed() -> None:
    code = """
import json
from kvtier.records.keys import Namespace, chunk_keys
ns = Namespace(model="m", kv_dtype="bfloat16", group={"kind": "full_attention", "block_size": 16},
               layer_names=("l0", "l1"), chunk_size=4)
print(json.dumps([k.hex() for k in chunk_keys(ns.digest(), list(range(1000, 1010)), 4, extra=b"lora")]))
"""
    mine = [k.hex() for k in chunk_keys(NS.digest(), TOKENS, 4, extra=b"lora")]
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=120)
        assert json.loads(out.stdout) == mine


@pytest.mark.parametrize("change", [
    {"model": "other"}, {"revision": "v2"}, {"kv_dtype": "float16"}, {"group": {"kind": "mla"}},
    {"layer_names": ("l0",)}, {"tp_rank": 1}, {"tp_size": 2}, {"chunk_size": 8}, {"tenant": "acme"},
    {"format_version": 2}, {"fingerprint": "0f" * 16},
])
def test_every_namespace_field_changes_every_key(change: dict[str, object]) -> None:
    other = Namespace(**{**vars(NS), **change})
    assert other.digest() != NS.digest()
    mine, theirs = chunk_keys(NS.digest(), TOKENS, 4), chunk_keys(other.digest(), TOKENS, 4)
    assert not set(mine) & set(theirs)
    assert [k[DIGEST_BYTES:] for k in mine] != [k[DIGEST_BYTES:] for k in theirs]


def test_group_dict_order_does_not_matter() -> None:
    a = Namespace(model="m", group={"a": 1, "b": 2})
    b = Namespace(model="m", group={"b": 2, "a": 1})
    assert a.digest() == b.digest()


def test_shared_prefix_gives_shared_leading_keys() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50_000, 64).tolist()
    for split in (0, 5, 16, 17, 40, 63):
        other = base[:split] + [(t + 1) % 50_000 for t in base[split:]]
        a, b = chunk_keys(NS.digest(), base, 8), chunk_keys(NS.digest(), other, 8)
        shared = split // 8
        assert a[:shared] == b[:shared]
        assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=True))


def test_a_key_depends_on_every_earlier_chunk() -> None:
    a = chunk_keys(NS.digest(), [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chunk_keys(NS.digest(), [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # chunk 1 holds the same tokens, but its prefix differs


def test_extra_keys_change_every_key() -> None:
    plain = chunk_keys(NS.digest(), TOKENS, 4)
    lora = chunk_keys(NS.digest(), TOKENS, 4, extra=b"lora-a")
    assert not set(plain) & set(lora)
    assert chunk_keys(NS.digest(), TOKENS, 4, extra=b"lora-a") == lora


def test_partial_chunk() -> None:
    full = chunk_keys(NS.digest(), TOKENS, 4)
    with_partial = chunk_keys(NS.digest(), TOKENS, 4, include_partial=True)
    assert with_partial[:2] == full and len(with_partial) == 3
    longer = chunk_keys(NS.digest(), [*TOKENS, 7], 4, include_partial=True)
    assert longer[:2] == full and longer[2] != with_partial[2]  # a partial key names its exact tokens
    exact = chunk_keys(NS.digest(), TOKENS[:8], 4, include_partial=True)
    assert exact == full  # no partial chunk when the tokens fill whole chunks
    assert chunk_keys(NS.digest(), TOKENS[:3], 4) == []


def test_token_ids_are_little_endian_int32() -> None:
    """The hash input is fixed: a reference computed by hand with hashlib matches."""
    import hashlib

    ns = NS.digest()
    h0 = hashlib.blake2b(ns, digest_size=16).digest()
    h1 = hashlib.blake2b(h0, digest_size=16)
    h1.update(np.array([1, 2, 3, 4], dtype="<i4").tobytes())
    assert chunk_keys(ns, [1, 2, 3, 4], 4) == [ns + h1.digest()]


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="16-byte"):
        chunk_keys(b"short", TOKENS, 4)
    with pytest.raises(ValueError, match="positive"):
        chunk_keys(NS.digest(), TOKENS, 0)
