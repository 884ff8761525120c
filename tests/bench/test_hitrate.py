"""Hit-rate replay: semantics on tiny hand-made traces with known answers, workloads, the CLI and its JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import cli as bench_cli
from kvtier.bench import hitrate, hitrate_cli
from kvtier.bench.hitrate import (
    DEFAULT_TRACE,
    SweepSpec,
    belady_hit_rate,
    ideal_hit_rate,
    ideal_stats,
    replay_policy,
    sweep,
)
from kvtier.bench.workloads import (
    Request,
    Workload,
    agentic,
    load_mooncake,
    long_doc_qa,
    multi_round_qa,
    parse_capacities,
    synthetic_suite,
)
from kvtier.control.policy import POLICIES
from kvtier.errors import ConfigError
from kvtier.ops.cli import main

TRACE = DEFAULT_TRACE
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"Mooncake trace not found at {TRACE}")


def wl(*requests: tuple[tuple[int, ...], int], chunk_tokens: int = 10) -> Workload:
    return Workload("hand-made", chunk_tokens, tuple(Request(c, n) for c, n in requests))


# ---- semantics, known answers ----------------------------------------------------------------------------


def test_repeat_hits_whole_prefix_capped_at_input_length() -> None:
    w = wl(((1, 2), 15), ((1, 2), 15))  # second request: 2 chunks x 10 tokens, capped at its 15 tokens
    stats = replay_policy(w, "lru", [4])
    assert stats.hit_tokens == 15 and stats.total_tokens == 30 and stats.hit_rate == 0.5
    assert stats.request_hit_rate == 0.5 and stats.chunk_hit_rate == 0.5
    assert ideal_hit_rate(w) == 0.5


def test_hit_is_the_longest_prefix_only() -> None:
    w = wl(((1, 2, 3), 30), ((1, 9, 3), 30))  # chunk 3 is held but follows a miss: no hit
    assert replay_policy(w, "lru", [10]).hit_tokens == 10


def test_lru_known_answers() -> None:
    w = wl(((1, 2), 20), ((3, 4), 20), ((1, 2), 20))
    assert replay_policy(w, "lru", [2]).hit_tokens == 0
    assert replay_policy(w, "lru", [3]).hit_tokens == 0  # 3 evicts 1, 4 evicts 2
    assert replay_policy(w, "lru", [4]).hit_tokens == 20
    assert ideal_hit_rate(w) == pytest.approx(20 / 60)


def test_prefix_lru_keeps_heads_where_lru_keeps_tails() -> None:
    w = wl(((1, 2, 3), 30), ((4,), 10), ((1, 2), 20))
    # LRU: chunk 1 (touched first, so oldest) goes for 4; then the second visit misses at its head.
    assert replay_policy(w, "lru", [3]).hit_tokens == 0
    # prefix_lru: the tail 3 goes instead; both chunks of the prefix hit.
    assert replay_policy(w, "prefix_lru", [3]).hit_tokens == 20


def test_belady_and_infinite_known_answers() -> None:
    w = wl(((1,), 10), ((2,), 10), ((3,), 10), ((1,), 10), ((2,), 10))
    assert ideal_hit_rate(w) == pytest.approx(2 / 5)
    assert replay_policy(w, "lru", [2]).hit_tokens == 0
    # Belady evicts 2 (next used last) for 3, then hits 1.
    assert belady_hit_rate(w, 2) == pytest.approx(1 / 5)
    assert belady_hit_rate(w, 3) == pytest.approx(2 / 5)


def test_multi_tier_demotes_and_attributes_hits() -> None:
    w = wl(((1,), 10), ((2,), 10), ((1,), 10), ((1,), 10))
    stats = replay_policy(w, "lru", [1, 1])
    # 2 demotes 1 to tier1; request 3 hits it there (and promotes it, demoting 2); request 4 hits tier0.
    assert stats.tier_tokens == [10, 10]
    assert stats.tier_rates(["fast", "slow"]) == {"fast": 0.25, "slow": 0.25}
    assert replay_policy(w, "lru", [1]).hit_tokens == 10  # single tier: only request 4 hits


def test_prefix_hd_beats_every_other_policy_on_conversations() -> None:
    """Three-turn sessions, three in flight; each turn's last chunk (a partial block) is never reused."""
    reqs = []
    for t in range(302):
        for s in (t, t - 1, t - 2):
            if 0 <= s < 300:
                base = 1000 * (s + 1)
                reqs.append(((0, base, base + 1, base + 2, base + 10 + t - s), 50))
    w = wl(*reqs)
    rates = {p: replay_policy(w, p, [12]).hit_rate for p in ("lru", "prefix_lru", "arc", "s3fifo", "prefix_hd")}
    assert rates["prefix_hd"] > 0.9 * ideal_hit_rate(w)
    assert all(rate < 0.5 * rates["prefix_hd"] for p, rate in rates.items() if p != "prefix_hd"), rates


# ---- workloads ------------------------------------------------------------------------------------------


# ---- the engine's cache in front, and the save admission ---------------------------------------------------


def test_the_engine_in_front_serves_first_and_kvtier_what_it_evicted() -> None:
    """Engine 2 blocks, tier 8: prompt A (3 full chunks) is computed and saved; B pushes A out of the engine; A again
    hits its first 2 chunks (the last full chunk ends at the prompt's last token: never a hit) in kvtier."""
    a, b = ((1, 2, 3), 30), ((4, 5, 6), 30)
    stats = hitrate.replay_admission(wl(a, b, a), 2, 8, "all")
    assert (stats.engine_tokens, stats.kvtier_tokens, stats.loaded_chunks) == (0, 20, 2)
    assert stats.saved_chunks == 6  # A's and B's chunks once each: what the tier already holds is not saved again
    again = hitrate.replay_admission(wl(a, a), 3, 8, "all")  # the engine holds all of A
    assert (again.engine_tokens, again.kvtier_tokens, again.saved_chunks) == (20, 0, 3)


def test_saving_on_evict_saves_only_what_the_engine_drops_and_serves_it_past_the_engines_hit() -> None:
    """Engine 3 blocks, tier 8. A (3 full chunks) fills the engine and saves nothing; B (3 more) evicts A's chunks,
    which are saved then, and nothing of B's (the engine still holds it). A again: the tier serves A's first 2
    chunks, and its computing evicts B's, saved then: every chunk is saved once, when it left the engine; B again
    loads from the tier, and A's chunks it evicts, which the tier holds, are not saved again."""
    a, b = ((1, 2, 3), 30), ((4, 5, 6), 30)
    stats = hitrate.replay_admission(wl(a, b), 3, 8, "evict")
    assert stats.saved_chunks == 3 and stats.loaded_chunks == 0
    again = hitrate.replay_admission(wl(a, b, a), 3, 8, "evict")
    assert (again.kvtier_tokens, again.loaded_chunks, again.saved_chunks) == (20, 2, 6)
    twice = hitrate.replay_admission(wl(a, b, a, b), 3, 8, "evict")
    assert (twice.loaded_chunks, twice.saved_chunks) == (4, 6)
    every = hitrate.replay_admission(wl(a, b), 3, 8, "all")
    assert every.saved_chunks == 6  # saving at compute time also writes B, which the engine still holds


def test_saving_on_evict_looks_the_tier_up_from_the_engines_hit_on() -> None:
    """Engine 4 blocks. A (4 chunks, 40 tokens: a hit reaches 3) fills it; C (2 chunks) evicts A's tail, A4 and A3,
    saved then. A again: the engine still holds A1 and A2, and of what A asks for (A1-A3) the tier holds A3 only:
    the lookup past the engine's hit serves A3 (from the first chunk, the tier holds no prefix at all)."""
    a, c = ((1, 2, 3, 4), 40), ((7, 8), 20)
    stats = hitrate.replay_admission(wl(a, c, a), 4, 8, "evict")
    assert (stats.engine_tokens, stats.kvtier_tokens, stats.loaded_chunks) == (20, 10, 1)


def test_saving_on_evict_never_saves_a_chunk_the_request_itself_holds() -> None:
    """Engine 3 blocks holding X1, X2 (X2 oldest) and Y. Z = X1 + two new chunks hits X1 in the engine; computing
    Z evicts X2 and Y (2 saves). The LRU replay drops X1 too and reinserts it, but vLLM never evicts a block a
    running request holds: it is not saved."""
    x, y, z = ((1, 2), 20), ((3,), 10), ((1, 5, 6), 30)
    stats = hitrate.replay_admission(wl(x, y, z), 3, 8, "evict")
    assert (stats.engine_tokens, stats.saved_chunks) == (10, 2)


def test_the_learned_admission_declines_what_is_never_asked_for_again() -> None:
    """Prompts that are never reused: once a class has its warm-up of offers judged, nothing more is saved. Prompts
    each asked for again past what the engine kept keep being saved (they pay): every reuse hits, and only the
    second asks' own tails (never reused: a class of their own) are declined."""
    from kvtier.connector.scheduler.admission import WARMUP

    fresh = wl(*[((3 * i, 3 * i + 1, 3 * i + 2), 30) for i in range(8 * WARMUP)])
    # before any reuse a class is judged on the offers of a window (the tier's chunks) that ended a window ago
    all_saved = hitrate.replay_admission(fresh, 4, 8 * WARMUP, "all")
    learned = hitrate.replay_admission(fresh, 4, 8 * WARMUP, "learned")
    assert all_saved.saved_chunks == 3 * 8 * WARMUP and all_saved.loaded_chunks == 0
    assert learned.declined_chunks > 0 and learned.saved_chunks == all_saved.saved_chunks - learned.declined_chunks
    assert learned.saved_chunks < all_saved.saved_chunks / 2
    reused = wl(*[((3 * (i // 2), 3 * (i // 2) + 1, 3 * (i // 2) + 2, 10**6 + i), 40) for i in range(4 * WARMUP)])
    kept = hitrate.replay_admission(reused, 1, 4096, "learned")
    # the engine's one block keeps a prompt's first chunk (vLLM frees a request's tail first): kvtier serves the rest
    assert kept.engine_tokens == 2 * WARMUP * 10 and kept.loaded_chunks == 2 * 2 * WARMUP
    assert kept.declined_chunks <= 2 * WARMUP


def test_cli_engine_shares_compare_the_admission_on_and_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "adm.json"
    assert main(["bench", "hit-rate", "--workload", "agentic", "--limit", "200", "--engine", "10,40%",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "hit_rate_admission" and doc["tier_factor"] == 4.0
    assert [(r["engine_share"], r["admission"]) for r in doc["admission"]] == [
        (0.1, "all"), (0.1, "learned"), (0.1, "oracle"), (0.1, "evict"),
        (0.4, "all"), (0.4, "learned"), (0.4, "oracle"), (0.4, "evict")]
    for row in doc["admission"]:
        assert row["hit_rate"] == pytest.approx(row["engine_hit_rate"] + row["kvtier_hit_rate"])
        assert row["kvtier_hit_rate"] * row["total_tokens"] == pytest.approx(row["loaded_chunks"] * doc["chunk_tokens"])
    every, oracle = doc["admission"][0], doc["admission"][2]
    assert every["loaded_chunks"] > 0 and oracle["loaded_chunks"] >= every["loaded_chunks"]  # what pays, kept
    assert oracle["saved_chunks"] < every["saved_chunks"]
    assert "saved/loaded" in capsys.readouterr().out
    assert main(["bench", "hit-rate", "--workload", "agentic", "--engine", "0,120%"]) == 2
    assert "--engine" in capsys.readouterr().err
    assert main(["bench", "hit-rate", "--workload", "agentic", "--engine", "10%", "--tier-factor", "nan"]) == 2
    assert "--tier-factor" in capsys.readouterr().err


def test_generators_are_seeded_and_share_prefixes() -> None:
    assert multi_round_qa(seed=3) == multi_round_qa(seed=3)
    assert multi_round_qa(seed=3) != multi_round_qa(seed=4)
    w = multi_round_qa(users=5, rounds=3, system_tokens=1000, chunk_tokens=256)
    heads = {r.chunks[:3] for r in w.requests}
    assert len(heads) == 1  # 1000-token system prompt: 3 full chunks shared by every user
    assert all(len(r.chunks) == -(-r.input_len // 256) for r in w.requests)


def test_long_doc_repeat_modes() -> None:
    tile = long_doc_qa(documents=3, repeats=2, repeat_mode="tile", doc_tokens=1000)
    inter = long_doc_qa(documents=3, repeats=2, repeat_mode="interleave", doc_tokens=1000)
    first = [r.chunks[0] for r in tile.requests]
    assert first[:3] == first[3:] and len(set(first)) == 3
    firsts = [r.chunks[0] for r in inter.requests]
    assert firsts[0] == firsts[1] != firsts[2] == firsts[3]
    with pytest.raises(ValueError, match="repeat mode"):
        long_doc_qa(repeat_mode="sideways")


def test_agentic_context_grows_by_prefix() -> None:
    w = agentic(sessions=1, turns=6, seed=1)
    for a, b in zip(w.requests, w.requests[1:], strict=False):
        assert len(b.chunks) >= len(a.chunks) and b.input_len > a.input_len
        assert b.chunks[: len(a.chunks) - 1] == a.chunks[:-1]  # all but a partial last chunk reused


def test_load_mooncake_format(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]}\n')
    w = load_mooncake(path)
    assert w.chunk_tokens == 512 and w.requests == (Request((0, 1), 600), Request((0, 1, 2), 1100))
    assert load_mooncake(path, limit=1).requests == (Request((0, 1), 600),)
    assert ideal_hit_rate(w) == pytest.approx(1024 / 1700)
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        load_mooncake(path)


def test_parse_capacities() -> None:
    assert parse_capacities("5,10,20%", 1000) == [50, 100, 200]
    assert parse_capacities("300", 1000) == [300]
    assert parse_capacities("1MiB", 1000, chunk_bytes=4096) == [256]
    with pytest.raises(ValueError, match="model-shape"):
        parse_capacities("1MiB", 1000)


# ---- sweep document and CLI ------------------------------------------------------------------------------


def test_sweep_document_fields() -> None:
    w = multi_round_qa(users=10, rounds=3)
    doc = sweep(w, SweepSpec(("lru", "prefix_hd"), (50, 100), ((20, 40),)))
    assert {"workload", "chunk_tokens", "requests", "ideal_hit_rate", "results"} <= doc.keys()
    assert doc["requests"] == len(w.requests) and len(doc["results"]) == 6
    for r in doc["results"]:
        assert {"policy", "capacity_chunks", "hit_rate", "request_hit_rate", "chunk_hit_rate", "belady_hit_rate",
                "tiers"} <= r.keys()
        assert 0 <= r["hit_rate"] <= doc["ideal_hit_rate"] + 1e-12
        assert sum(r["tiers"].values()) == pytest.approx(r["hit_rate"])
    assert doc["results"][-1]["capacity_chunks"] == 60 and set(doc["results"][-1]["tiers"]) == {"tier0", "tier1"}


LONG_DOC = ["--workload", "long-doc", "--workload-arg", "repeat_mode=tile", "--workload-arg", "documents=8",
            "--sweep", "20,50%", "--policies", "lru,prefix_hd", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json FILE and --plot FILE (benchmarks/hit_rate.py, README) override --out: the files land there."""
    out, png = tmp_path / "j" / "hr.json", tmp_path / "p" / "hr.png"
    rc = main(["bench", "hit-rate", *LONG_DOC, "--json", str(out), "--plot", str(png), "--out", str(tmp_path / "o")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["workload"].startswith("long-doc(documents=8") and len(doc["results"]) == 4
    assert doc["benchmark"] == "hit_rate" and doc["quick"] is False and doc["machine"]["cores"]
    assert png.read_bytes()[:8] == PNG_MAGIC
    stdout = capsys.readouterr().out
    assert "prefix_hd" in stdout and stdout.splitlines()[-1] == f"results: {out}, {png}"
    assert not (tmp_path / "o").exists()  # --json and --plot name both files: --out is unused


def test_cli_writes_json_and_chart_into_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res"
    assert main(["bench", "hit-rate", *LONG_DOC, "--out", str(out)]) == 0
    doc = json.loads((out / "hit_rate.json").read_text())
    assert len(doc["results"]) == 4 and (out / "hit_rate.png").read_bytes()[:8] == PNG_MAGIC
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {out / 'hit_rate.json'}, hit_rate.png"
    assert main(["bench", "hit-rate", *LONG_DOC, "--out", str(tmp_path / "np"), "--no-plot"]) == 0
    assert sorted(p.name for p in (tmp_path / "np").iterdir()) == ["hit_rate.json"]  # JSON without a chart
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {tmp_path / 'np' / 'hit_rate.json'}"


def test_suite_document_and_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "hit-rate", "--suite", "synthetic", "--limit", "60", "--capacity", "20%", "--policies",
                 "lru,arc,adaptive", "--no-belady", "--no-progress", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "hit_rate.json").read_text())
    assert doc["suite"] == "synthetic" and doc["default_policy"] == "adaptive"
    assert len(doc["bars"]) == len(doc["workloads"]) == len(synthetic_suite())
    assert all(w["requests"] <= 60 and len(w["results"]) == 3 for w in doc["workloads"])
    assert (tmp_path / "hit_rate.png").read_bytes()[:8] == PNG_MAGIC
    assert "adaptive >= LRU and >= ARC: " in capsys.readouterr().out


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "hit-rate", "--workload", "agentic", "--workload-arg", "nope=1"]) == 2
    assert "--workload-arg" in capsys.readouterr().err
    assert main(["bench", "hit-rate", "--workload", "agentic", "--policies", "lru,fifo"]) == 2
    assert "fifo" in capsys.readouterr().err
    assert main(["bench", "hit-rate", "--trace", "/nonexistent.jsonl"]) == 2
    assert "no trace file" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    hitrate_cli.add_arguments(parser)  # the module kvtier bench's table names
    args = parser.parse_args(["--workload", "agentic", "--capacity", "lots"])
    with pytest.raises(ConfigError, match="--capacity"):
        hitrate_cli.spec_from(args, hitrate_cli.load_workload(args))


@needs_trace
def test_cli_smoke_on_mooncake(tmp_path: Path) -> None:
    out = tmp_path / "mc.json"
    rc = main(["bench", "hit-rate", "--trace", str(TRACE), "--limit", "300", "--sweep", "10%",
               "--tiers", "5%,10%", "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 300 and doc["chunk_tokens"] == 512
    assert [(r["policy"], len(r["tier_capacities"])) for r in doc["results"]][-1] == ("adaptive", 2)
    for r in doc["results"]:
        assert 0 < r["hit_rate"] <= doc["ideal_hit_rate"] and r["request_hit_rate"] > 0.9
        assert r["belady_hit_rate"] <= doc["ideal_hit_rate"]
        if r["policy"] == "lru":
            assert r["belady_hit_rate"] >= r["hit_rate"]


@needs_trace
@pytest.mark.slow
def test_mooncake_reference_numbers() -> None:
    """The independent replay's figures (trace README): infinite 37.4%, LRU 28.4%, ARC 29.0%, Belady 37.4%."""
    w = load_mooncake(TRACE)
    cap = round(0.10 * w.unique_chunks())
    assert ideal_hit_rate(w) == pytest.approx(0.374, abs=0.001)
    assert replay_policy(w, "lru", [cap]).hit_rate == pytest.approx(0.284, abs=0.001)
    assert replay_policy(w, "arc", [cap]).hit_rate == pytest.approx(0.290, abs=0.005)
    assert belady_hit_rate(w, cap) == pytest.approx(0.374, abs=0.001)
    # per block (chunk): infinite 36.6%, LRU at 5 / 10 / 20 / 40% 19.5 / 27.8 / 34.5 / 36.0%
    assert ideal_stats(w).chunk_hit_rate == pytest.approx(0.366, abs=0.001)
    for pct, ref in ((5, 0.195), (10, 0.278), (20, 0.345), (40, 0.360)):
        stats = replay_policy(w, "lru", [round(pct / 100 * w.unique_chunks())])
        assert stats.chunk_hit_rate == pytest.approx(ref, abs=0.001), pct


def test_bench_registry_and_missing_benchmark(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert set(bench_cli.BENCHMARKS) == {"hit-rate", "throughput", "ttft", "overhead", "vllm", "vllm-overhead",
                                        "vllm-contention", "vllm-replay", "serve", "fingerprint", "copy"}
    monkeypatch.setitem(bench_cli.BENCHMARKS, "ttft", ("kvtier.bench.not_written_yet", "later"))
    assert main(["bench", "ttft"]) == 2
    assert "benchmark 'ttft' is not available" in capsys.readouterr().err
    assert main(["bench", "hit-rate", "--workload", "agentic", "--capacity", "50%", "--policies", "lru",
                 "--no-progress", "--no-plot", "--out", str(tmp_path)]) == 0  # the others keep working
    assert json.loads((tmp_path / "hit_rate.json").read_text())["results"][0]["policy"] == "lru"


# ---- no trace, --quick (issue 19) ---------------------------------------------------------------------------


def test_cli_without_a_trace_says_where_to_get_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(hitrate, "DEFAULT_TRACE", tmp_path / "absent.jsonl")
    assert main(["bench", "hit-rate", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith(f"kvtier: error: --trace: no trace file at {tmp_path / 'absent.jsonl'}")
    assert f"get it from {hitrate.TRACE_SOURCE}" in line and "Traceback" not in err


@pytest.mark.parametrize(("text", "message"), [
    ('{"timestamp": 0, "input_length": 3}\n', "not a Mooncake trace line"),  # no hash_ids
    ("this is not json\n", "not a Mooncake trace line"),
    ("", "holds no requests"),
])
def test_cli_a_trace_that_is_not_one_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             text: str, message: str) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(text)
    assert main(["bench", "hit-rate", "--trace", str(trace), "--no-progress", "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith("kvtier: error: --trace: ") and message in line
    assert not (tmp_path / "r" / "hit_rate.json").exists()


@pytest.mark.parametrize("capacity", ["200%", "0%", "5,150%"])
def test_cli_a_share_over_100_percent_is_refused(capsys: pytest.CaptureFixture[str], capacity: str) -> None:
    assert main(["bench", "hit-rate", "--workload", "agentic", "--capacity", capacity, "--no-progress",
                 "--no-plot"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("kvtier: error: --capacity: ") and "at most 100%" in line


def test_cli_missing_trace_in_a_real_process_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "hit-rate", "--trace", str(tmp_path / "no.jsonl"),
                           "--quick"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert "no trace file at" in line and "github.com/kvcache-ai/Mooncake" in line


def test_cli_quick_without_a_trace_replays_a_synthetic_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(hitrate, "DEFAULT_TRACE", tmp_path / "absent.jsonl")
    out = tmp_path / "q.json"
    assert main(["bench", "hit-rate", "--quick", "--no-progress", "--no-plot", "--json", str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"no trace at {tmp_path / 'absent.jsonl'} (get it from {hitrate.TRACE_SOURCE}): --quick "
                     "replays the synthetic agentic workload instead")
    doc = json.loads(out.read_text())
    assert doc["workload"].startswith("agentic(") and doc["requests"] == 186  # all of it: under --quick's bound
    assert {round(r["capacity_fraction"], 2) for r in doc["results"]} == {0.1}


@needs_trace
def test_cli_quick_on_the_trace_is_bounded(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    assert main(["bench", "hit-rate", "--quick", "--no-progress", "--no-plot", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == hitrate_cli.QUICK_REQUESTS and doc["workload"].startswith("mooncake:")
    assert [r["policy"] for r in doc["results"]] == list(POLICIES)  # every policy, at 10% only
    assert {round(r["capacity_fraction"], 3) for r in doc["results"]} == {0.1}


def test_the_default_policy_is_at_least_lru_and_arc_on_every_synthetic_workload() -> None:
    """Issue 20's bar, on the benchmark's synthetic suite (the held-out suite and the trace: README)."""
    assert hitrate.DEFAULT_POLICY == "adaptive"
    docs = [sweep(w, SweepSpec(("lru", "arc", "adaptive"), tuple(parse_capacities("5,10,20,40%", w.unique_chunks())),
                               belady=False)) for w in synthetic_suite()]
    checks = hitrate.bars(docs, "adaptive")
    assert len(checks) == 12 and all(c["met"] for c in checks), [c for c in checks if not c["met"]]
