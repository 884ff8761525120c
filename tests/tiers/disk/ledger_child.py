"""A disk tier in a process of its own, driven by lines on stdin (the shared-directory ledger tests).

``python ledger_child.py ROOT MODEL CAPACITY`` starts a tier for MODEL's namespace and prints
``{"digest": ..., "pid": ...}``; then per line: ``put START STOP BATCH`` writes keys START..STOP-1 in batches
of BATCH and prints which were written (a JSON list); ``delete START STOP STEP`` deletes every STEP-th of those
keys and prints how many existed; ``arm N LOG``: at the N-th step of a ledger transaction's file changes
(``kvtier.tiers.disk.ledger.step``) write the step's name into LOG and SIGKILL this process; ``kill``: SIGKILL
now; ``close``: close the tier and exit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/tiers: contract

from contract import rand

from kvtier.config import DiskTierConfig
from kvtier.records.keys import Namespace
from kvtier.tiers.disk import ledger
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.manifest import manifest_of


def key_of(digest: bytes, i: int) -> bytes:
    return digest + hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def arm(n: int, log: str) -> None:
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            with open(log, "w") as f:
                f.write(name)
            os.kill(os.getpid(), signal.SIGKILL)

    ledger.STEP_HOOK = hook


def say(value: object) -> None:
    print(json.dumps(value), flush=True)


async def main(root: str, model: str, capacity: int) -> None:
    ns = Namespace(model=model, group={"kind": "full_attention"}, layer_names=("l0", "l1"))
    digest = ns.digest()
    tier = DiskTier(DiskTierConfig(name="disk", capacity=capacity, path=root))
    await tier.describe({digest: manifest_of(ns, digest)})
    await tier.start()
    say({"digest": digest.hex(), "pid": os.getpid()})
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "put":
            start, stop, batch = map(int, args)
            written: list[bool] = []
            for at in range(start, stop, batch):
                items = [(key_of(digest, i), rand((1024,), seed=i)) for i in range(at, min(stop, at + batch))]
                written += await tier.put(items)
            say(written)
        elif cmd == "delete":
            start, stop, every = map(int, args)
            say(await tier.delete([key_of(digest, i) for i in range(start, stop, every)]))
        elif cmd == "arm":
            arm(int(args[0]), args[1])
        elif cmd == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif cmd == "close":
            break
    await tier.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
