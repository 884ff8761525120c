"""Start-up cost of tying records to the weights: ``kvtier bench fingerprint``.

kvtier fingerprints the model's weights once per engine process at start (``namespace.weights``, see
:mod:`kvtier.records.fingerprint`). This benchmark times each mode on a checkpoint (one made here of ``--gib`` GiB of
random bytes in ``--shards`` safetensors-named files, or ``--model DIR``): ``stat`` (a stat per file), and
``content`` (a hash of every byte) with the files in the page cache (warm) and evicted from it first with
``posix_fadvise(DONTNEED)`` (cold: the disk's read speed). It prints and saves each time beside the limit it is
measured against, reading the files with no hash at all (``raw read``), and extrapolates to a 16 GB checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.measure import Spread, drop_page_cache, save_results
from kvtier.bench.output import add_output_arguments
from kvtier.errors import KvtierError
from kvtier.ops.argtypes import existing_path, positive_float, positive_int
from kvtier.records.fingerprint import READ_BYTES, weight_files, weights_id

TARGET_BYTES = 16 * 10**9


def make_checkpoint(root: Path, total: int, shards: int) -> Path:
    """``shards`` files of random bytes adding up to ``total`` bytes."""
    root.mkdir(parents=True, exist_ok=True)
    size = total // shards
    for i in range(shards):
        with open(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = size
            while left:
                n = min(left, 64 << 20)
                f.write(os.urandom(n))
                left -= n
    return root


def raw_read(files: list[str]) -> None:
    buffer = bytearray(READ_BYTES)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _spread(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> Spread:
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Spread.of(samples)


def measure(model: str, repeats: int) -> dict[str, Any]:
    files = weight_files(model)
    if not files or not sum(os.path.getsize(f) for f in files):
        raise KvtierError(f"no weights to read in {model} (pass --model with a checkpoint directory)")
    total = sum(os.path.getsize(f) for f in files)
    runs: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
        "stat": (lambda: weights_id(model, mode="stat"), None),
        "content_warm": (lambda: weights_id(model, mode="content"), lambda: raw_read(files)),
        "raw_read_warm": (lambda: raw_read(files), lambda: raw_read(files)),
        "content_cold": (lambda: weights_id(model, mode="content"), lambda: drop_page_cache(files)),
        "raw_read_cold": (lambda: raw_read(files), lambda: drop_page_cache(files)),
    }
    out: dict[str, Any] = {"files": len(files), "bytes": total, "seconds": {}, "gb_per_s": {},
                           "seconds_at_16gb": {}}
    for name, (fn, before) in runs.items():
        spread = _spread(fn, repeats, before)
        out["seconds"][name] = vars(spread)
        if name != "stat":
            rate = total / spread.median
            out["gb_per_s"][name] = rate / 1e9
            out["seconds_at_16gb"][name] = TARGET_BYTES / rate
        else:
            out["seconds_at_16gb"][name] = spread.median  # per file, not per byte: the same few files
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['files']} files, {result['bytes'] / 1e9:.2f} GB",
             f"{'mode':<14} {'median s':>10} {'GB/s':>7} {'s at 16 GB':>11}"]
    for name, spread in result["seconds"].items():
        rate = result["gb_per_s"].get(name)
        lines.append(f"{name:<14} {spread['median']:>10.4f} {(f'{rate:.2f}' if rate else '-'):>7} "
                     f"{result['seconds_at_16gb'][name]:>11.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=existing_path,
                        help="a checkpoint directory (or weights file) to measure (default: one made here)")
    parser.add_argument("--gib", type=positive_float, default=2.0, help="size of the checkpoint made here (GiB)")
    parser.add_argument("--shards", type=positive_int, default=4, help="files of the checkpoint made here")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs of each mode")
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 repeats (results *-quick)")
    add_output_arguments(parser, "fingerprint", chart=False)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.gib, args.repeats = 1 / 32, 2
    with tempfile.TemporaryDirectory(prefix="kvtier-fp-", dir=os.environ.get("KVTIER_BENCH_DIR")) as tmp:
        model = args.model or str(make_checkpoint(Path(tmp) / "ckpt", int(args.gib * (1 << 30)), args.shards))
        result = measure(model, args.repeats)
    print(table(result))
    save_results(args, "fingerprint", {"settings": {"model": args.model, "gib": args.gib, "shards": args.shards,
                                                    "repeats": args.repeats}, "result": result})
    return 0
