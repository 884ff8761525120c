"""``kvtier bench ttft`` smoke run on the reference engine: hits from every tier, real Redis and files."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from kvtier.bench import ttft


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    ttft.add_arguments(parser)
    return ttft.run(parser.parse_args(list(argv)))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_quick_run_hits_every_tier_with_the_same_first_token(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert run_cli("--quick", "--lengths", "96,160", "--chunk-size", "32", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "ttft" and data["model"]["num_layers"] == 2
    results = {(r["prompt_tokens"], r["mode"]): r for r in data["results"]}
    assert set(results) == {(n, m) for n in (96, 160) for m in ttft.ALL_MODES}
    for (n, mode), r in results.items():
        assert r["ttft_s"]["n"] == 2 and r["ttft_s"]["min"] > 0
        expected_hit = 0 if mode == "none" else (n - 1) // 32 * 32  # whole chunks, one token left to compute
        assert r["hit_tokens"] == expected_hit, (n, mode)
        assert r["computed_tokens"] == n - expected_hit
        assert r["same_first_token"] is True
        assert r["speedup_vs_none"] > 0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_modes_can_be_chosen_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    assert run_cli("--quick", "--modes", "none,cpu", "--lengths", "64", "--chunk-size", "16", "--repeats", "1",
                   "--json", str(out), "--no-plot") == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["hit_tokens"]) for r in results] == [("none", 0), ("cpu", 48)]
    assert not out.with_suffix(".png").exists()


def test_unknown_modes_and_zero_lengths_are_one_line_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.ops.cli import main

    for argv, expected in ((["--modes", "cpu,tape"], "argument --modes: unknown tape"),
                           (["--lengths", "64,0"], "argument --lengths: expected an integer >= 1, got '0'"),
                           (["--chunk-size", "-16"], "argument --chunk-size: expected an integer >= 1"),
                           (["--chunk-size=-16"], "argument --chunk-size: expected an integer >= 1")):
        assert main(["bench", "ttft", "--quick", *argv]) == 2
        captured = capsys.readouterr()
        [line] = captured.err.splitlines()
        assert captured.out == "" and line.startswith("kvtier: error: ") and expected in line, line
