"""``kvtier stats``, ``inspect`` and ``purge`` on records written by the real disk and Redis tiers: in process
through ``kvtier.ops.cli.main`` and as the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from redis_helpers import fresh_prefix, started_tiers
from test_catalog import NS_A, NS_B, key, two_models

from kvtier.bench.redis_servers import RedisServer
from kvtier.ops import cli
from kvtier.records.codec import HEADER_SIZE

KVTIER = Path(sys.executable).parent / "kvtier"
RECORD = HEADER_SIZE + 128  # 64 float16


def config(tmp_path: Path, redis_url: str | None = None, prefix: str = "kvtier") -> str:
    lines = ["tiers:", "  - {name: cpu, kind: cpu, capacity: 1MiB}",
             f"  - {{name: disk, kind: disk, capacity: 1GiB, path: '{tmp_path / 'disk'}'}}"]
    if redis_url:
        lines.append(f"  - {{name: redis, kind: redis, capacity: 1GiB, url: '{redis_url}', key_prefix: {prefix}, "
                     f"connect_timeout: 500ms}}")
    path = tmp_path / "kvtier.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
async def cache(tmp_path: Path) -> Path:
    """``two_models``: A (model-a, 3 records, 2 h old) and B (model-b, 4 records, 10 days old)."""
    return await two_models(tmp_path / "disk")


def kvtier(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def files(root: Path, ns: bytes) -> int:
    return len(list((root / ns.hex()).rglob("*.kvt")))


def test_stats_table_and_json(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    rc, out, err = kvtier(capsys, "stats", "--config", cfg)
    assert rc == 0 and err == ""
    assert "cpu (cpu): in-process only, not inspectable offline" in out
    assert f"disk (disk, {cache}): 2 namespace(s), 7 records" in out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith(NS_A.hex()))
    assert row[1:3] == ["3", str(3 * RECORD)] and "model-a" in row
    rc, out, _ = kvtier(capsys, "stats", "--config", cfg, "--tier", "disk", "--json")
    rep = json.loads(out)
    [disk] = rep["tiers"]
    assert rc == 0 and rep["ok"] and disk["records"] == 7 and disk["bytes"] == 7 * RECORD
    by_ns = {n["namespace"]: n for n in disk["namespaces"]}
    assert by_ns[NS_B.hex()]["records"] == 4 and by_ns[NS_B.hex()]["manifest"]["model"] == "model-b"
    assert time.time() - by_ns[NS_B.hex()]["newest"] > 9 * 86400


def test_unreachable_redis_is_one_line_and_exit_1(tmp_path: Path, cache: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = kvtier(capsys, "stats", "--config", config(tmp_path, "redis://127.0.0.1:1/0"))
    assert rc == 1
    [line] = [line for line in out.splitlines() if line.startswith("redis ")]
    assert line.startswith("redis (redis, redis://127.0.0.1:1/0): unreachable: ")
    assert "7 records" in out  # the disk tier is still shown


async def test_redis_tier_in_stats_and_purge(tmp_path: Path, cache: Path, redis_server: RedisServer,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    prefix = fresh_prefix("s")
    async with started_tiers(redis_server.url, prefix) as make:
        tier = await make()
        await tier.put([(key(NS_A, i), torch.ones(16)) for i in range(5)])
    cfg = config(tmp_path, redis_server.url, prefix)
    rc, out, _ = kvtier(capsys, "stats", "--config", cfg, "--tier", "redis", "--json")
    [redis_tier] = json.loads(out)["tiers"]
    assert rc == 0 and redis_tier["records"] == 5 and redis_tier["bytes"] == 5 * tier.stored_size(64)
    assert redis_tier["namespaces"][0]["oldest"] is None  # no ttl: age unknown
    rc, out, _ = kvtier(capsys, "purge", "--config", cfg, "--namespace", NS_A.hex(), "--yes")
    assert rc == 0
    assert f"redis: deleted 5 records, {5 * tier.stored_size(64)} bytes" in out
    assert f"disk: deleted 3 records, {3 * RECORD} bytes" in out
    assert files(cache, NS_A) == 0 and files(cache, NS_B) == 4


def test_inspect_lists_and_verifies(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--namespace", NS_B.hex(), "--limit", "2", "--json")
    [block] = json.loads(out)["tiers"]
    assert rc == 0 and block["records"] == 4 and len(block["shown"]) == 2
    assert block["shown"][0]["dtype"] == "float16" and block["shown"][0]["shape"] == [64]
    assert block["shown"][0]["codec"] == "raw"
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--key", key(NS_A, 1).hex())
    assert rc == 0 and "check ok" in out and "dtype float16, shape [64]" in out
    [path] = (cache / NS_A.hex()).rglob(f"{key(NS_A, 1).hex()}.kvt")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--key", key(NS_A, 1).hex())
    assert rc == 1 and "check FAILED: payload checksum mismatch" in out
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--key", key(NS_A, 99).hex())
    assert rc == 1 and "is in no tier" in out


def _corrupt(cache: Path, ns: bytes, i: int) -> None:
    [path] = (cache / ns.hex()).rglob(f"{key(ns, i).hex()}.kvt")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_inspect_verifies_many_keys_in_one_call(tmp_path: Path, cache: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--key takes as many keys as wanted (one pass, one config load), and says which failed or are missing."""
    cfg = config(tmp_path)
    good = [key(NS_A, i).hex() for i in range(3)] + [key(NS_B, i).hex() for i in range(4)]
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--key", *good)
    assert rc == 0 and out.count("check ok") == 7 and "7 keys: 7 ok, 0 failed verification, 0 in no tier" in out
    _corrupt(cache, NS_A, 1)
    missing = key(NS_A, 99).hex()
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--key", *good[:2], "--key", missing, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and doc["missing"] == [missing]
    assert [c["check"].split(":")[0] for c in doc["tiers"]] == ["ok", "FAILED"]


def test_inspect_namespace_verify_checks_every_record(tmp_path: Path, cache: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--namespace", NS_B.hex(), "--limit", "1", "--verify")
    assert rc == 0 and "verified 4 records: all ok" in out
    _corrupt(cache, NS_B, 2)
    rc, out, _ = kvtier(capsys, "inspect", "--config", cfg, "--namespace", NS_B.hex(), "--verify", "--json")
    [block] = json.loads(out)["tiers"]
    assert rc == 1 and block["verified"] == 4 and [f["key"] for f in block["failed"]] == [key(NS_B, 2).hex()]
    rc, _, err = kvtier(capsys, "inspect", "--config", cfg, "--key", key(NS_A, 0).hex(), "--verify")
    assert rc == 2 and err.startswith("kvtier: error: --verify: verifies the records of a --namespace")


def test_purge_by_model_dry_run_and_age(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    rc, out, _ = kvtier(capsys, "purge", "--config", cfg, "--model", "model-a", "--dry-run")
    assert rc == 0 and f"disk: would delete 3 records, {3 * RECORD} bytes" in out and "nothing deleted" in out
    assert files(cache, NS_A) == 3
    rc, out, _ = kvtier(capsys, "purge", "--config", cfg, "--model", "model-a", "--yes")
    assert rc == 0 and f"disk: deleted 3 records, {3 * RECORD} bytes" in out
    assert "cpu: in-process only" in out
    assert (files(cache, NS_A), files(cache, NS_B)) == (0, 4)
    rc, out, _ = kvtier(capsys, "purge", "--config", cfg, "--older-than", "11d", "--yes")
    assert rc == 0 and "disk: deleted 0 records" in out and files(cache, NS_B) == 4
    rc, out, _ = kvtier(capsys, "purge", "--config", cfg, "--older-than", "7d", "--yes", "--json")
    assert rc == 0 and json.loads(out)["tiers"]["disk"]["deleted"] == 4 and files(cache, NS_B) == 0


def test_purge_leaves_a_ledger_to_its_owner(tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger = cache / ".kvtier-ledger"
    ledger.write_text("ledger")
    rc, out, _ = kvtier(capsys, "purge", "--config", config(tmp_path), "--all", "--yes")
    assert rc == 0 and "disk: deleted 7 records" in out and "recounts it (nothing to do)" in out
    assert "note" not in out and ledger.read_text() == "ledger"
    rc, out, _ = kvtier(capsys, "stats", "--config", config(tmp_path))
    assert rc == 0 and "disk (disk, " + str(cache) + "): 0 namespace(s), 0 records" in out
    assert NS_A.hex() not in out and "and 2 namespace(s) with no records" in out


def test_stats_names_a_disk_directory_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "nowhere"))
    rc, out, _ = kvtier(capsys, "stats")
    assert rc == 0 and "no such directory: nothing stored there yet" in out
    assert f"its parent is $KVTIER_CACHE_DIR ({tmp_path / 'nowhere'})" in out


@pytest.mark.parametrize(("args", "message"), [
    (["purge", "--config", "{cfg}"], "say what to delete"),
    (["purge", "--config", "{cfg}", "--all", "--model", "m"], "do not combine"),
    (["purge", "--config", "{cfg}", "--older-than", "soon"], "--older-than: bad duration"),
    (["purge", "--config", "{cfg}", "--older-than", "7"], "--older-than: '7' has no unit (did you mean 7d, 7h"),
    (["purge", "--config", "{cfg}", "--namespace", "abc"], "--namespace: expected 32 hex digits"),
    (["inspect", "--config", "{cfg}"], "give either --namespace HEX or --key HEX"),
    (["stats", "--config", "{cfg}", "--tier", "nope"], "no tier named 'nope'"),
    (["stats", "--config", "{missing}"], "not found"),
])
def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                      message: str) -> None:
    cfg = config(tmp_path)
    rc, _, err = kvtier(capsys, *[a.format(cfg=cfg, missing=tmp_path / "none.yaml") for a in args])
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvtier: error: ") and message in err


def test_purge_refuses_without_yes_when_not_a_terminal(tmp_path: Path, cache: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run([str(KVTIER), "purge", "--config", config(tmp_path), "--all"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, env=env, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "pass --yes" in proc.stderr
    assert f"disk: would delete 7 records, {7 * RECORD} bytes" in proc.stdout
    assert files(cache, NS_A) == 3 and files(cache, NS_B) == 4
    proc = subprocess.run([str(KVTIER), "stats", "--config", config(tmp_path), "--json"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0 and json.loads(proc.stdout)["tiers"][1]["records"] == 7


@pytest.mark.parametrize(("answer", "left"), [(b"n\n", 7), (b"y\n", 0)])
def test_purge_asks_on_a_terminal(tmp_path: Path, cache: Path, answer: bytes, left: int) -> None:
    import pty

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    try:
        proc = subprocess.Popen([str(KVTIER), "purge", "--config", config(tmp_path), "--all"], stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        os.write(master, answer)
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    assert proc.returncode == 0, err
    assert "delete 7 records" in out and "[y/N]" in out
    assert files(cache, NS_A) + files(cache, NS_B) == left
    assert ("nothing deleted" in out) == (left == 7)


# a kvtier command that says on its last stderr line whether torch was imported
WITHOUT_TORCH = ("import sys\nfrom kvtier.ops import cli\nrc = cli.main(sys.argv[1:])\n"
                 "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)\n"
                 "sys.exit(rc)")


def kvtier_alone(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=env, timeout=120, check=False)


async def test_inspect_and_purge_of_redis_import_no_torch(tmp_path: Path, redis_server: RedisServer) -> None:
    """A Redis-only config: reading a record in parts (inspect --key) and deleting records and their parts
    (purge) need the record layout only, not torch (about 2 s and 300 MB to import)."""
    prefix = fresh_prefix("n")
    big = torch.zeros(3 << 20, dtype=torch.float16)  # 6 MiB: a head and parts
    async with started_tiers(redis_server.url, prefix) as make:
        tier = await make()
        assert await tier.put([(key(NS_A, 0), big), (key(NS_A, 1), torch.ones(16))]) == [True, True]
    cfg = tmp_path / "redis.yaml"
    cfg.write_text(f"tiers:\n  - {{name: redis, kind: redis, capacity: 1GiB, url: '{redis_server.url}', "
                   f"key_prefix: {prefix}}}\n")
    shown = kvtier_alone("inspect", "--config", str(cfg), "--key", key(NS_A, 0).hex())
    assert shown.returncode == 0 and "check ok" in shown.stdout, shown.stderr
    assert shown.stderr.splitlines()[-1] == "torch not imported"
    listed = kvtier_alone("inspect", "--config", str(cfg), "--namespace", NS_A.hex())
    assert listed.returncode == 0 and "redis: 2 records" in listed.stdout, listed.stderr
    assert listed.stderr.splitlines()[-1] == "torch not imported"
    purged = kvtier_alone("purge", "--config", str(cfg), "--all", "--yes")
    assert purged.returncode == 0, purged.stderr
    assert f"redis: deleted 2 records, {tier.stored_size(big.nbytes) + tier.stored_size(64)} bytes" in purged.stdout
    assert purged.stderr.splitlines()[-1] == "torch not imported"
    counted = kvtier_alone("stats", "--config", str(cfg), "--json")
    assert json.loads(counted.stdout)["tiers"][0]["records"] == 0
    assert counted.stderr.splitlines()[-1] == "torch not imported"
