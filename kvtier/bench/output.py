"""Where benchmark results go, and how they are written: one place for every benchmark.

A run writes ``<name>.json`` (``<name>-quick.json`` with ``--quick``) into ``--out DIR`` (default
``./benchmarks/results``, relative to the current directory, where the published full runs live; a ``--quick``
smoke run goes to ``./kvtier-results`` instead, so that it never lands among them), or to ``--json FILE``; its
chart, where it draws one, goes beside the JSON (``--png`` overrides, ``--no-plot`` skips it). The JSON is always
written, chart or not, and the run ends with one line naming the files: ``results: /abs/dir/name.json, name.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError

RESULTS_DIR = Path("benchmarks") / "results"
QUICK_DIR = Path("kvtier-results")  # --quick without --out: not among the published results


def add_output_arguments(parser: argparse.ArgumentParser, name: str, chart: bool = True) -> None:
    """The options ``--out``, ``--json`` and, for a benchmark that draws a chart, ``--png`` and ``--no-plot``."""
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"directory for the result files (default ./{RESULTS_DIR}; ./{QUICK_DIR} with "
                             f"--quick)")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help=f"result file (default DIR/{name}.json, {name}-quick.json with --quick)")
    if chart:
        parser.add_argument("--png", type=Path, metavar="FILE", help="chart file (default beside the JSON)")
        parser.add_argument("--no-plot", action="store_true", help="write no chart")


def json_path(args: Any, benchmark: str) -> Path:
    """The result file of this run: ``--json``, else ``--out``/<benchmark>[-quick].json."""
    explicit = getattr(args, "json", None)
    if explicit:
        return Path(explicit)
    name = f"{benchmark}-quick" if getattr(args, "quick", False) else benchmark
    return results_dir(args) / f"{name}.json"


def results_dir(args: Any) -> Path:
    """``--out``, else ./kvtier-results for a ``--quick`` run, else ./benchmarks/results."""
    out = getattr(args, "out", None)
    return Path(out) if out else QUICK_DIR if getattr(args, "quick", False) else RESULTS_DIR


def check_writable(args: Any) -> None:
    """Fail before any work when the results cannot be written where the options say (``KvtierError``)."""
    targets = [Path(p).parent for p in (getattr(args, "json", None), getattr(args, "png", None)) if p]
    if not getattr(args, "json", None):
        targets.append(results_dir(args))
    for target in targets:
        _check_directory(target.absolute())


def _check_directory(path: Path) -> None:
    """Create ``path`` and write a file there (the only test that holds for root and odd file systems too)."""
    if path.exists() and not path.is_dir():
        raise KvtierError(f"cannot write results to {path}: it is a file, not a directory (pass --out DIR)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise KvtierError(f"cannot write results to {path}: {exc.strerror or exc} (pass --out DIR)") from None


def machine_info() -> dict[str, Any]:
    """Where a result was measured: CPU, cores, memory, and torch and its device where torch is installed."""
    mem_total = 0
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            mem_total = int(f.readline().split()[1]) * 1024
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu": cpu, "cores": os.cpu_count(),
                            "memory_bytes": mem_total, "torch": None, "cuda": None}
    with contextlib.suppress(ImportError):
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    info["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return info


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON (creating the directory); return the path."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    except OSError as exc:
        raise KvtierError(f"cannot write results to {out}: {exc.strerror or exc} (pass --out DIR)") from None
    return out


def save_results(args: Any, benchmark: str, body: Mapping[str, Any],
                 plot: Callable[[Path], Path | None] | None = None) -> Path:
    """Write a benchmark's JSON with the machine description, then its chart unless ``--no-plot``; print one
    ``results:`` line naming both. Return the JSON's path."""
    quick = bool(getattr(args, "quick", False))
    path = write_json(json_path(args, benchmark),
                      {"benchmark": benchmark, "quick": quick, "machine": machine_info(), **body})
    files = [str(path.absolute())]
    note = ""
    if plot is not None and not getattr(args, "no_plot", False):
        png, note = _draw(plot, Path(getattr(args, "png", None) or path.with_suffix(".png")))
        if png is not None:
            files.append(png.name if png.absolute().parent == path.absolute().parent else str(png.absolute()))
    print(f"results: {', '.join(files)}{note}", flush=True)
    return path


class NoMatplotlib(ImportError):
    """matplotlib cannot be imported: the results stand without their chart."""


@contextlib.contextmanager
def figure(path: Path, rows: int = 1, cols: int = 1, dpi: int = 110, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure (Agg backend) and its axes for the chart at ``path``: laid out, saved and closed when the
    block ends (closed too when it fails). ``NoMatplotlib`` without matplotlib, which ``save_results`` notes."""
    try:
        import matplotlib
    except ImportError as exc:
        raise NoMatplotlib(str(exc)) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def _draw(plot: Callable[[Path], Path | None], png: Path) -> tuple[Path | None, str]:
    """Draw the chart; on failure the JSON stands alone and the note says why."""
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        drawn = plot(png)
    except NoMatplotlib:
        drawn = None
    except Exception as exc:  # a chart is optional: its failure must not lose the measurements
        print(f"kvtier: warning: no chart ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None, " (no chart: drawing it failed)"
    if drawn is None:
        return None, " (no chart: matplotlib is not installed; pip install 'kvtier[plots]')"
    return drawn, ""
