"""kvtier's log in vLLM's: ``join_vllm_logging`` hands kvtier's records to the handlers vLLM's logger has when
each record is made, where nothing else would show them, and leaves an application's own logging alone. (The
server's real log: tests/e2e/test_vllm_server_e2e.py.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvtier.integrations.vllm import ToVllmLog, join_vllm_logging


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def bare_loggers() -> Iterator[tuple[logging.Logger, logging.Logger, logging.Logger]]:
    """kvtier's, vLLM's and the root logger without handlers (pytest's own included), as in a vLLM process; their
    handlers, levels and propagation restored afterwards."""
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in
             (logging.getLogger("kvtier"), logging.getLogger("vllm"), logging.getLogger())]
    for lg, *_ in saved:
        for handler in list(lg.handlers):
            lg.removeHandler(handler)
    try:
        yield logging.getLogger("kvtier"), logging.getLogger("vllm"), logging.getLogger()
    finally:
        for lg, handlers, level, propagate in saved:
            for handler in list(lg.handlers):
                lg.removeHandler(handler)
            for handler in handlers:
                lg.addHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def test_kvtiers_info_lines_reach_the_handlers_vllm_has_when_they_are_logged() -> None:
    with bare_loggers() as (ours, vllm, _):
        _joined_and_logged(ours, vllm)


def _joined_and_logged(ours: logging.Logger, vllm: logging.Logger) -> None:
    first, later = Keep(), Keep()
    vllm.addHandler(first)
    vllm.setLevel(logging.INFO)
    join_vllm_logging()
    join_vllm_logging()  # once per process
    assert [type(h) for h in ours.handlers] == [ToVllmLog] and not ours.propagate
    logging.getLogger("kvtier.connector.keying").info("tied to %s", "model")
    logging.getLogger("kvtier.tiers").debug("not shown at vLLM's level")
    vllm.removeHandler(first)
    vllm.addHandler(later)  # vLLM configured its logging again
    logging.getLogger("kvtier.integrations.vllm").warning("a dead tier")
    assert first.lines == ["tied to model"] and later.lines == ["a dead tier"]


@pytest.mark.parametrize("configured", ["kvtier", "root"])
def test_an_applications_own_logging_is_left_alone(configured: str) -> None:
    with bare_loggers() as (ours, vllm, root):
        own, seen = Keep(), Keep()
        vllm.addHandler(seen)
        (ours if configured == "kvtier" else root).addHandler(own)
        join_vllm_logging()
        assert ours.handlers == ([own] if configured == "kvtier" else []) and ours.propagate
        logging.getLogger("kvtier.store").warning("a dead tier")
        assert own.lines == ["a dead tier"] and seen.lines == []
