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

The machine description (:func:`machine_info`) and JSON writing (:func:`write_json`) are here too, so every
result file says where it was measured. (A throw-away ``redis-server``: ``kvtier.bench.redis_servers``.)
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path("benchmarks") / "results"


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


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def timed(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """Wall seconds one call of ``fn`` takes (waiting for the device's queued work on CUDA)."""
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
    gen = torch.Generator(device=device).manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two tensors hold identical bytes (NaN payloads compare equal, unlike ``torch.equal``)."""
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


def machine_info() -> dict[str, Any]:
    """Where a result was measured: CPU, cores, memory, torch, device."""
    mem_total = 0
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem_total, "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON (creating the directory); return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return out


def save_results(args: Any, benchmark: str, body: Mapping[str, Any],
                 plot: Callable[[Path], Path | None] | None = None) -> Path:
    """Write a benchmark's JSON (``args.json``, else ``benchmarks/results/<benchmark>[-quick].json``) with the
    machine description, then its PNG beside it (``args.png`` overrides) unless ``args.no_plot``; print both."""
    quick = bool(getattr(args, "quick", False))
    name = f"{benchmark}-quick" if quick else benchmark
    path = write_json(getattr(args, "json", None) or RESULTS_DIR / f"{name}.json",
                      {"benchmark": benchmark, "quick": quick, "machine": machine_info(), **body})
    print(f"wrote {path}")
    if plot is not None and not getattr(args, "no_plot", False):
        png = plot(Path(getattr(args, "png", None) or path.with_suffix(".png")))
        if png is not None:
            print(f"wrote {png}")
    return path


def format_size(nbytes: int) -> str:
    """``33554432`` -> ``32MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"
