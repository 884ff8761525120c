"""An optional progress bar on stderr: tqdm's when tqdm is installed (the ``bench`` extra), else none at all.

The demo and the benchmarks report progress through :func:`progress_bar` only, so neither needs tqdm to run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Update = Callable[[int], None]  # update(n): n more items done


@contextmanager
def progress_bar(total: int, *, desc: str = "", unit: str = "it", enabled: bool = True,
                 leave: bool = True) -> Iterator[Update]:
    """Yield ``update(n)``, which moves a bar of ``total`` items on stderr; a no-op when not ``enabled`` or
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
