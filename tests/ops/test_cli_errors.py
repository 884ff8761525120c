"""Bad input to the kvtier command: one line on stderr and an exit code that means what it says, never a
traceback. Process behaviour (signals, pipes, imports) runs python -m kvtier in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.ops import cli

ROOT = Path(__file__).resolve().parents[2]
MARKUP = re.compile(r"``|:(func|mod|data|class|meth|attr|exc):")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["KVTIER_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def kvtier(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, cwd=ROOT,
                          env=_env(tmp_path), timeout=120, check=False)


def start(*args: str, tmp_path: Path, importtime: bool = False) -> subprocess.Popen[str]:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.Popen([sys.executable, *flags, "-m", "kvtier", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(tmp_path))


# ---- numeric options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "expected"), [
    (["--turns", "-1"], "argument --turns: expected an integer >= 1, got '-1'"),
    (["--users", "0"], "argument --users: expected an integer >= 1, got '0'"),
    (["--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, got '0'"),
    (["--system-tokens", "-1"], "argument --system-tokens: expected an integer >= 0, got '-1'"),
    (["--chunk-size", "0"], "argument --chunk-size: expected an integer >= 1, got '0'"),
    (["--window", "-64"], "argument --window: expected an integer >= 0, got '-64'"),
    (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["--users", "two"], "argument --users: expected an integer >= 1, got 'two'"),
    (["--memory-capacity", "0"], "argument --memory-capacity: expected a size above 0"),
    (["--memory-capacity=-1MiB"], "argument --memory-capacity: expected a size above 0"),
])
def test_demo_rejects_a_bad_number_in_one_line(argv: list[str], expected: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [captured.err.strip()], captured.err  # one line
    assert captured.err.startswith(f"kvtier: error: {expected}")
    assert captured.err.rstrip().endswith("(see 'kvtier demo --help')") and captured.out == ""


def test_a_bad_number_in_a_process_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = kvtier("demo", "--turns", "-1", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ("kvtier: error: argument --turns: expected an integer >= 1, got '-1' "
                           "(see 'kvtier demo --help')\n")
    assert proc.stdout == ""


# ---- other usage errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "start_of_line"), [
    ([], "kvtier: error: no command given: use one of check, demo, bench"),
    (["frobnicate"], "kvtier: error: argument COMMAND: invalid choice: 'frobnicate'"),
    (["check", "--model-shape"], "kvtier: error: argument --model-shape: expected one argument (see 'kvtier check"),
    (["--log-level"], "kvtier: error: argument --log-level: expected one argument"),
])
def test_usage_errors_are_one_line(argv: list[str], start_of_line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(start_of_line), err


# ---- disk paths ---------------------------------------------------------------------------------------------

def test_demo_persist_under_a_file_is_one_line_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = kvtier("demo", "--persist", str(blocker / "cache"), "--no-progress", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr  # not 1: that means "outputs differ"
    assert proc.stderr == (f"kvtier: error: tiers[1].path: cannot create {blocker}/cache/disk: {blocker} is a "
                           "file, not a directory (give a writable directory with --persist DIR, or change the "
                           "config)\n")
    assert "prefill" not in proc.stdout  # stopped before the workload


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_demo_persist_where_nothing_can_be_created(tmp_path: Path) -> None:
    proc = kvtier("demo", "--persist", "/proc/kvtier-demo", "--no-progress", tmp_path=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: tiers[1].path: cannot write /proc/kvtier-demo/disk")
    assert "--persist DIR" in lines[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_demo_persist_in_a_read_only_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert cli.main(["demo", "--persist", str(locked), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier: error: tiers[1].path: cannot write {locked}/disk") and len(err.splitlines()) == 1


# ---- Ctrl-C -------------------------------------------------------------------------------------------------

def _assert_interrupted(proc: subprocess.Popen[str]) -> str:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.splitlines()[-1] == "kvtier: interrupted"
    return err


def test_ctrl_c_while_torch_is_imported(tmp_path: Path) -> None:
    proc = start("demo", "--no-progress", tmp_path=tmp_path, importtime=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # -X importtime: a line as each module finishes; torch's own come before torch
        if re.search(r"\|\s+torch\.", line):
            break
    proc.send_signal(signal.SIGINT)
    err = _assert_interrupted(proc)
    assert not re.search(r"\|\s+kvtier\.engine\.demo$", err, re.MULTILINE), "interrupted after the import"


def test_ctrl_c_while_the_demo_runs(tmp_path: Path) -> None:
    proc = start("demo", "--no-progress", "--turns", "8", tmp_path=tmp_path)
    assert proc.stdout is not None
    disk = ""
    for line in proc.stdout:
        if "disk tier" in line:
            disk = line.split(" at ")[1].split(" (")[0]
        if "overrides applied" in line:
            break
    time.sleep(1.0)  # in the first run, or opening the tiers
    proc.send_signal(signal.SIGINT)
    _assert_interrupted(proc)
    assert disk and not Path(disk).exists(), "the temporary disk tier was not removed"


# ---- closed pipes -------------------------------------------------------------------------------------------

def test_check_json_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    proc = start("check", "configs/default.yaml", "--json", tmp_path=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before kvtier writes (kvtier check --json | true)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == cli.EXIT_PIPE and err == ""


def test_demo_into_head_exits_quietly(tmp_path: Path) -> None:
    command = (f"set -o pipefail; {sys.executable} -m kvtier demo --no-progress --users 2 --turns 2 | head -1; "
               "echo \"rc=${PIPESTATUS[0]}\"")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path),
                          timeout=120, check=False)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("kvtier demo: 2 users x 2 turns") and lines[1:] == ["rc=141"], proc.stdout
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr and "Broken" not in proc.stderr


# ---- help -----------------------------------------------------------------------------------------------------

def test_help_and_version_import_no_torch() -> None:
    code = ("import sys, contextlib, io\n"
            "from kvtier.ops import cli\n"
            "for argv in (['--help'], ['--version']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        assert cli.main(argv) == 0\n"
            "    assert out.getvalue()\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('kvtier.engine'))\n"
            "print(heavy, out.getvalue().strip())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[] kvtier 0.1.0\n"


def test_help_lists_every_subcommand_and_marks_missing_ones(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", cli.Subcommand("kvtier.no_such_module", "a ghost"))
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()
            if line.startswith("    ") and len(line.split()) > 1}
    assert {"check", "demo", "bench", "stats", "inspect", "purge", "ghost"} <= set(rows)
    assert rows["ghost"] == "(not available)"
    assert rows["demo"].startswith("a multi-turn chat")


def test_module_exists_looks_without_importing() -> None:
    assert cli.module_exists("kvtier.ops.demo") and cli.module_exists("kvtier.ops.check")
    assert not cli.module_exists("kvtier.no_such_module") and not cli.module_exists("kvtier.ops.check.inner")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["check", "--help"], ["bench", "--help"]])
def test_help_has_no_docs_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "usage: kvtier" in out
    assert not MARKUP.search(out), MARKUP.search(out)


def test_plain_strips_rest_markup() -> None:
    text = "See :func:`progress_bar`, :py:class:`~kvtier.store.tiered.TieredStore` and ``KVTIER_*`` or `--json`."
    assert cli.plain(text) == "See progress_bar, kvtier.store.tiered.TieredStore and KVTIER_* or --json."
