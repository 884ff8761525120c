"""``kvtier bench throughput`` smoke runs: real tiers (pools, files, a private redis-server), real JSON.

Speed is measured, never asserted: these tests check that every tier figure comes with the raw limit measured
beside it, that the bytes round-trip, and the measuring helpers themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.bench import throughput
from kvtier.bench.measure import Spread, drop_page_cache, interleave, paired_ratio, same_bytes
from kvtier.bench.redis_servers import redis_server

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    return throughput.run(parser.parse_args(list(argv)))


def check_result(r: dict) -> None:
    for spread in (r["gbps"], r["raw"]["gbps"]):
        assert set(spread) == {"median", "q1", "q3", "min", "max", "n"}
        assert 0 < spread["min"] <= spread["q1"] <= spread["median"] <= spread["q3"] <= spread["max"]
    assert r["raw"]["method"]
    assert r["ratio"] == pytest.approx(r["gbps"]["median"] / r["raw"]["gbps"]["median"], rel=1e-3)
    assert r["meets_goal"] == (r["ratio"] >= r["goal"])
    assert r["batch_bytes"] == r["chunk_bytes"] * r["chunks"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_quick_run_covers_every_tier_with_its_raw_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert run_cli("--quick", "--batch", "2MiB", "--sizes", "1MiB,256KiB", "--json", str(out),
                   "--disk-path", str(tmp_path)) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "throughput" and data["quick"] is True
    assert data["machine"]["cores"] >= 1
    results = data["results"]
    for r in results:
        check_result(r)
    seen = {(r["tier"], r["op"], r.get("cache", "")) for r in results}
    assert {("cpu", "store", ""), ("cpu", "load", ""), ("cpu", "load_into", ""), ("gpu", "store", ""),
            ("gpu", "load", ""), ("disk", "store", ""), ("disk", "load", "warm"), ("disk", "load", "cold"),
            ("redis", "store", ""), ("redis", "load", ""), ("transfer", "gather", ""),
            ("transfer", "scatter", "")} <= seen
    assert {r["chunk_bytes"] for r in results if r["tier"] == "cpu"} == {1 << 20, 256 << 10}
    assert all(r["verified"] for r in results if "verified" in r)
    with_alt = {(r["tier"], r["op"]) for r in results if "raw_alt" in r}
    assert with_alt == {("redis", "store"), ("redis", "load"), ("disk", "load"), ("cpu", "load"), ("gpu", "load")}
    for r in results:
        if "raw_alt" in r:
            assert r["raw_alt"]["method"] and r["raw_alt"]["gbps"]["median"] > 0
            assert r["raw_alt"]["ratio"] == pytest.approx(r["gbps"]["median"] / r["raw_alt"]["gbps"]["median"], rel=1e-3)
    assert all(r["goal"] == (0.7 if r["tier"] in ("disk", "redis") else 0.8) for r in results)
    for r in results:
        if (r["tier"], r["op"]) == ("disk", "load"):  # the limit: the fastest plain read, round by round
            each = r["raw_gbps_each"]
            plain = {"files", "loops1", "loops2", "loops4"}
            assert set(each) == plain | {"hashed1", "hashed2", "hashed4"}
            assert r["raw"]["gbps"]["median"] >= max(each[k] for k in plain) - 1e-3
            assert r["raw_alt"]["gbps"]["median"] >= max(each[k] for k in each if k.startswith("hashed")) - 1e-3
            assert "xxh3" in r["raw_alt"]["method"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "% raw" in table and "redis" in table and "cold" in table
    assert all(line.rstrip().endswith("]") for line in table.splitlines() if " MISS " in line)
    assert all(r["meets_goal"] or r["miss_reason"] for r in results)
    assert table.splitlines()[-1] == f"results: {out.absolute()}, t.png"
    assert not list(tmp_path.glob("kvtier-bench-*"))  # disk files removed


def test_script_runs_a_selected_tier_and_fsync_mode(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--tiers", "disk",
                           "--fsync", "on", "--sizes", "256KiB", "--batch", "1MiB", "--no-plot", "--json", str(out),
                           "--disk-path", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert {(r["op"], r.get("cache")) for r in results} == {("store", None), ("load", "warm"), ("load", "cold")}
    assert all(r["tier"] == "disk" for r in results)
    assert [r.get("fsync") for r in results] == [True, None, None]  # the write mode; loads do not depend on it
    assert not out.with_suffix(".png").exists()


def test_unknown_tier_and_zero_repeats_are_one_line_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.ops.cli import main

    for argv, expected in ((["--tiers", "cpu,tape"], "argument --tiers: unknown tape"),
                           (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
                           (["--sizes", "2MiB,0"], "argument --sizes: expected a size above 0"),
                           (["--disk-path", "/no/such/dir"], "argument --disk-path: '/no/such/dir' is not a dir")):
        assert main(["bench", "throughput", "--quick", *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        [line] = captured.err.splitlines()
        assert line.startswith("kvtier: error: ") and expected in line, line


def result_row(tier: str, op: str, ratio: float, best: float, **extra: object) -> dict:
    """One result as Runner.record makes it, from a ratio to a raw limit of 10 GB/s."""
    run = throughput.Runner(extra.pop("settings", throughput.QUICK))  # type: ignore[arg-type]
    try:
        seconds = {"kvtier": [1 / (10 * ratio), 1 / (10 * best)], "raw": [0.1, 0.1]}
        run.record(tier, op, 1 << 20, 1024, samples=seconds, raw_method="copy", **extra)
    finally:
        run.close()
    return run.results[0]


def test_a_row_below_its_goal_says_why() -> None:
    full = throughput.Settings()
    quick_cpu = result_row("cpu", "load", 0.5, 0.6)
    assert not quick_cpu["meets_goal"] and quick_cpu["miss_reason"].startswith("quick: 8MiB per call, 2 rounds")
    warm = result_row("disk", "load", 0.4, 0.5, settings=full, cache="warm")
    assert warm["miss_reason"] == "known: every read checks the record's xxh3 hash"
    noisy = result_row("cpu", "store", 0.7, 0.9, settings=full)
    assert noisy["miss_reason"] == "noise: best round 90%"
    real = result_row("cpu", "store", 0.5, 0.6, settings=full)
    assert real["miss_reason"].startswith("below goal (a real miss")
    met = result_row("cpu", "store", 0.9, 0.95, settings=full)
    assert met["meets_goal"] and "miss_reason" not in met
    lines = throughput.table([quick_cpu, warm, met]).splitlines()
    assert "MISS (80%)" in lines[2] and lines[2].endswith(f"[{quick_cpu['miss_reason']}]")
    assert "MISS (70%)" in lines[3] and lines[3].endswith("[known: every read checks the record's xxh3 hash]")
    assert lines[4].endswith(" ok (80%)")
    assert lines[-1] == throughput.MISS_LEGEND
    assert throughput.MISS_LEGEND not in throughput.table([met])


def test_a_ratio_just_below_the_goal_is_not_printed_as_the_goal() -> None:
    row = result_row("cpu", "store", 0.7999, 0.7999, settings=throughput.Settings())
    assert "  79% MISS (80%)" in throughput.table([row])


def test_interleave_alternates_and_drops_warmup() -> None:
    calls: list[str] = []

    def make(name: str, value: float):
        def run() -> float:
            calls.append(name)
            return value + len(calls)
        return run

    samples = interleave({"a": make("a", 0), "b": make("b", 100)}, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert samples == {"a": [3, 5, 7], "b": [104, 106, 108]}


def test_spread_and_paired_ratio() -> None:
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.min, s.max, s.q1, s.q3, s.n) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert Spread.of([2.0]).as_dict()["q3"] == 2.0
    assert paired_ratio([2.0, 4.0], [4.0, 4.0]).median == 0.75
    with pytest.raises(ValueError):
        Spread.of([])


def test_same_bytes_treats_nan_payloads_as_equal() -> None:
    a = torch.full((4,), float("nan"), dtype=torch.bfloat16)
    assert same_bytes(a, a.clone()) and not torch.equal(a, a.clone())
    b = a.clone()
    b.view(torch.uint8)[0] ^= 1
    assert not same_bytes(a, b)


def test_drop_page_cache_keeps_contents(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 16))
    before = path.read_bytes()
    drop_page_cache([path])
    assert path.read_bytes() == before
    with pytest.raises(FileNotFoundError):
        drop_page_cache([tmp_path / "missing"])


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_private_redis_server_answers_and_is_killed() -> None:
    import redis

    with redis_server(maxmemory="64mb") as url:
        client = redis.Redis.from_url(url)
        assert client.ping() and client.config_get("maxmemory")["maxmemory"] == str(64 << 20)
        client.close()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


def test_fresh_loop_ends_the_previous_cases_worker_threads() -> None:
    """A case's ``to_thread`` workers (which keep their own OpenMP team) must not outlive the case."""
    import asyncio
    import threading

    run = throughput.Runner(throughput.QUICK)
    try:
        before = threading.active_count()
        worker = run.call(asyncio.to_thread(threading.get_ident))
        assert worker in {t.ident for t in threading.enumerate()}
        assert threading.active_count() > before
        run.fresh_loop()
        assert worker not in {t.ident for t in threading.enumerate()}
        assert run.call(asyncio.sleep(0, result=7)) == 7  # the new loop runs
    finally:
        run.close()
