"""Every benchmark's chart draws from the results the project ships (benchmarks/results/*.json): a change to a
chart, to ``output.figure`` or to a benchmark's JSON that no longer fit together fails here, not in the next
benchmark run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import hitrate_cli, serve_report, throughput, ttft, vllm_contention, vllm_engine, vllm_replay

pytest.importorskip("matplotlib")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

CHARTS: dict[str, Callable[[dict[str, Any], Path], Any]] = {
    "hit_rate_synthetic": hitrate_cli.plot,
    "hit_rate_mooncake": hitrate_cli.plot,
    "serve": serve_report.plot,
    "serve_admission": serve_report.plot,
    "throughput": lambda doc, path: throughput.plot(doc["results"], path, "throughput"),
    "ttft": lambda doc, path: ttft.plot(doc["results"], path, "ttft"),
    "vllm_contention": vllm_contention.plot,
    "vllm_engine": lambda doc, path: vllm_engine._plot(doc["results"], path),
    "vllm_engine_hybrid": lambda doc, path: vllm_engine._plot(doc["results"], path),
    "vllm_replay": lambda doc, path: vllm_replay._plot(doc["results"], doc["settings"], path),
    "vllm_replay_learned": lambda doc, path: vllm_replay._plot(doc["results"], doc["settings"], path),
    "vllm_replay_one_off": lambda doc, path: vllm_replay._plot(doc["results"], doc["settings"], path),
}


@pytest.mark.parametrize("name", sorted(CHARTS))
def test_each_chart_draws_from_its_saved_results(name: str, tmp_path: Path) -> None:
    doc = json.loads((RESULTS / f"{name}.json").read_text())
    png = tmp_path / "charts" / f"{name}.png"  # a folder that does not exist yet: the chart makes it
    assert CHARTS[name](doc, png) == png
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
