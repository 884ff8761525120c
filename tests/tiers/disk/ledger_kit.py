"""Helpers of the shared-directory ledger tests: disk tiers in processes of their own (``ledger_child.py``), and
what the directory holds."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvtier.config import DiskTierConfig
from kvtier.records.codec import HEADER_SIZE
from kvtier.records.keys import Namespace
from kvtier.tiers.disk.ledger import LEDGER_NAME
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.manifest import manifest_of

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
RECORD = HEADER_SIZE + 4096  # the file of one record of rand((1024,)) float32


class Child:
    """A disk tier in another process (``ledger_child.py``): its namespace digest (hex) and pid once started."""

    def __init__(self, root: Path, model: str, capacity: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "ledger_child.py"), str(root), model, str(capacity)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.digest = ""
        self.pid = 0

    def started(self) -> Child:
        hello = self.reply()
        self.digest, self.pid = hello["digest"], hello["pid"]
        return self

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def reply(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the child exited ({self.proc.poll()})"
        return json.loads(line)

    def ask(self, line: str) -> Any:
        self.send(line)
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("close")
        assert self.proc.wait(timeout=20) in (0, -9)


def records(root: Path) -> dict[str, set[str]]:
    """Record files per namespace hex, by key hex."""
    out: dict[str, set[str]] = {}
    for f in root.rglob("*.kvt"):
        out.setdefault(f.relative_to(root).parts[0], set()).add(f.name[:-4])
    return out


def disk_bytes(root: Path) -> dict[str, int]:
    """Bytes of the record files per namespace hex."""
    out: dict[str, int] = {}
    for f in root.rglob("*.kvt"):
        try:
            size = f.stat().st_size
        except FileNotFoundError:  # deleted while listed
            continue
        space = f.relative_to(root).parts[0]
        out[space] = out.get(space, 0) + size
    return out


def ledger(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / LEDGER_NAME).read_bytes())
    return data


def key_of(digest: bytes, i: int) -> bytes:
    return digest + hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


async def described_tier(root: Path, model: str, capacity: int) -> tuple[DiskTier, bytes]:
    """A started tier of this process serving ``model``'s namespace, and that namespace's digest."""
    ns = Namespace(model=model, group={"kind": "full_attention"}, layer_names=("l0", "l1"))
    digest = ns.digest()
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=str(root)))
    await tier.describe({digest: manifest_of(ns, digest)})
    await tier.start()
    return tier, digest
