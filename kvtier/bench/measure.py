"""Shared measuring helpers for the bandwidth, overhead and TTFT benchmarks.

Measuring honestly on a shared, noisy VM (one that hands freed memory back to its host and then refaults it
at a fraction of memory speed):

* buffers are allocated once and pre-touched (:func:`pretouch`), then reused by every repeat;
* the runs being compared are interleaved, A B A B ... (:func:`interleave`), so drift hits both alike;
* every figure is a :class:`Spread` (median, quartiles, min, max over the repeats), and a ratio is taken
  between figures of the same run (:func:`paired_ratio`);
* cold file reads drop the page cache of exactly the files read (:func:`drop_page_cache`).
* no case inherits another's worker threads: ``kvtier bench throughput`` shuts each case's event loop and its
  executor down before the next (a live executor thread that ran torch ops keeps an OpenMP team, and
  OpenMP then stops spin-waiting when threads outnumber cores, slowing every later small parallel op).

Where results go and how they are written (with the machine they were measured on): kvtier.bench.output,
re-exported here. (A throw-away redis-server: kvtier.bench.redis_servers.)
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvtier.bench.output import RESULTS_DIR, machine_info, save_results, write_json

__all__ = ["RESULTS_DIR", "Spread", "chunk_views", "copy_all", "drop_page_cache", "format_size", "gbps",
           "interleave", "machine_info", "make_keys", "paired_ratio", "pretouch", "same_bytes", "save_results",
           "timed", "touched", "write_json"]

if TYPE_CHECKING:  # torch is imported where it is used: a benchmark's --help loads none of it
    import torch


@dataclass(frozen=True)
class Spread:
    """Summary of repeated samples: median, quartiles and extremes."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """Summarize ``samples`` (at least one)."""
        if not samples:
            raise ValueError("no samples")
        data = sorted(samples)
        if len(data) >= 2:
            q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
        else:
            q1 = q3 = data[0]
        return cls(statistics.median(data), q1, q3, data[0], data[-1], len(data))

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def default_device() -> str:
    """``cuda`` when a CUDA device is available, else ``cpu`` (imports torch)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def timed(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Wall seconds one call of ``fn`` takes (waiting for the device's queued work on CUDA)."""
    import torch

    t0 = time.perf_counter()
    fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def interleave(runs: Mapping[str, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call every run once per round, in order, ``warmup + repeats`` rounds (A B A B ...).

    Each run returns its own measurement (seconds, or anything else); warm-up rounds are discarded.
    """
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(warmup + repeats):
        for name, run in runs.items():
            value = run()
            if round_ >= warmup:
                samples[name].append(value)
    return samples


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Spread:
    """Spread of ``a[i] / b[i]`` over rounds measured side by side."""
    return Spread.of([x / y for x, y in zip(a, b, strict=True) if y > 0])


def pretouch(tensor: torch.Tensor) -> torch.Tensor:
    """Write every page of ``tensor`` once (so that timed copies do not pay first-touch page faults)."""
    tensor.fill_(1)
    return tensor


def touched(nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """A new ``uint8`` tensor of ``nbytes`` random bytes (every page written)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors hold identical bytes (NaN payloads compare equal, unlike ``torch.equal``)."""
    import torch

    return a.numel() * a.element_size() == b.numel() * b.element_size() and torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


def drop_page_cache(paths: Sequence[str | os.PathLike[str]]) -> None:
    """Flush and drop the page cache of these files (fsync, then ``POSIX_FADV_DONTNEED``)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def chunk_views(buf: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """Split a flat ``uint8`` buffer into contiguous bf16 chunk payloads."""
    import torch

    return [buf[i:i + chunk_bytes].view(torch.bfloat16) for i in range(0, buf.numel(), chunk_bytes)]


def make_keys(label: str, n: int) -> list[bytes]:
    """``n`` distinct 32-byte keys for one case."""
    return [hashlib.blake2b(f"{label}:{i}".encode(), digest_size=32).digest() for i in range(n)]


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """The raw limit of memory tiers: one plain ``copy_`` per chunk."""
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s)


def format_size(nbytes: int) -> str:
    """``33554432`` -> ``32MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"
