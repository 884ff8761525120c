"""Security of what kvtier reads back and what it prints, through the REAL engine where it matters.

* nothing read from a tier is ever unpickled (a scan of kvtier's source that would catch one);
* two tenants sharing ONE Redis and ONE disk directory never get each other's KV: misses, not wrong tensors,
  even when one tenant's record is copied under the other's name;
* HMAC-SHA256 signing (``security.hmac_key_env``): unsigned or wrongly signed records are refused (a miss,
  counted in ``corrupt``), correctly signed ones load; bad keys are clear config errors;
* disk directories 0700 and record files 0600 whatever the umask;
* Redis passwords (in the URL or in ``KVTIER_REDIS_PASSWORD``) never appear in logs, exception messages or
  ``kvtier check`` output.

Tier-level versions: tests/tiers/test_redis.py (two namespaces on one Redis, signed records),
tests/tiers/test_disk.py (modes, signed records), tests/tiers/test_redis_security.py (URL redaction, wrong
passwords at start), tests/records/test_codec.py (signature checks).
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
import stat
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from faultkit import (
    assert_clean,
    assert_identical,
    fault_waves,
    make_config,
    record_files,
    run_faulted,
    tier_section,
)

from kvtier.bench.redis_servers import RedisServer
from kvtier.config import SecurityConfig
from kvtier.engine import Engine, EngineArgs, KVTierPair
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.records.security import MIN_KEY_BYTES, load_hmac_key

REPO = Path(__file__).resolve().parents[2]
STORE, REPEAT = fault_waves()[0], fault_waves()[3]  # REPEAT's "w3-a" repeats a prompt of STORE
SECRET = "Sup3r-s3cret-pw"
KEY1, KEY2 = "k1-" + "a" * 32, "k2-" + "b" * 32

# ---- nothing unpickled ------------------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("yaml", "load"), ("yaml", "unsafe_load"),
                ("pickle", "loads"), ("pickle", "load"), ("marshal", "loads")}
UNSAFE_NAMES = {"eval", "exec"}


def unsafe_uses(source: str) -> list[str]:
    """Imports of deserialisers that run code, and calls that load objects from bytes, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"from {node.module}")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and (fn.value.id, fn.attr) in UNSAFE_CALLS:
                found.append(f"{fn.value.id}.{fn.attr}")
            elif isinstance(fn, ast.Name) and fn.id in UNSAFE_NAMES:
                found.append(fn.id)
    return found


def test_scanner_finds_unpickling() -> None:
    snippet = "import pickle\nfrom marshal import loads\nimport torch\nx = torch.load(f)\ny = pickle.loads(b)\neval(s)\n"
    assert unsafe_uses(snippet) == ["pickle", "from marshal", "torch.load", "pickle.loads", "eval"]


def test_nothing_in_kvtier_unpickles() -> None:
    files = sorted((REPO / "kvtier").rglob("*.py"))
    assert len(files) > 30
    offenders = {str(p.relative_to(REPO)): uses for p in files if (uses := unsafe_uses(p.read_text()))}
    assert offenders == {}


# ---- tenants ---------------------------------------------------------------------------------------------

def shared_tier(medium: str, root: Path, server: RedisServer) -> dict[str, object]:
    if medium == "disk":
        return tier_section("disk", root=root)
    return tier_section("redis", url=server.url, key_prefix="kvtier-shared-team", timeout="1s")


def record_names(medium: str, root: Path, client: redis.Redis) -> set[object]:
    if medium == "disk":
        return set(record_files(root))
    return set(client.scan_iter(match="kvtier-shared-team:*"))


def read(medium: str, client: redis.Redis, name: object) -> bytes:
    return name.read_bytes() if isinstance(name, Path) else client.get(name)


def write(medium: str, client: redis.Redis, name: object, data: bytes) -> None:
    if isinstance(name, Path):
        name.write_bytes(data)
    else:
        client.set(name, data)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis(host="127.0.0.1", port=redis_server.port)
    for name in c.scan_iter(match="kvtier-shared-team:*"):
        c.delete(name)
    yield c
    c.close()


@pytest.mark.parametrize("medium", ["disk", "redis"])
def test_two_tenants_sharing_one_tier_never_see_each_other(medium: str, tmp_path: Path, redis_server: RedisServer,
                                                           client: redis.Redis) -> None:
    root = tmp_path / "shared"
    alice = make_config([shared_tier(medium, root, redis_server)], tenant="alice")
    bob = make_config([shared_tier(medium, root, redis_server)], tenant="bob")
    run_a = run_faulted(alice, [STORE])
    alice_names = record_names(medium, root, client)
    assert alice_names and run_a.wave_hits("") == 0
    planted: list[object] = []

    def plant(i: int, pair: KVTierPair) -> None:  # copy alice's records under each of bob's names
        mine = sorted(record_names(medium, root, client) - alice_names, key=str)
        theirs = sorted(alice_names, key=str)
        for j, name in enumerate(mine):
            write(medium, client, name, read(medium, client, theirs[j % len(theirs)]))
            planted.append(name)

    run_b = run_faulted(bob, [STORE, REPEAT], between_waves=lambda i, pair: plant(i, pair) if i == 0 else None)
    assert_identical(run_b, [STORE, REPEAT])
    assert_clean(run_b)
    assert run_b.wave_hits("w0-") == 0  # alice's KV for the very same prompts: invisible to bob
    assert planted and run_b.tier_stats(medium).corrupt > 0  # the copies were refused, not loaded
    assert run_b.load_failures() > 0
    run_a2 = run_faulted(alice, [REPEAT])
    assert_identical(run_a2, [REPEAT])
    assert run_a2.wave_hits("w3-a") > 0 and run_a2.load_failures() == 0  # alice's own records intact


# ---- HMAC signing ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("writer_key", [None, KEY2], ids=["unsigned", "wrong_key"])
@pytest.mark.parametrize("medium", ["disk", "redis"])
def test_records_not_signed_with_our_key_are_refused(medium: str, writer_key: str | None, tmp_path: Path,
                                                     redis_server: RedisServer, client: redis.Redis,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shared"
    monkeypatch.setenv("KVTIER_TEST_WRITER_KEY", writer_key or "")
    monkeypatch.setenv("KVTIER_TEST_HMAC", KEY1)
    writer = make_config([shared_tier(medium, root, redis_server)],
                         hmac_env="KVTIER_TEST_WRITER_KEY" if writer_key else None)
    reader = make_config([shared_tier(medium, root, redis_server)], hmac_env="KVTIER_TEST_HMAC")
    run_faulted(writer, [STORE])
    planted = record_names(medium, root, client)
    run = run_faulted(reader, [REPEAT])
    assert_identical(run, [REPEAT])
    assert_clean(run)
    assert planted and run.tier_stats(medium).corrupt > 0 and run.load_failures() > 0
    assert run.wave_hits("w3-") == 0  # nothing of the writer's was used


@pytest.mark.parametrize("medium", ["disk", "redis"])
def test_records_signed_with_our_key_load(medium: str, tmp_path: Path, redis_server: RedisServer,
                                          client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_HMAC", KEY1)
    cfg = make_config([shared_tier(medium, tmp_path / "shared", redis_server)], hmac_env="KVTIER_TEST_HMAC")
    run_faulted(cfg, [STORE])
    run = run_faulted(cfg, [REPEAT])
    assert_identical(run, [REPEAT])
    assert run.wave_hits("w3-a") > 0 and run.tier_stats(medium).corrupt == 0


def test_hmac_key_errors_name_the_setting_not_the_key() -> None:
    sec = SecurityConfig(hmac_key_env="KV_SIGNING_KEY")
    assert load_hmac_key(SecurityConfig(), env={}) is None
    assert load_hmac_key(sec, env={"KV_SIGNING_KEY": KEY1}) == KEY1.encode()
    with pytest.raises(ConfigError, match=r"security\.hmac_key_env: names \$KV_SIGNING_KEY, which is not set"):
        load_hmac_key(sec, env={})
    short = "x" * (MIN_KEY_BYTES - 1)
    with pytest.raises(ConfigError, match=f"holds {MIN_KEY_BYTES - 1} bytes") as err:
        load_hmac_key(sec, env={"KV_SIGNING_KEY": short})
    assert short not in str(err.value)


def test_engine_refuses_to_start_without_its_signing_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_TEST_HMAC", raising=False)
    cfg = make_config([tier_section("disk", root=tmp_path / "d")], hmac_env="KVTIER_TEST_HMAC")
    with pytest.raises(ConfigError, match="hmac_key_env"):
        KVTierPair(cfg)


# ---- file modes ------------------------------------------------------------------------------------------

def test_disk_directories_0700_and_files_0600_under_a_permissive_umask(tmp_path: Path) -> None:
    root = tmp_path / "cache" / "kvtier"
    old = os.umask(0)
    try:
        run = run_faulted(make_config([tier_section("disk", root=root)]), [STORE])
    finally:
        os.umask(old)
    assert record_files(root) and run.tier_stats("disk").puts > 0
    dirs = [root, *[p for p in root.rglob("*") if p.is_dir()]]
    assert {stat.S_IMODE(p.stat().st_mode) for p in dirs} == {0o700}
    assert {stat.S_IMODE(p.stat().st_mode) for p in record_files(root)} == {0o600}


# ---- credentials -----------------------------------------------------------------------------------------

def chain_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("where", ["url", "env"])
def test_redis_password_never_logged_across_an_outage(where: str, redis_factory: Callable[..., RedisServer],
                                                      caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    server = redis_factory(password=SECRET)
    url = server.url.replace("redis://", f"redis://:{SECRET}@") if where == "url" else server.url
    if where == "env":
        monkeypatch.setenv("KVTIER_REDIS_PASSWORD", SECRET)
    cfg = make_config([tier_section("redis", url=url, timeout="200ms", connect_timeout="200ms")])
    caplog.set_level(logging.DEBUG)
    actions = {0: server.kill, 1: server.start}
    run = run_faulted(cfg, fault_waves(), between_waves=lambda i, pair: actions.get(i, lambda: None)())
    assert run.tier_stats("redis").puts > 0 and run.tier_stats("redis").errors + run.tier_stats("redis").timeouts > 0
    assert "redis" in caplog.text.lower() and SECRET not in caplog.text


@pytest.mark.parametrize("where", ["url", "env"])
def test_wrong_redis_password_fails_clearly_without_the_password(where: str, redis_factory: Callable[..., RedisServer],
                                                                 caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    server = redis_factory(password=SECRET)
    wrong = "Wr0ng-" + SECRET
    url = server.url.replace("redis://", f"redis://:{wrong}@") if where == "url" else server.url
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", wrong)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(TierUnavailable, match="authentication failed") as err:
        Engine(EngineArgs(), KVTierPair(make_config([tier_section("redis", url=url)])))  # opens the store
    assert wrong not in chain_text(err.value) and wrong not in caplog.text


def run_check(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("kvtier", path=str(Path(sys.executable).parent)) or "kvtier"
    return subprocess.run([exe, "check", *args], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.parametrize("url", ["redis://:{pw}@127.0.0.1:6390/0", "redis://admin:{pw}@127.0.0.1:notaport/0",
                                 "redis://:{pw}@127.0.0.1:1/x", "http://:{pw}@h:1", "redis://:{pw}@a:1,b:2/0"])
def test_kvtier_check_never_prints_the_password(url: str, tmp_path: Path) -> None:
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"tiers:\n  - {{name: r, kind: redis, capacity: 1GiB, url: '{url.format(pw=SECRET)}'}}\n")
    env = {"KVTIER_REDIS_PASSWORD": SECRET}
    for extra in ((), ("--json",)):
        proc = run_check(str(cfg), *extra, env=env)
        assert proc.returncode in (0, 2)
        assert SECRET not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    env_url = {"KVTIER_TIERS__R__URL": url.format(pw=SECRET)}
    proc = run_check(str(cfg), env=env_url)
    assert SECRET not in proc.stdout + proc.stderr
