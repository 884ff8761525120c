"""``kvtier demo --engine vllm`` as a newcomer runs it (README's first screen): vLLM's OpenAI server on the tiny
Llama the demo makes, with its tokenizer and text prompts, alone, with kvtier, and restarted on the same disk.

The servers' own counts show the hits, which no recompute gives: with kvtier vLLM computes fewer prompt tokens than
alone, and the restarted server fewer still, loading the rest from disk; kvtier's hit tokens by tier add up to
vLLM's ``external_kv_transfer`` count; every reply (float32, greedy) is the same in the three runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import engine_env

COMPUTED = re.compile(r"prompt tokens vLLM computed: (\d+) alone, (\d+) with kvtier \([^)]*\), (\d+) with kvtier "
                      r"restarted \([^;]*; (\d+) loaded from disk\)")
ROW = re.compile(r"^  (vLLM[^\d]+?)\s+(\d+)\s+(\d+)\s+(\d+)  (.*?)   \(", re.MULTILINE)


@pytest.mark.timeout(900)  # three servers start one after the other
def test_the_vllm_demo_hits_from_disk_after_a_restart_with_the_same_replies(workdir: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--engine", "vllm", "--users", "3", "--turns", "3",
                           "--no-progress", "--persist", str(workdir / "demo")],
                          env=engine_env(workdir), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out = proc.stdout
    assert "replies identical in the three runs: yes" in out
    found = COMPUTED.search(out)
    assert found, out
    alone, cached, restarted, from_disk = map(int, found.groups())
    assert alone > cached > restarted and from_disk > 0
    rows = {title.strip(): (int(kv), tiers) for title, _, _, kv, tiers in ROW.findall(out)}
    assert set(rows) == {"vLLM alone", "vLLM + kvtier", "vLLM + kvtier, restarted"}, out
    assert rows["vLLM alone"] == (0, "-")
    for kv, tiers in list(rows.values())[1:]:
        by_tier = {name: int(n) for name, n in (part.split() for part in tiers.split(", "))}
        assert kv > 0 and sum(by_tier.values()) == kv, (kv, tiers)
    assert dict(part.split() for part in rows["vLLM + kvtier, restarted"][1].split(", "))["disk"] == str(from_disk)
    model = workdir / "demo" / "model" / "llama"
    assert (model / "tokenizer.json").is_file() and list((workdir / "demo" / "disk").rglob("*.kvt"))
