"""``kvtier bench copy``: the scatter of a hit into page layers beside a plain copy of the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtier.bench.copy import ORDERS, block_orders


def test_block_orders_are_distinct_real_blocks_of_the_layer() -> None:
    orders = block_orders(chunks=6, bpc=2, num_blocks=30)
    assert orders["ascending"][:2] == [[1, 2], [3, 4]]
    assert orders["descending"][:2] == [[29, 28], [27, 26]]
    for ids in orders.values():
        flat = [b for chunk in ids for b in chunk]
        assert len(flat) == len(set(flat)) == 12 and all(0 < b < 30 for b in flat)


def test_quick_run_saves_every_order_beside_the_plain_copy(tmp_path: Path) -> None:
    out = tmp_path / "copy.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.copy", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "plain_copy" in proc.stdout and "results:" in proc.stdout
    body = json.loads(out.read_text())
    results = body["results"]
    assert results["bytes"] == 4 * 2 * 2 * (16 << 10)  # chunks x layers x blocks x page
    for name in ("plain_copy", *ORDERS):
        assert results[name]["seconds"]["n"] == 3 and results[name]["gb_per_s"] > 0
    assert results["plain_copy"]["speed_vs_plain_copy"] == 1.0


def test_bad_option_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.copy", "--chunks", "0", "--json",
                           str(tmp_path / "c.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2


def test_quick_run_of_the_kv_first_layout_checks_and_saves_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "copy_kv_first.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.copy", "--quick", "--layout", "kv_first", "--json",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(out.read_text())
    assert body["settings"]["layout"] == "kv_first" and "(kv_first)" in proc.stdout
    assert all(body["results"][name]["gb_per_s"] > 0 for name in ORDERS)
