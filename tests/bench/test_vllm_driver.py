"""The one vLLM driver's handle on an engine process (kvtier.bench.vllm_driver.Engine) and how ``kvtier bench vllm``
reports an engine that failed (kvtier.bench.vllm_engine): without vLLM, on stand-in processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import vllm_driver
from kvtier.bench.vllm_engine import _error_line


def _engine(tmp_path: Path, code: str) -> vllm_driver.Engine:
    """An ``Engine`` whose process runs ``code`` instead of vLLM."""
    engine = object.__new__(vllm_driver.Engine)
    engine.mode, engine.pid = "stand-in", 0
    engine.log_path = tmp_path / "engine.log"
    engine.log_path.write_text("Traceback (most recent call last):\nRuntimeError: the engine's own words\n")
    engine.log = open(engine.log_path, "a")
    engine.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
    return engine


def test_an_engine_that_never_answers_is_killed_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_driver, "ANSWER_S", 0.5)
    engine = _engine(tmp_path, "import time; print('starting', flush=True); time.sleep(60)")
    try:
        with pytest.raises(RuntimeError, match=r"exited \(-9, killed: no answer in 0 s\)") as caught:
            engine.answer()
        assert _error_line(str(caught.value)) == "engine stand-in exited (-9, killed: no answer in 0 s):"
    finally:
        engine.close()


def test_an_answer_is_the_next_json_line_and_a_process_that_exits_says_so(tmp_path: Path) -> None:
    engine = _engine(tmp_path, "print('a log line'); print('{\"ready\": true, \"pid\": 7}', flush=True)")
    try:
        assert engine.answer() == {"ready": True, "pid": 7}
        with pytest.raises(RuntimeError, match=r"engine stand-in exited \(0\)") as caught:
            engine.send({"flush": True})  # it has exited: the message is lost, the answer says so
        assert _error_line(str(caught.value)) == "RuntimeError: the engine's own words"
    finally:
        engine.close()


@pytest.mark.parametrize(("tail", "line"), [
    ("[rank0]:   File \"spec.py\"\n[rank0]: Exception: CPU Offloading is only on GPUs\n"
     "Exception ignored in: <object>\n", "Exception: CPU Offloading is only on GPUs"),
    ("engine x exited (1):\nvllm.SomeError: bad config\nwarning after it", "vllm.SomeError: bad config"),
    ("engine x exited (-9, killed: no answer in 1800 s):\nRuntimeError: an older error in its log",
     "engine x exited (-9, killed: no answer in 1800 s):"),
    ("engine x exited (1):\nTraceback\nAssertionError\n", "AssertionError"),
    ("engine x exited (1):\nno error named", "engine x exited (1):"),
])
def test_a_failed_engine_is_reported_by_the_line_naming_its_error(tail: str, line: str) -> None:
    assert _error_line(tail) == line
