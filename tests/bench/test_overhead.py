"""``kvtier bench overhead`` smoke run: real keys, directory, scheduler-role connector and reference engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.bench import overhead
from kvtier.bench.overhead import directory_with, per_call, prompts
from kvtier.records.keys import Namespace, chunk_keys


def test_quick_run_reports_every_figure_beside_prefill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.json"
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    assert overhead.run(parser.parse_args(["--quick", "--lengths", "512,1024", "--repeats", "2", "--json",
                                           str(out), "--gpu-prefill-tps", "20000"])) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "overhead" and data["settings"]["gpu_prefill_tps"] == 20000
    assert [r["prompt_tokens"] for r in data["results"]] == [512, 1024]
    for r in data["results"]:
        for unit in ("us_per_request", "us_per_1k_tokens"):
            assert set(r[unit]) == {"hash", "lookup_empty", "lookup_populated", "connector_miss"}
            assert all(v["median"] > 0 and v["n"] == 2 for v in r[unit].values())
        per_k = r["us_per_1k_tokens"]["hash"]["median"]
        assert per_k == pytest.approx(r["us_per_request"]["hash"]["median"] * 1000 / r["prompt_tokens"], rel=1e-2)
        assert r["hash_tokens_per_s"] > 0 and r["hash_gbps_token_ids"] > 0
        assert r["gpu_prefill_s_assumed"] == pytest.approx(r["prompt_tokens"] / 20000)
        assert r["pct_of_gpu_prefill"] > 0
    first, second = data["results"]
    assert first["engine_prefill_s"]["median"] > 0 and first["pct_of_engine_prefill"] > 0  # 512 <= engine limit
    assert second["engine_prefill_s"] is None and second["pct_of_engine_prefill"] is None
    assert "% GPU prefill" in capsys.readouterr().out


def test_lookups_measured_are_misses() -> None:
    ns = Namespace(model="bench").digest()
    keys = chunk_keys(ns, prompts(1, 1024, seed=3)[0], 256)
    assert len(keys) == 4
    populated = directory_with(500)
    assert len(populated) == 500
    assert populated.lookup(keys, ["cpu", "disk"]) == [] == directory_with(0).lookup(keys, ["cpu", "disk"])


def test_prompts_are_distinct_and_per_call_counts_calls() -> None:
    ps = prompts(3, 64, seed=1)
    assert len({tuple(p) for p in ps}) == 3 and all(len(p) == 64 for p in ps)
    seen: list[int] = []
    run = per_call(lambda p: seen.append(len(p)), ps)
    assert run() > 0 and seen == [64] * 3


def test_reachable_as_kvtier_bench_overhead(tmp_path: Path) -> None:
    from kvtier.ops.cli import main

    out = tmp_path / "cli.json"
    assert main(["bench", "overhead", "--quick", "--lengths", "256", "--repeats", "1", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())["results"]
    assert result["prompt_tokens"] == 256 and result["us_per_request"]["connector_miss"]["n"] == 1
