"""``kvtier demo --engine vllm`` without starting vLLM (tests/e2e/test_vllm_demo_e2e.py runs it whole): the
servers it starts are the one docs/vllm.md shows, the engine is sized so that vLLM evicts and still starts, the
chats are fixed by the seed, the exit code needs the same replies and a hit from disk, and where vLLM cannot
serve it says so in one line."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import KvtierError
from kvtier.ops import demo, demo_vllm
from kvtier.ops.demo_vllm import Answer, Run

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(["--engine", "vllm", *argv])


def _docs_command() -> list[str]:
    page = (ROOT / "docs" / "vllm.md").read_text()
    section = page.split("\n## Trying it on a CPU\n", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```$", section, re.S | re.M) if "api_server" in b)
    return shlex.split(block.replace("\\\n", " "))


def test_the_server_docs_show_is_the_one_the_demo_starts(tmp_path: Path) -> None:
    words = _docs_command()
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    cmd = words[len(env):]
    assert cmd[0] == ".venv-e2e/bin/python" and env.items() <= demo_vllm.SERVER_ENV.items()
    _, kvtier, again = demo_vllm.specs("MODEL", tmp_path, Path("DIR/kvtier.yaml"), 12, 320, 8)
    started = kvtier.command()[1:]
    flags = {w: cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else None
             for i, w in enumerate(cmd) if w.startswith("--")}
    for flag, value in flags.items():
        assert flag in started, flag
        if value is not None and flag != "--kv-transfer-config":
            assert started[started.index(flag) + 1] == value, flag
    docs_transfer = json.loads(flags["--kv-transfer-config"] or "")
    assert json.loads(started[started.index("--kv-transfer-config") + 1]) == docs_transfer
    port = started.index("--port") + 1
    restarted = again.command()[1:]
    assert restarted[:port] + restarted[port + 1:] == started[:port] + started[port + 1:]  # the same but its port


def test_each_server_takes_a_port_free_when_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The specs are built before the first server starts; a port free then may be taken minutes later."""
    spec = demo_vllm.specs("MODEL", tmp_path, Path("DIR/kvtier.yaml"), 12, 320, 8)[2]
    started: list[int] = []

    def running(spec: Any, log: Path, timeout_s: float) -> Any:
        started.append(spec.port)
        raise RuntimeError("not started")

    monkeypatch.setattr(demo_vllm, "running", running)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", spec.port))  # another process took it meanwhile
        with pytest.raises(KvtierError):
            demo_vllm.one_run("t", spec, tmp_path / "log", "system", [["hi"]], 1)
    assert started and started[0] != spec.port


@pytest.mark.parametrize(("users", "turns"), [(8, 4), (1, 1), (3, 6)])
def test_the_engine_evicts_yet_fits_its_longest_prompt(users: int, turns: int) -> None:
    args = _args("--users", str(users), "--turns", str(turns))
    blocks, max_len = demo_vllm.engine_size(args)
    longest = args.system_tokens + turns * (demo_vllm.MESSAGE_WORDS + args.max_tokens)
    assert max_len % demo_vllm.BLOCK == 0 and max_len >= longest
    assert blocks >= max_len // demo_vllm.BLOCK + 1  # vLLM refuses a max_model_len its blocks cannot hold
    if users > 1:
        assert blocks < users * max_len // demo_vllm.BLOCK  # less than the chats hold: vLLM evicts


def test_the_chats_are_fixed_by_the_seed() -> None:
    from kvtier.ops.models import tokenizer_words

    words = tokenizer_words()
    first, again, other = (demo_vllm.chats(_args("--seed", s), words) for s in ("3", "3", "4"))
    assert first == again and first != other
    system, messages = first
    assert len(system.split()) == 160 and len(messages) == 8 and {len(m) for m in messages} == {4}
    assert set(system.split()) <= set(words)


def _run(title: str, replies: list[str], tiers: dict[str, float]) -> Run:
    answers = [Answer(0, turn, 0.1 * (turn + 1), text) for turn, text in enumerate(replies)]
    kv = sum(tiers.values())
    return Run(title, answers, {"local_compute": 100 - kv, "local_cache_hit": 50, "external_kv_transfer": kv}, tiers)


def _config() -> demo.KvtierConfig:
    return demo.load_config(None, env={})


def test_the_exit_code_needs_the_same_replies_and_a_hit_from_disk(capsys: pytest.CaptureFixture[str]) -> None:
    good = [_run("vLLM alone", ["a", "b"], {}), _run("vLLM + kvtier", ["a", "b"], {"cpu": 32.0}),
            _run("vLLM + kvtier, restarted", ["a", "b"], {"cpu": 32.0, "disk": 64.0})]
    assert demo_vllm.report(good, _config()) == 0
    out = capsys.readouterr().out
    assert "prompt tokens vLLM computed: 100 alone, 68 with kvtier (-32%), 4 with kvtier restarted (-96%; 64 " \
           "loaded from disk)" in out
    assert "replies identical in the three runs: yes" in out
    differs = [*good[:2], _run("vLLM + kvtier, restarted", ["a", "c"], {"disk": 64.0})]
    assert demo_vllm.report(differs, _config()) == 1
    assert "replies identical in the three runs: NO" in capsys.readouterr().out
    no_disk = [*good[:2], _run("vLLM + kvtier, restarted", ["a", "b"], {"cpu": 96.0})]
    assert demo_vllm.report(no_disk, _config()) == 1
    assert "0 prompt tokens loaded from disk (NONE" in capsys.readouterr().out


def test_a_server_that_does_not_start_is_named_by_its_own_error(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=7) ERROR 12-05 11:51:45 [core.py:1510] ValueError: To serve at least one "
                   "request with the model's max seq len (352)\nTraceback\n"
                   "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert demo_vllm._cause(log) == "ValueError: To serve at least one request with the model's max seq len (352)"
    assert demo_vllm._cause(tmp_path / "absent.log") == ""


def test_where_vllm_cannot_serve_the_demo_says_so_in_one_line(tmp_path: Path) -> None:
    """This venv's vLLM is not the CPU build and there is no GPU (or there is no vLLM at all): exit 2, one line
    naming .venv-e2e, and nothing started."""
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--engine", "vllm", "--no-progress",
                           "--persist", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("kvtier: error: ") and ".venv-e2e/bin/kvtier" in line
    assert not (tmp_path / "model").exists()


def test_a_config_without_a_disk_tier_is_refused_before_any_server_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "cpu.yaml"
    config.write_text("tiers: [{name: cpu, kind: cpu, capacity: 16MiB}]\n")
    assert demo.run(_args("--config", str(config), "--no-progress")) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: tiers: the vLLM demo restarts the server and loads from disk") and \
        len(err.splitlines()) == 1


def test_a_chunk_size_the_servers_cannot_use_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.run(_args("--chunk-size", "48", "--no-progress")) == 2
    assert "--chunk-size: 48 is not a multiple of the vLLM demo's block size (32 tokens)" in capsys.readouterr().err
