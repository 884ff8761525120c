"""``kvtier bench fingerprint`` smoke run: every mode timed beside a plain read, on real files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.bench import fingerprint


def test_quick_run_times_each_mode_beside_a_plain_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f.json"
    parser = argparse.ArgumentParser()
    fingerprint.add_arguments(parser)
    assert fingerprint.run(parser.parse_args(["--quick", "--json", str(out)])) == 0
    data = json.loads(out.read_text())
    result = data["result"]
    assert data["benchmark"] == "fingerprint" and result["files"] == 4 and result["bytes"] == 4 * (8 << 20)
    modes = {"stat", "content_warm", "raw_read_warm", "content_cold", "raw_read_cold"}
    assert set(result["seconds"]) == modes and set(result["seconds_at_16gb"]) == modes
    assert all(v["median"] > 0 and v["n"] == 2 for v in result["seconds"].values())
    assert set(result["gb_per_s"]) == modes - {"stat"}
    assert "raw_read_cold" in capsys.readouterr().out
