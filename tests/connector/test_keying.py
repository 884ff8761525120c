"""Request keying (kvtier.connector.keying): the extra bytes of a request are one unambiguous encoding of its cache
salt, LoRA adapter and multimodal inputs; an adapter is identified by its files under ``namespace.weights``, never
by its name alone; the KV-cache dtype and the checkpoint's fp8 scales join the namespace."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scheduler_harness import FULL, TOKENS, Build, C

from kvtier.config import load_config
from kvtier.connector import keying
from kvtier.connector.keying import (
    EXTRA_FORMAT,
    RequestKeying,
    encode_extra,
    identity_from,
    namespaces,
    request_extra,
    request_keys,
)
from kvtier.connector.settings import read_settings
from kvtier.engine.types import Request
from kvtier.layout import KVCacheConfig, simple_config
from kvtier.records.fingerprint import WEIGHT_MODES

FILE_MODES = ("auto", "stat", "content")


def image(ident: str | None, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=length))


def lora(name: str, path: Path | str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def request(salt: str | None = None, adapter: Any = None, media: list[Any] | None = None) -> SimpleNamespace:
    return SimpleNamespace(cache_salt=salt, lora_request=adapter, mm_features=media or [])


def adapter_dir(root: Path, weights: bytes = b"A1" * 500, config: str = '{"r": 8, "lora_alpha": 16}') -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(config)
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def rewrite(path: Path, data: bytes, mtime_ns: int) -> None:
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def unpack(data: bytes, at: int) -> tuple[Any, int]:
    """The inverse of keying._pack, written from its description."""
    tag, at = data[at:at + 1], at + 1
    if tag == b"N":
        return None, at
    size, at = int.from_bytes(data[at:at + 8], "little"), at + 8
    if tag == b"S":
        return data[at:at + size].decode("utf-8", "surrogatepass"), at + size
    if tag == b"I":
        return int(data[at:at + size]), at + size
    assert tag == b"L", tag
    items = []
    for _ in range(size):
        item, at = unpack(data, at)
        items.append(item)
    return items, at


def decode(extra: bytes) -> tuple[Any, Any, list[Any]]:
    if extra == b"":
        return None, None, []
    assert extra.startswith(EXTRA_FORMAT)
    (salt, adapter, media), end = unpack(extra, len(EXTRA_FORMAT))
    assert end == len(extra)
    return salt, None if adapter is None else tuple(adapter), [tuple(m) for m in media]


# ---- the encoding -----------------------------------------------------------------------------------------------
def test_a_salt_that_spells_another_requests_parts_keys_apart_from_that_request(tmp_path: Path) -> None:
    """kvtier joined ``salt=``, ``lora=`` and ``mm=`` with NUL: these pairs had one extra, hence one set of keys."""
    spaces = namespaces(identity_from(load_config(None), None), KVCacheConfig((FULL,)), C)
    named = RequestKeying("off")
    pairs = [(request("S\x00lora=A"), request("S", lora("A", ""))),
             (request("S\x00mm=abc@3+10"), request("S", media=[image("abc", 3, 10)])),
             (request(media=[image("None", 3, 10)]), request(media=[image(None, 3, 10)])),
             (request(media=[image("a@1+2\x00mm=b", 3, 4)]), request(media=[image("a", 1, 2), image("b", 3, 4)]))]
    for one, other in pairs:
        assert named.extra(one) != named.extra(other)
        assert request_keys(spaces, TOKENS, C, named.extra(one)) != request_keys(spaces, TOKENS, C, named.extra(other))
    files = RequestKeying("stat")  # the same with the adapter known by its files
    ad = adapter_dir(tmp_path / "A")
    assert files.extra(request("S\x00lora=A")) != files.extra(request("S", lora("A", ad)))


def test_plain_requests_keep_the_keys_of_their_tokens_alone() -> None:
    keying = RequestKeying()
    for plain in (request(), request(""), SimpleNamespace(), Request("r", TOKENS)):
        assert keying.extra(plain) == b"" == request_extra(plain)
    assert encode_extra(None, None, []) == b""
    assert request_extra(request("S")).startswith(EXTRA_FORMAT)
    with pytest.raises(UnicodeDecodeError):  # so never one of the text extras kvtier wrote before
        EXTRA_FORMAT.decode()


TRICKY = st.sampled_from(["\x00", "=", "@", "+", "salt=", "lora=", "mm=", "S", "L", "N", "I", "\x08", "\ud800", "é"])
TEXT = st.lists(st.characters(exclude_categories=()) | TRICKY, max_size=8).map("".join)  # surrogates too
NUMBER = st.none() | st.integers() | st.sampled_from([0, 1, 10, 2**64])
MEDIA = st.lists(st.tuples(st.none() | TEXT, NUMBER, NUMBER), max_size=3)
ADAPTER = st.none() | st.lists(TEXT, max_size=3).map(tuple)
COMBO = st.tuples(st.none() | TEXT, ADAPTER, MEDIA)


@given(COMBO, COMBO)
def test_no_two_distinct_salt_adapter_and_media_combinations_encode_alike(one: Any, other: Any) -> None:
    """The encoding decodes back to what was encoded (so it is one-to-one), for any strings, surrogates included."""
    for combo in (one, other):
        assert decode(encode_extra(*combo)) == combo
    assert (encode_extra(*one) == encode_extra(*other)) == (one == other)


@given(st.none() | TEXT, st.none() | st.tuples(TEXT, TEXT), MEDIA)
def test_requests_with_any_strings_decode_back_to_their_salt_adapter_and_media(
        salt: str | None, adapter: tuple[str, str] | None, media: list[Any]) -> None:
    features = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n)) for i, o, n in media]
    lora_request = None if adapter is None else lora(*adapter)
    got = decode(RequestKeying("off").extra(request(salt, lora_request, features)))
    named = None if adapter is None else ("named", *adapter)
    assert got == (salt or None, named, [(i or None, o, n) for i, o, n in media])


# ---- LoRA adapters ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", FILE_MODES)
def test_two_adapters_of_one_name_with_other_files_never_share_a_key(tmp_path: Path, mode: str) -> None:
    old = adapter_dir(tmp_path / "v1")
    new = adapter_dir(tmp_path / "v2", b"A2" * 500)  # same size, other bytes
    other_config = adapter_dir(tmp_path / "v3", config='{"r": 16, "lora_alpha": 16}')
    extras = {RequestKeying(mode).extra(request(adapter=lora("support-bot", p))) for p in (old, new, other_config)}
    assert len(extras) == 3
    before = RequestKeying(mode).extra(request(adapter=lora("support-bot", old)))
    rewrite(old / "adapter_model.safetensors", b"A3" * 500, 10**18)  # replaced at the same path, then a restart
    assert RequestKeying(mode).extra(request(adapter=lora("support-bot", old))) != before


def test_under_off_an_adapter_is_its_name_and_path(tmp_path: Path) -> None:
    keying = RequestKeying("off")
    assert keying.extra(request(adapter=lora("a", "/x"))) == RequestKeying("off").extra(request(adapter=lora("a", "/x")))
    assert keying.extra(request(adapter=lora("a", "/x"))) != keying.extra(request(adapter=lora("a", "/y")))
    assert keying.extra(request(adapter=lora("a", "/x"))) != keying.extra(request(adapter=lora("b", "/x")))


def test_one_adapters_files_give_one_key_in_every_process(tmp_path: Path) -> None:
    """Separate processes with other hash seeds; under content the same bytes at another path and mtime too."""
    ad = adapter_dir(tmp_path / "a")
    copy = adapter_dir(tmp_path / "copy")
    os.utime(copy / "adapter_model.safetensors", ns=(7, 7))
    code = ("import sys; from types import SimpleNamespace as N; from kvtier.connector.keying import RequestKeying; "
            "r = N(cache_salt=None, mm_features=[], lora_request=N(lora_name='x', lora_path=sys.argv[2])); "
            "print(RequestKeying(sys.argv[1]).extra(r).hex())")
    for mode, paths in (("stat", (ad, ad)), ("content", (ad, copy))):
        got = {subprocess.run([sys.executable, "-c", code, mode, str(path)], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
               for seed, path in zip(("0", "4242"), paths, strict=True)}
        assert got == {RequestKeying(mode).extra(request(adapter=lora("y", ad))).hex()}, mode


@pytest.mark.parametrize("mode", FILE_MODES)
def test_an_adapter_kvtier_cannot_read_never_shares_keys(tmp_path: Path, mode: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    readable = adapter_dir(tmp_path / "ok")
    for path in (tmp_path / "gone", tmp_path / "empty", ""):
        this, other = RequestKeying(mode), RequestKeying(mode)  # two processes
        with caplog.at_level("WARNING"):
            caplog.clear()
            first = this.extra(request(adapter=lora("a", path)))
            assert this.extra(request(adapter=lora("a", path))) == first  # this process's own KV only
            assert caplog.text.count("cannot tie the KV of LoRA adapter") == 1
        assert other.extra(request(adapter=lora("a", path))) != first
        assert first not in (this.extra(request()), this.extra(request(adapter=lora("a", readable))))


def test_an_adapters_files_are_read_once_and_a_live_replacement_gets_keys_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    ad = adapter_dir(tmp_path / "a")
    real, modes = keying.weights_id, []
    monkeypatch.setattr(keying, "weights_id", lambda *a: modes.append(a[2]) or real(*a))
    live = RequestKeying("content")
    first = live.extra(request(adapter=lora("a", ad)))
    assert all(live.extra(request(adapter=lora("a", ad))) == first for _ in range(5))
    assert modes.count("content") == 2  # the weights and the config, once: later requests only stat them
    rewrite(ad / "adapter_model.safetensors", b"A2" * 500, 10**18)
    with caplog.at_level("WARNING"):
        later = [live.extra(request(adapter=lora("a", ad))) for _ in range(3)]
    assert len({first, *later}) == 4  # the engine may serve either version: no request shares another's KV
    assert caplog.text.count("changed at") == 1
    assert RequestKeying("content").extra(request(adapter=lora("a", ad))) not in {first, *later}  # a restart


def test_the_scheduler_keys_a_lora_request_by_its_adapters_files(harness: Build, tmp_path: Path) -> None:
    h = harness(KVCacheConfig((FULL,)))
    v1, v2 = adapter_dir(tmp_path / "v1"), adapter_dir(tmp_path / "v2", b"A2" * 500)
    saved = Request("saved", TOKENS, lora_request=lora("bot", v1))
    keys = request_keys(h.spaces, TOKENS, C, RequestKeying(h.cfg.namespace.weights).extra(saved))
    h.loop.run(h.store.put([(k, torch.zeros(4)) for k in keys[0][:4]], tiers=["cpu"]))
    assert h.conn.get_num_new_matched_tokens(Request("same", TOKENS, lora_request=lora("bot", v1)), 0) == (4 * C, False)
    assert h.conn.get_num_new_matched_tokens(Request("new", TOKENS, lora_request=lora("bot", v2)), 0) == (0, False)


# ---- fp8 KV caches ----------------------------------------------------------------------------------------------
def checkpoint(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model.safetensors").write_bytes(b"W1" * 500)  # its k_scale/v_scale tensors among the weights
    return root


def engine(model: Path, cache_dtype: str) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None, hf_config=None,
                                                        dtype="bfloat16", quantization=None),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def spaces_of(model: Path, cache_dtype: str, mode: str) -> list[bytes]:
    cfg = load_config({"chunk_size": 16, "namespace": {"weights": mode},
                       "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]})
    kcc = simple_config(2, 2, 8, dtype="uint8", block_size=16)  # vLLM's page dtype for every fp8 format
    return namespaces(identity_from(cfg, read_settings(engine(model, cache_dtype))), kcc, 16)


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_the_kv_cache_dtype_joins_the_namespace_in_every_weights_mode(tmp_path: Path, mode: str) -> None:
    """fp8_e4m3 and fp8_e5m2 pages are both uint8 to vLLM: the engine's kv_cache_dtype tells them apart."""
    model = checkpoint(tmp_path / "m")
    found = {tuple(spaces_of(model, dtype, mode)) for dtype in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")}
    assert len(found) == 4


def test_fp8_scales_from_the_checkpoint_join_the_namespace_with_the_weights(tmp_path: Path) -> None:
    """vLLM 0.33 computes no per-tensor KV scale at run time: they are 1.0 or the checkpoint's k_scale/v_scale,
    so they change the namespace as the weight files do; under ``off`` the operator vouches for both."""
    model = checkpoint(tmp_path / "m")
    before = {mode: spaces_of(model, "fp8", mode) for mode in WEIGHT_MODES}
    rewrite(model / "model.safetensors", b"K2" * 500, 10**18)  # other k_scale/v_scale tensors
    for mode in WEIGHT_MODES:
        assert (spaces_of(model, "fp8", mode) == before[mode]) == (mode == "off"), mode


def test_vllm_has_no_run_time_kv_scales_and_keeps_per_token_scales_in_the_page() -> None:
    """The premise of the two tests above: if vLLM brings back ``calculate_kv_scales`` (scales from one process's
    first batch), fp8 records would not mean the same in another process and kvtier must refuse that engine."""
    cache = pytest.importorskip("vllm.config.cache")
    assert "calculate_kv_scales" not in {f.name for f in dataclasses.fields(cache.CacheConfig)}
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode("fp8_per_token_head"))
    packed = TritonAttentionBackend.customize_spec(spec)
    assert packed.state_content_bytes == (8 + 8) * 1 + 2 * 4  # the scales are in the page kvtier saves
