"""``kvtier check --probe`` against real directories, real redis-server processes and this host; plain ``check``
stays offline (an audit hook in a subprocess sees every socket and every file opened for writing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.bench.redis_servers import RedisClusterServers, TlsFiles, free_port
from kvtier.ops import cli, probe
from kvtier.ops.probe import FAIL, OK, WARN, meminfo, probe_disk

SHAPE = "layers=1,kv_heads=1,head_size=8,dtype=bfloat16,block_size=16"  # 512-byte chunks: tiny tiers are valid


def write_config(tmp_path: Path, *tiers: dict[str, Any]) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 16, "tiers": list(tiers)}))
    return str(path)


def probe_json(capsys: pytest.CaptureFixture[str], config: str) -> tuple[int, dict[str, Any], list[str]]:
    """``kvtier check CONFIG --probe --json`` in process: exit code, report, stderr lines."""
    rc = cli.main(["check", config, "--probe", "--json", "--model-shape", SHAPE])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err.splitlines()


def by_path(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["path"]: f for f in rep["probe"]}


def disk(path: Path | str, capacity: str = "1MiB", name: str = "disk") -> dict[str, Any]:
    return {"name": name, "kind": "disk", "capacity": capacity, "path": str(path)}


AUDIT = """
import os, sys
seen = []
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def hook(event, args):
    if event.startswith("socket.") or event in ("os.mkdir", "os.remove", "os.rename", "shutil.rmtree"):
        seen.append(event)
    elif event == "open" and args[0] is not None and (
            any(c in str(args[1] or "") for c in "wax+") or int(args[2] or 0) & WRITE):
        seen.append(f"open {args[0]} {args[1]}")
sys.addaudithook(hook)
from kvtier.ops import cli
rc = cli.main(sys.argv[1:])
print("AUDIT", repr(seen), file=sys.stderr)
sys.exit(rc)
"""


def test_plain_check_opens_no_socket_and_writes_no_file(tmp_path: Path, redis_server: Any) -> None:
    missing = tmp_path / "not" / "yet"
    config = write_config(tmp_path, {"name": "cpu", "kind": "cpu", "capacity": "1MiB"}, disk(missing),
                          {"name": "redis", "kind": "redis", "capacity": "1MiB", "url": redis_server.url})
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", AUDIT, "check", config, "--model-shape", SHAPE],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "AUDIT []"
    assert not missing.parent.exists()


def test_writable_disk_path_passes_and_leaves_nothing_behind(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    made = tmp_path / "cache" / "kv"
    rc, rep, err = probe_json(capsys, write_config(tmp_path, disk(made)))
    assert rc == 0 and rep["ok"] is True and err == []
    found = by_path(rep)["tiers[0].path"]
    assert found["level"] == OK and str(made) in found["message"] and found["seconds"] > 0
    assert not (tmp_path / "cache").exists()  # the directories the probe created are gone again
    existing = tmp_path / "there"
    existing.mkdir()
    assert probe_disk(load_disk(existing), "tiers[0]").level == OK
    assert list(existing.iterdir()) == []  # its probe file is removed


def load_disk(path: Path) -> Any:
    from kvtier.config import load_config

    return load_config({"tiers": [disk(path)]}, env={}).tiers[0]


def test_path_under_a_regular_file_fails_with_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    rc, rep, err = probe_json(capsys, write_config(tmp_path, disk(tmp_path / "ok"),
                                                   disk(tmp_path / "file" / "kv", name="bad")))
    assert rc == 1 and rep["ok"] is False
    found = by_path(rep)["tiers[1].path"]
    assert found["level"] == FAIL and "regular file" in found["message"]
    assert by_path(rep)["tiers[0].path"]["level"] == OK
    assert len(err) == 1 and err[0].startswith("kvtier: error: tiers[1].path: cannot create")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_fails_with_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        rc, rep, err = probe_json(capsys, write_config(tmp_path, disk(locked / "kv")))
    finally:
        locked.chmod(0o700)
    assert rc == 1 and "permission denied" in by_path(rep)["tiers[0].path"]["message"]
    assert len(err) == 1 and "tiers[0].path" in err[0]


def test_redis_server_answers(tmp_path: Path, redis_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep, err = probe_json(capsys, write_config(
        tmp_path, {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": redis_server.url}))
    assert rc == 0 and err == []
    found = by_path(rep)["tiers[0].url"]
    assert found["level"] == OK and found["message"].startswith(f"PING 127.0.0.1:{redis_server.port}: ")
    assert 0 < found["seconds"] < 5


def test_redis_cluster_every_node_answers(tmp_path: Path, redis_cluster: RedisClusterServers,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep, err = probe_json(capsys, write_config(
        tmp_path, {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": redis_cluster.url}))
    assert rc == 0, err
    assert by_path(rep)["tiers[0].url"]["message"].startswith("cluster_state:ok, 3 nodes answered PING")


def test_a_cluster_node_that_does_not_answer_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("redis")
    with RedisClusterServers(3) as cluster:
        url, dead = cluster.url, cluster.nodes[2]
        dead.kill()  # the others still say cluster_state:ok until the node timeout (5 s) passes
        rc, rep, err = probe_json(capsys, write_config(
            tmp_path, {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": url}))
    assert rc == 1 and len(err) == 1
    message = by_path(rep)["tiers[0].url"]["message"]
    assert f"127.0.0.1:{dead.port}" in message or "cluster is not ok" in message


def test_nothing_listening_fails_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    rc, rep, err = probe_json(capsys, write_config(
        tmp_path, {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": url, "connect_timeout": "1s"}))
    assert rc == 1 and rep["ok"] is False
    assert len(err) == 1 and err[0].startswith(f"kvtier: error: tiers[0].url: cannot reach {url}")


@pytest.mark.parametrize(("maxmemory", "policy", "warned"), [
    ("0", "allkeys-lru", "maxmemory is 0 (unbounded)"),
    ("64mb", "noeviction", "maxmemory-policy is noeviction"),
    ("64mb", "allkeys-lru", None),
])
def test_a_redis_that_would_not_bound_or_evict_warns(tmp_path: Path, redis_factory: Any,
                                                     capsys: pytest.CaptureFixture[str], maxmemory: str,
                                                     policy: str, warned: str | None) -> None:
    """The docs require ``maxmemory`` and an evicting policy: the probe warns about a server without them (exit 0:
    the engine starts, and the server misbehaves later)."""
    srv = redis_factory(maxmemory=maxmemory, extra=["--maxmemory-policy", policy])
    rc, rep, _ = probe_json(capsys, write_config(
        tmp_path, {"name": "redis", "kind": "redis", "capacity": "32MiB", "url": srv.url}))
    warnings = [f["message"] for f in rep["probe"] if f["level"] == WARN and f["path"] == "tiers[0].capacity"]
    assert rc == 0
    assert warnings == [] if warned is None else len(warnings) == 1 and warned in warnings[0]


@pytest.mark.parametrize(("value", "level"), [(None, FAIL), ("short", FAIL), ("k" * 32, OK)])
def test_the_signing_key_the_engine_will_need_is_probed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                        level: str) -> None:
    """``security.hmac_key_env`` unset or too short: the engine refuses to start, so the probe fails, naming the
    setting and never the key."""
    monkeypatch.delenv("KVTIER_PROBE_KEY", raising=False)
    if value is not None:
        monkeypatch.setenv("KVTIER_PROBE_KEY", value)
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"chunk_size": 16, "security": {"hmac_key_env": "KVTIER_PROBE_KEY"},
                                    "tiers": [disk(tmp_path / "kv")]}))
    rc, rep, err = probe_json(capsys, str(path))
    found = by_path(rep)["security.hmac_key_env"]
    assert found["level"] == level and rc == (1 if level == FAIL else 0)
    if level == FAIL:
        assert len(err) == 1 and "KVTIER_PROBE_KEY" in err[0] and "refuse to start" in err[0]
        assert value is None or value not in err[0]  # the key itself is never printed


def test_wrong_password_says_authentication_failed(tmp_path: Path, redis_factory: Any,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    srv = redis_factory(password="right-one")
    tier = {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": f"redis://:wrong@127.0.0.1:{srv.port}/0"}
    rc, rep, err = probe_json(capsys, write_config(tmp_path, tier))
    assert rc == 1 and len(err) == 1
    assert "authentication failed for tiers[0].url" in err[0] and "wrong" not in err[0]  # the password is redacted
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "right-one")  # the configured credentials: the default env var
    rc, rep, err = probe_json(capsys, write_config(tmp_path, {**tier, "url": srv.url}))
    assert rc == 0 and err == [] and by_path(rep)["tiers[0].url"]["level"] == OK


def test_tls_uses_the_configured_certificates(tmp_path: Path, redis_factory: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The probe connects as the tier would: with the section's CA and client certificate (the server asks for
    one), and fails without them."""
    tls = TlsFiles.create(tmp_path)
    srv = redis_factory(tls=tls)
    tier = {"name": "redis", "kind": "redis", "capacity": "64MiB", "url": srv.url, "tls_ca": tls.ca,
            "tls_cert": tls.client_cert, "tls_key": tls.client_key, "connect_timeout": "2s"}
    rc, rep, err = probe_json(capsys, write_config(tmp_path, tier))
    assert rc == 0 and err == [] and by_path(rep)["tiers[0].url"]["level"] == OK
    bare = {k: v for k, v in tier.items() if k not in ("tls_cert", "tls_key")}
    rc, rep, err = probe_json(capsys, write_config(tmp_path, bare))
    assert rc == 1 and len(err) == 1 and err[0].startswith("kvtier: error: tiers[0].url: ")


def test_a_cpu_tier_bigger_than_ram_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Above MemAvailable, with the address space reserved (pageable memory, backed as it fills): a warning."""
    if "MemAvailable" not in meminfo():
        pytest.skip("no /proc/meminfo")
    monkeypatch.setattr(probe, "reserve", lambda sizes: None)
    monkeypatch.setattr(probe, "_pinned", lambda tiers: [])
    rc, rep, err = probe_json(capsys, write_config(tmp_path, {"name": "cpu", "kind": "cpu", "capacity": "10TiB"}))
    assert rc == 0 and rep["ok"] is True and err == []  # a warning, not a failure
    found = by_path(rep)["tiers[0].capacity"]
    assert found["level"] == WARN and "more than this host's RAM" in found["message"]
    monkeypatch.undo()
    rc, rep, _ = probe_json(capsys, write_config(tmp_path, {"name": "cpu", "kind": "cpu", "capacity": "1MiB"}))
    assert by_path(rep)["tiers[0].capacity"]["level"] == OK


def test_a_cpu_tier_the_host_cannot_reserve_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The probe reserves the pool's address space as the tier does at start: refused, the tier would not start
    (kvtier demo: "cannot reserve"), so the probe fails with exit code 1 instead of warning."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("this host reserves any size (vm.overcommit_memory=1)")
    config = write_config(tmp_path, {"name": "cpu", "kind": "cpu", "capacity": "1MiB"},
                          {"name": "big", "kind": "cpu", "capacity": "10TiB", "pin_memory": False})
    rc, rep, err = probe_json(capsys, config)
    assert rc == 1 and rep["ok"] is False
    assert len(err) == 1 and err[0].startswith("kvtier: error: tiers[1].capacity: this host refuses to reserve "
                                               "10 TiB for tier 'big'"), err
    assert "the tier would not start; lower the capacity" in err[0]


def test_pinned_cpu_tiers_past_ram_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned memory is allocated whole at start: past MemAvailable the tier would not start."""
    if "MemAvailable" not in meminfo():
        pytest.skip("no /proc/meminfo")
    monkeypatch.setattr(probe, "reserve", lambda sizes: None)
    monkeypatch.setattr(probe, "_pinned", lambda tiers: list(tiers))  # as on a CUDA host
    rc, _, err = probe_json(capsys, write_config(tmp_path, {"name": "cpu", "kind": "cpu", "capacity": "10TiB"}))
    assert rc == 1 and len(err) == 1 and "pinned cpu tiers take 10 TiB, allocated whole at start" in err[0]
    assert "set pin_memory: false" in err[0]


def test_a_disk_quota_bigger_than_the_free_space_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    rc, rep, err = probe_json(capsys, write_config(tmp_path, disk(tmp_path / "a", capacity=f"{free * 2}B"),
                                                   disk(tmp_path / "b", name="small")))
    assert rc == 0 and err == []
    found = by_path(rep)["tiers[0].capacity + tiers[1].capacity"]  # both tiers share one file system
    assert found["level"] == WARN and "more than the free space" in found["message"]


def test_a_gpu_tier_without_its_device_fails_with_a_clear_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last device: absent here and on a GPU host
    rc, rep, err = probe_json(capsys, write_config(
        tmp_path, {"name": "gpu", "kind": "gpu", "capacity": "1MiB", "device": device}))
    assert rc == 1 and len(err) == 1 and by_path(rep)["tiers[0].device"]["level"] == FAIL
    assert err[0].startswith(f"kvtier: error: tiers[0].device: device {device} does not exist")


def test_table_output_and_help(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["check", write_config(tmp_path, disk(tmp_path / "d")), "--probe", "--model-shape", SHAPE])
    out = capsys.readouterr().out
    assert rc == 0
    assert "probe          2 ok, 0 warning(s), 0 failed" in out
    assert any(line.split()[:3] == ["OK", "tiers[0].path", "disk"] for line in out.splitlines())
    with pytest.raises(SystemExit):
        cli.build_parser("check").parse_args(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--probe" in text and "1 when a probe failed" in text and "2 for a config or usage error" in text


def test_a_gpu_tier_on_the_host_counts_as_ram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, rep, err = probe_json(capsys, write_config(
        tmp_path, {"name": "gpu", "kind": "gpu", "capacity": "1MiB", "device": "cpu"},
        {"name": "cpu", "kind": "cpu", "capacity": "1MiB"}))
    assert rc == 0 and err == []
    found = by_path(rep)
    assert found["tiers[0].device"]["level"] == OK
    if "MemAvailable" in meminfo():
        assert found["tiers[0].capacity + tiers[1].capacity"]["message"].startswith("memory tiers take 2 MiB")


def test_a_gpu_tier_on_a_gpu_host_passes_and_fails_past_its_memory(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rc, rep, err = probe_json(capsys, write_config(
        tmp_path, {"name": "gpu", "kind": "gpu", "capacity": "100TiB", "device": "cuda:0"}))
    assert rc == 1 and len(err) == 1  # allocated whole at start: the tier would not start
    found = by_path(rep)
    assert found["tiers[0].device"]["level"] == OK
    assert found["tiers[0].capacity"]["level"] == FAIL and "more than the device has free" in \
        found["tiers[0].capacity"]["message"]
