"""Imported at start-up by every Python process of an end-to-end engine (``tests/e2e`` is on their PYTHONPATH):
with ``KVTIER_E2E_COUNTS`` set to a file, vLLM's ``Scheduler.schedule`` appends to it, per step, how many tokens
it scheduled for each request, and for each new request the hash of its prompt. That is the engine's own count of
the tokens it computes: a prompt whose prefix really came from kvtier computes only the rest; a hit that was
recomputed computes the whole prompt (or more). It also works in the engine-core and API-server processes.
With ``KVTIER_E2E_DISK_DELAY_S`` set, every kvtier disk put waits that long first: a disk slower than the
engine's last steps (its writes land when the engine is idle).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any

TARGET = "vllm.v1.core.sched.scheduler"
DISK = "kvtier.tiers.disk.tier"


def prompt_hash(tokens: Any) -> str:
    return hashlib.sha1(json.dumps([int(t) for t in tokens]).encode()).hexdigest()


def _patch(scheduler_cls: Any, path: str) -> None:
    original = scheduler_cls.schedule

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        pid = os.getpid()
        rows = [{"new": r.req_id, "prompt": prompt_hash(r.prompt_token_ids or []), "pid": pid}
                for r in out.scheduled_new_reqs]
        if out.num_scheduled_tokens:
            rows.append({"step": dict(out.num_scheduled_tokens), "pid": pid})
        if rows:
            with open(path, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows))
        return out

    scheduler_cls.schedule = schedule


def _slow_puts(disk_cls: Any, delay_s: float) -> None:
    original = disk_cls.put

    async def put(self: Any, items: Any) -> Any:
        await asyncio.sleep(delay_s)
        return await original(self, items)

    disk_cls.put = put


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[Any], None]) -> None:
        self.target = target
        self.patch = patch

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None:
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            self.patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("KVTIER_E2E_COUNTS"):
    counts = os.environ["KVTIER_E2E_COUNTS"]
    sys.meta_path.insert(0, _Hook(TARGET, lambda module: _patch(module.Scheduler, counts)))
if os.environ.get("KVTIER_E2E_DISK_DELAY_S"):
    delay = float(os.environ["KVTIER_E2E_DISK_DELAY_S"])
    sys.meta_path.insert(0, _Hook(DISK, lambda module: _slow_puts(module.DiskTier, delay)))
