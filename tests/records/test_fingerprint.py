"""The fingerprint of what computes the KV: hub commits, weight files by stat or content, the model config."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.config import load_config
from kvtier.connector.keying import identity_from, namespaces
from kvtier.connector.settings import read_settings
from kvtier.errors import ConfigError
from kvtier.layout import simple_config
from kvtier.records.fingerprint import FingerprintError, ModelFacts, fingerprint, hub_commit, weight_files, weights_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def checkpoint(root: Path, weights: bytes = b"W1" * 1000) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model-00001-of-00002.safetensors").write_bytes(weights)
    (root / "model-00002-of-00002.safetensors").write_bytes(b"second shard")
    (root / ".cache").mkdir(exist_ok=True)
    (root / ".cache" / "download.lock").write_text("x")
    return root


def replace_keeping_mtime(path: Path, data: bytes) -> None:
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_weight_files_are_what_the_engine_loads(tmp_path: Path) -> None:
    """Top-level regular files of the kind the engine prefers: not hidden files, subdirectories (``original/``),
    other formats beside safetensors, or dangling links."""
    model = checkpoint(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"old format")
    (model / "original").mkdir()
    (model / "original" / "consolidated.00.pth").write_bytes(b"x")
    (model / "training_args.safetensors").symlink_to(tmp_path / "gone")
    assert [Path(f).name for f in weight_files(str(model))] == ["model-00001-of-00002.safetensors",
                                                               "model-00002-of-00002.safetensors"]
    only_bin = tmp_path / "b"
    only_bin.mkdir()
    (only_bin / "pytorch_model.bin").write_bytes(b"w")
    (only_bin / "config.json").write_text("{}")
    assert [Path(f).name for f in weight_files(str(only_bin))] == ["pytorch_model.bin"]
    assert weight_files(str(model / "model-00002-of-00002.safetensors")) == [str(model / "model-00002-of-00002.safetensors")]


def test_stat_catches_weights_written_over_the_path_and_shares_with_an_mtime_preserving_copy(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    before = weights_id(str(model), mode="stat")
    assert before.startswith("stat:") and weights_id(str(model), mode="stat") == before
    copy = tmp_path / "elsewhere"
    shutil.copytree(model, copy)  # copy2: mtimes preserved, as rsync -a or cp -p
    assert weights_id(str(copy), mode="stat") == before
    os.utime(model / "model-00001-of-00002.safetensors", ns=(1, 2))
    (model / "model-00001-of-00002.safetensors").write_bytes(b"W2" * 1000)  # same size, new mtime
    assert weights_id(str(model), mode="stat") != before
    # what stat cannot see (and content can): other bytes written back under the same size and mtime
    replace_keeping_mtime(copy / "model-00001-of-00002.safetensors", b"W3" * 1000)
    assert weights_id(str(copy), mode="stat") == before


def test_content_is_the_bytes_wherever_and_whenever_they_were_written(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a")
    b = checkpoint(tmp_path / "b")  # same bytes, written later at another path
    os.utime(b / "model-00001-of-00002.safetensors", ns=(5, 5))
    assert weights_id(str(a), mode="content") == weights_id(str(b), mode="content")
    assert weights_id(str(a), mode="stat") != weights_id(str(b), mode="stat")
    replace_keeping_mtime(b / "model-00001-of-00002.safetensors", b"W3" * 1000)
    assert weights_id(str(a), mode="content") != weights_id(str(b), mode="content")


def test_auto_takes_the_hub_snapshots_commit_also_through_a_link(tmp_path: Path) -> None:
    snapshot = checkpoint(tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT)
    link = tmp_path / "current"
    link.symlink_to(snapshot)
    assert hub_commit(str(snapshot)) == COMMIT and hub_commit(str(link)) == COMMIT
    assert weights_id(str(link)) == f"hub:{COMMIT}"
    assert weights_id(str(link), mode="stat").startswith("stat:")  # an explicit mode is kept
    plain = checkpoint(tmp_path / "plain")
    assert hub_commit(str(plain)) is None and weights_id(str(plain)).startswith("stat:")


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    snapshot = checkpoint(tmp_path / "models--org--tiny" / "snapshots" / COMMIT)
    asked: list[tuple[str, Any, Any, Any]] = []

    def cached(repo: str, revision: Any = None, cache_dir: Any = None, local_files_only: Any = None) -> str:
        asked.append((repo, revision, cache_dir, local_files_only))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached)
    assert weights_id("org/tiny", "v2", download_dir="/hub") == f"hub:{COMMIT}"
    assert asked == [("org/tiny", "v2", "/hub", True)]
    assert weights_id("org/tiny", mode="content") == weights_id(str(snapshot), mode="content")  # its files


def test_weights_that_cannot_be_found_or_read_are_an_error_never_a_name(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def not_cached(*args: Any, **kwargs: Any) -> str:
        raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    for model in ("org/tiny", "gpt2", "org/repo:Q4_K_M", str(tmp_path / "missing")):
        for mode in ("auto", "stat", "content"):
            with pytest.raises(FingerprintError):
                weights_id(model, mode=mode)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FingerprintError, match="no weight files"):
        weights_id(str(empty), mode="stat")


def test_an_engine_whose_weights_cannot_be_fingerprinted_is_not_served(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """identity_from never raises: the fingerprint is None (a warning says why), the scheduler is blocked and a
    worker's namespace matches nothing ever written."""
    from kvtier.connector.capability import weights_blocker

    engine = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path / "gone"), revision=None,
                                                          hf_config=None, dtype="float32", quantization=None))
    cfg = load_config({"tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]})
    with caplog.at_level("WARNING"):
        ident = identity_from(cfg, read_settings(engine))
    assert ident.fingerprint is None and "cannot tie its records" in caplog.text
    assert weights_blocker(ident.fingerprint) is not None and weights_blocker("") is None
    kcc = simple_config(2, 2, 8, block_size=16)
    assert namespaces(ident, kcc, 16) != namespaces(ident, kcc, 16)  # never the same twice
    assert identity_from(cfg, read_settings(engine), fingerprinted=False).fingerprint == ""


def test_the_fingerprint_is_the_same_in_every_process(tmp_path: Path) -> None:
    """Sets in a config and object reprs must not make the digest depend on the process (hash seed, addresses)."""
    import subprocess
    import sys

    model = checkpoint(tmp_path / "m")
    code = ("import sys; from kvtier.records.fingerprint import ModelFacts, fingerprint; "
            "print(fingerprint(ModelFacts(sys.argv[1], None, {'s': {'a', 'b', 'c', 'd'}, 'o': object(), "
            "1: 'int key', 'k': {2: 'x', 'y': 3}}, 'float32')))")
    digests = {subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(digests) == 1 and len(digests.pop().strip()) == 32


def test_off_leaves_the_weights_out_and_an_unknown_mode_is_refused(tmp_path: Path) -> None:
    a, b = checkpoint(tmp_path / "a"), checkpoint(tmp_path / "b", b"other")
    assert weights_id(str(a), mode="off") == weights_id(str(b), mode="off") == "off"
    with pytest.raises(ValueError, match="unknown weights fingerprint mode"):
        weights_id(str(a), mode="sha")
    with pytest.raises(ConfigError, match=r"namespace\.weights.*did you mean 'content'"):
        load_config({"namespace": {"weights": "contnet"}, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]})


def test_the_config_dtypes_and_quantization_join_the_fingerprint_but_the_models_path_does_not(
        tmp_path: Path) -> None:
    model = str(checkpoint(tmp_path / "m"))
    base = ModelFacts(model, None, {"hidden_size": 8, "_name_or_path": "/a", "transformers_version": "4"},
                      "torch.float32", None, "auto", "auto")
    same = ModelFacts(model, None, {"hidden_size": 8, "_name_or_path": "/b", "transformers_version": "5"},
                      "torch.float32", None, "auto", "auto")
    assert fingerprint(base) == fingerprint(same)
    changed = [ModelFacts(model, None, {"hidden_size": 16}, "torch.float32", None, "auto", "auto"),
               ModelFacts(model, None, base.hf_config, "torch.bfloat16", None, "auto", "auto"),
               ModelFacts(model, None, base.hf_config, "torch.float32", "fp8", "auto", "auto"),
               ModelFacts(model, None, base.hf_config, "torch.float32", None, "fp8_e4m3", "auto")]
    assert len({fingerprint(base), *(fingerprint(f) for f in changed)}) == 5


def test_new_weights_at_the_same_path_give_other_keys(tmp_path: Path) -> None:
    """The whole path through identity_from: a vLLM-shaped config, its weights replaced in place."""
    model = checkpoint(tmp_path / "m")
    hf = SimpleNamespace(to_dict=lambda: {"hidden_size": 8})
    engine = SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None, hf_config=hf,
                                                          dtype="float32", quantization=None),
                             cache_config=SimpleNamespace(cache_dtype="auto"))
    cfg = load_config({"chunk_size": 16, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]})
    kcc = simple_config(2, 2, 8, block_size=16)
    first = namespaces(identity_from(cfg, read_settings(engine)), kcc, 16)
    assert namespaces(identity_from(cfg, read_settings(engine)), kcc, 16) == first
    (model / "model-00001-of-00002.safetensors").write_bytes(b"W2" * 1000)
    os.utime(model / "model-00001-of-00002.safetensors", ns=(10**18, 10**18))
    assert namespaces(identity_from(cfg, read_settings(engine)), kcc, 16) != first
    assert identity_from(cfg, None).fingerprint == ""  # an engine that does not describe its model


def test_the_load_format_decides_which_files_are_the_weights(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"pt weights")
    assert [Path(f).name for f in weight_files(str(model), "pt")] == ["pytorch_model.bin"]
    assert [Path(f).suffix for f in weight_files(str(model), "auto")] == [".safetensors", ".safetensors"]
    before = weights_id(str(model), mode="stat", load_format="pt")
    os.utime(model / "pytorch_model.bin", ns=(10**18, 10**18))
    assert weights_id(str(model), mode="stat", load_format="pt") != before


def test_a_tensor_parallel_worker_that_cannot_fingerprint_serves_nothing(tmp_path: Path) -> None:
    """Rank 1 keys its own shards with the fingerprint: without one it disables itself (loads fail and are
    recomputed, nothing is stored, the scheduler is told through the stats) instead of writing unreadable
    records."""
    from kvtier.connector.base import KVConnectorRole
    from kvtier.connector.tiered import TieredConnector

    engine = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path / "gone"), revision=None,
                                                          hf_config=None, dtype="float32", quantization=None),
                             parallel_config=SimpleNamespace(tensor_parallel_size=2, rank=1))
    cfg = load_config({"chunk_size": 16, "tiers": [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]})
    work = TieredConnector.from_config(cfg, KVConnectorRole.WORKER, simple_config(2, 2, 8, block_size=16),
                                       vllm_config=engine)
    try:
        worker = work._worker
        assert worker is not None and worker.disabled is not None and "namespace.weights: off" in worker.disabled
        stats = work.get_kv_connector_stats()
        assert stats is not None and stats.data["kvtier_disabled"] == 1
    finally:
        work.shutdown()


def test_serve_without_prefix_caching_is_a_validated_setting() -> None:
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": "1MiB"}]
    assert load_config({"tiers": tiers}).serve_without_prefix_caching is False
    env = {"KVTIER_SERVE_WITHOUT_PREFIX_CACHING": "true"}
    assert load_config({"tiers": tiers}, env=env).serve_without_prefix_caching is True
    with pytest.raises(ConfigError, match="serve_without_prefix_caching: expected true or false"):
        load_config({"tiers": tiers, "serve_without_prefix_caching": "yes"})
