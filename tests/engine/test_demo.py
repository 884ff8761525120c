"""``kvtier demo``: runs anywhere, prints hit rates, tokens saved and TTFT, and both runs agree."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.ops import demo


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_demo_reports_hits_savings_and_ttft(capsys: pytest.CaptureFixture[str]) -> None:
    code = demo.run(_args("--users", "3", "--turns", "3", "--max-tokens", "4", "--no-progress"))
    out = capsys.readouterr().out
    assert code == 0, out
    saved = re.search(r"prefill tokens saved: (\d+) of (\d+) prompt tokens", out)
    assert saved and 0 < int(saved.group(1)) < int(saved.group(2))
    assert re.search(r"cpu +\d+\.\d%", out) and re.search(r"disk +\d+\.\d%", out)
    assert re.search(r"without cache +\d+\.\d ms +\d+\.\d ms", out)
    assert re.search(r"with kvtier +\d+\.\d ms +\d+\.\d ms", out)
    assert "outputs identical with and without the cache: yes" in out
    assert demo.TIMING_NOTE in out  # says which figures depend on timing


def _fixed_figures(out: str) -> tuple[str, str]:
    """What the seed fixes: the prompt token count and the generated tokens (count and digest)."""
    prompt = re.search(r"of (\d+) prompt tokens", out)
    generated = re.search(r"generated tokens: (\d+ \(digest [0-9a-f]{12}\))", out)
    assert prompt and generated, out
    return prompt.group(1), generated.group(1)


def test_same_seed_same_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for seed in ("5", "5", "6"):
        assert demo.run(_args("--users", "2", "--turns", "2", "--max-tokens", "3", "--seed", seed,
                              "--no-progress")) == 0
        runs.append(_fixed_figures(capsys.readouterr().out))
    assert runs[0] == runs[1]
    assert runs[2][1] != runs[0][1]  # another seed, other tokens


def test_demo_says_where_the_disk_tier_is_and_which_overrides_apply(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVTIER_POLICY__EVICTION", "lru")
    args = _args("--users", "2", "--turns", "2", "--max-tokens", "3", "--persist", str(tmp_path / "keep"),
                 "--memory-capacity", "256KiB", "--chunk-size", "48", "--no-progress")
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert f"kvtier demo: disk tier 'disk' at {tmp_path}/keep/disk (kept)\n" in out
    assert ("kvtier demo: overrides applied: chunk_size 48 (--chunk-size); cpu capacity 256 KiB "
            "(--memory-capacity); environment: KVTIER_CACHE_DIR, KVTIER_POLICY__EVICTION\n") in out
    assert any((tmp_path / "keep" / "disk").rglob("*")), "nothing written under --persist DIR"
    assert demo.run(_args("--users", "2", "--turns", "1", "--max-tokens", "3", "--no-progress")) == 0
    temporary = re.search(r"disk tier 'disk' at (\S+) \(temporary, removed at exit", capsys.readouterr().out)
    assert temporary and not Path(temporary.group(1)).exists()


def test_demo_persist_uses_the_configured_disk_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    config = tmp_path / "small.yaml"
    config.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity: 64KiB}\n"
                      "  - {name: disk, kind: disk, capacity: 64MiB, path: " + str(tmp_path / "d") + "}\n")
    args = _args("--config", str(config), "--users", "2", "--turns", "2", "--max-tokens", "3", "--persist",
                 "--no-progress", "--window", "0")
    assert demo.run(args) == 0
    assert any((tmp_path / "d").rglob("*")), "the disk tier wrote nothing where the config said"
    capsys.readouterr()
    # a second run over the same directory adopts the first one's records: its hits come from disk (within one
    # run a hit from disk depends on when a background write lands, a chunk being demoted is a miss until then)
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"disk +[1-9]\d*\.\d%", out), out  # the tiny cpu tier spills to disk, hits come from there


def test_demo_rejects_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_sise: 32\n")
    assert demo.run(_args("--config", str(bad), "--no-progress")) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: chunk_sise") and len(err.splitlines()) == 1, err


def test_kvtier_demo_command_with_defaults_finishes_quickly(tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "kvtier.ops.cli", "demo"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "outputs identical with and without the cache: yes" in proc.stdout
    # The embedded default's memory tier is scaled to the tiny model, so chunks spill to disk and hit there.
    assert "tiers: cpu (cpu, 1 MiB), disk (disk, 8 GiB)" in proc.stdout
    assert re.search(r"cpu +[1-9]\d*\.\d%", proc.stdout) and re.search(r"disk +[1-9]\d*\.\d%", proc.stdout)
    assert "it/s" in proc.stderr or "turn/s" in proc.stderr  # the progress bar


def test_demo_refuses_a_chunk_size_the_engine_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    """--chunk-size 7 (not a multiple of the block size 16) is refused at start with check's message, exit 2,
    not run with kvtier disabled."""
    assert demo.run(_args("--chunk-size", "7", "--no-progress")) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert errors == ["kvtier: error: chunk_size: 7 is not a multiple of the block size 16 of KV-cache "
                      "group 0 (full_attention) (use a multiple of 16, e.g. 16)"], captured.err
    assert "without cache" not in captured.out


def test_demo_labels_its_records_with_the_model_that_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config naming namespace.model (configs/cpu-disk-redis.yaml: meta-llama/Llama-3.1-8B) does not label the
    tiny model's records with that name: the manifests name the reference engine's model, and the demo says so."""
    config = tmp_path / "named.yaml"
    config.write_text("namespace: {model: meta-llama/Llama-3.1-8B}\ntiers:\n"
                      "  - {name: cpu, kind: cpu, capacity: 64KiB}\n"
                      "  - {name: disk, kind: disk, capacity: 64MiB, path: " + str(tmp_path / "d") + "}\n")
    args = _args("--config", str(config), "--users", "2", "--turns", "2", "--max-tokens", "3", "--persist",
                 "--no-progress", "--window", "0")
    assert demo.run(args) == 0
    assert "namespace.model: the reference engine's tiny model, not 'meta-llama/Llama-3.1-8B'" in \
        capsys.readouterr().out
    models = {json.loads(p.read_text())["model"] for p in (tmp_path / "d").rglob("manifest.json")}
    assert models and all(m.startswith("kvtier-tiny-") for m in models), models


def test_the_modes_take_turns_and_each_cached_run_starts_empty(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The headline is a median over paired runs whose order turns every other repeat (neither mode always runs on
    a warmer machine), and no cached run inherits another's records: its own disk directory, its own tenant (a
    shared tier's keys)."""
    order: list[str] = []
    disks: list[str] = []
    tenants: list[str] = []
    phase, cached_engine = demo._phase, demo._cached_engine

    def record(title: str, *rest: object) -> demo.PhaseResult:
        order.append(title)
        return phase(title, *rest)  # type: ignore[arg-type]

    def opened(engine_args: object, cfg: demo.KvtierConfig) -> object:
        disks.append(next(t.path for t in cfg.tiers if isinstance(t, demo.DiskTierConfig)))
        tenants.append(cfg.namespace.tenant)
        return cached_engine(engine_args, cfg)  # type: ignore[arg-type]

    monkeypatch.setattr(demo, "_phase", record)
    monkeypatch.setattr(demo, "_cached_engine", opened)
    assert demo.run(_args("--users", "2", "--turns", "2", "--max-tokens", "3", "--repeats", "3",
                          "--no-progress")) == 0
    assert order == ["without cache 1/3", "with kvtier 1/3", "with kvtier 2/3", "without cache 2/3",
                     "without cache 3/3", "with kvtier 3/3"]
    assert len(set(disks)) == 3 and len(set(tenants)) == 3
    out = capsys.readouterr().out
    assert re.search(r"kvtier's median: \d+\.\d\dx the speed without cache, median of 3 paired runs \(\d+\.\d\d-\d+\.\d\dx\)", out)
    assert re.search(r"prefill tokens saved: \d+ of \d+ prompt tokens \(\d+\.\d%; median of 3 runs", out)
    assert demo.P90_NOTE in out


def test_persist_runs_once_so_that_its_kept_cache_is_the_one_reported(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.run(_args("--users", "2", "--turns", "2", "--max-tokens", "3", "--persist", str(tmp_path),
                          "--no-progress")) == 0
    out = capsys.readouterr().out
    assert "median of 1 paired runs" in out and "median of 1 runs" not in out
