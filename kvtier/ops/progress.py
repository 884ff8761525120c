"""Progress on stderr: a bar (tqdm's when tqdm is installed, the bench extra, else none at all) and one-line
notes before pauses that show no bar (imports of torch, building a model, allocating pools).

The demo and the benchmarks report progress through these functions only, so neither needs tqdm to run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Update = Callable[[int], None]  # update(n): n more items done


def note(message: str) -> None:
    """Print one progress line on stderr now (flushed: it announces a pause)."""
    print(message, file=sys.stderr, flush=True)


@contextmanager
def loading(prog: str, module: str, *, transient: bool = False) -> Iterator[None]:
    """Around an import of ``module`` (torch takes seconds): say ``prog: loading module...`` unless it is
    imported already. ``transient``: only on a terminal, and erased when done (before options are parsed,
    where a usage error must stay the only line)."""
    if module in sys.modules or (transient and not sys.stderr.isatty()):
        yield
        return
    message = f"{prog}: loading {module}..."
    print(message, end="\r" if transient else "\n", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        if transient:
            print(" " * len(message), end="\r", file=sys.stderr, flush=True)


@contextmanager
def progress_bar(total: int, *, desc: str = "", unit: str = "it", enabled: bool = True,
                 leave: bool = True) -> Iterator[Update]:
    """Yield update(n), which moves a bar of ``total`` items on stderr; a no-op when not ``enabled`` or
    without tqdm."""
    bar_class = _tqdm() if enabled else None
    if bar_class is None:
        yield _ignore
        return
    with bar_class(total=total, desc=desc, unit=unit, file=sys.stderr, leave=leave) as bar:

        def update(n: int) -> None:
            bar.update(n)

        yield update


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _ignore(n: int) -> None:
    del n
