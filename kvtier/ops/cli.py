"""The kvtier command.

Subcommands live in their own modules, listed with their one-line help in SUBCOMMANDS and imported only when
chosen: kvtier --help and --version import nothing heavy (no torch). Each module exposes add_arguments(parser)
and run(args) -> int. A subcommand whose module is missing shows as unavailable; the others keep working.

Exit codes:
  0    success
  1    a check or comparison failed (demo: the outputs with and without the cache differ)
  2    a usage or config error: one line "kvtier: error: ..." on stderr, never a traceback
  130  interrupted (Ctrl-C), with "kvtier: interrupted" on stderr
  141  stdout was closed early (kvtier check --json | head -c1): quietly, the code a shell reports for a
       program ended by SIGPIPE (128 + 13)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from importlib.machinery import PathFinder
from types import ModuleType
from typing import Any, NamedTuple, NoReturn

from kvtier import __version__
from kvtier.errors import KvtierError
from kvtier.ops.progress import loading

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 1, 2, 130, 141


class Subcommand(NamedTuple):
    """A subcommand's module, its one-line help, and whether importing it loads torch (a pause of seconds)."""

    module: str
    help: str
    loads_torch: bool = False


SUBCOMMANDS: dict[str, Subcommand] = {
    "check": Subcommand("kvtier.ops.check", "validate a config file and show tier capacities in bytes, tokens "
                        "and chunks (--probe: also try each tier on this host)"),
    "demo": Subcommand("kvtier.ops.demo", "a multi-turn chat through the reference engine, without and with "
                       "kvtier", loads_torch=True),
    "bench": Subcommand("kvtier.bench.cli", "run a benchmark (kvtier bench --help lists them)"),
    "stats": Subcommand("kvtier.ops.stats", "what each tier stores, per namespace"),
    "inspect": Subcommand("kvtier.ops.inspect", "the records of one namespace or key"),
    "purge": Subcommand("kvtier.ops.purge", "delete records by model, namespace or age"),
}

logger = logging.getLogger(__name__)

_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`]+)`")  # :func:`x`, :py:class:`~a.b`
_LITERAL = re.compile(r"``([^`]+)``")
_TICKS = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST markup, for help output: :func:`x` and ``x`` become x."""
    text = _ROLE.sub(lambda m: m.group(1), text)
    return _TICKS.sub(r"\1", _LITERAL.sub(r"\1", text))


class KvtierParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (kvtier: error: ...) and exit 2, and whose help has no
    docs markup."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(EXIT_USAGE, f"kvtier: error: {text} (see '{self.prog} --help')\n")

    def format_help(self) -> str:
        return plain(super().format_help())


def module_exists(dotted: str) -> bool:
    """Whether module ``dotted`` (inside kvtier) can be found, without importing it or its packages."""
    parts = dotted.split(".")
    search: Any = importlib.import_module(parts[0]).__path__
    for i in range(1, len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if spec is None:
            return False
        search = spec.submodule_search_locations
        if search is None and i < len(parts) - 1:
            return False
    return True


def load_subcommand(name: str) -> ModuleType:
    """Import a subcommand's module; ImportError when it or its interface is missing."""
    entry = SUBCOMMANDS[name]
    with loading(f"kvtier {name}", "torch", transient=True) if entry.loads_torch else nullcontext():
        module = importlib.import_module(entry.module)
    if not (callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None))):
        raise ImportError(f"{entry.module} defines no add_arguments(parser) / run(args)")
    return module


def _global_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default WARNING)")


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``chosen``'s module is imported (none for kvtier --help)."""
    parser = KvtierParser(prog="kvtier", description="Multi-tier KV cache for LLM inference engines.")
    _global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=KvtierParser)
    for name, entry in SUBCOMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=entry.help if _available(entry) else "(not available)")
            continue
        module = load_subcommand(name)
        child = sub.add_parser(name, help=entry.help, description=plain(module.__doc__ or "").strip() or None,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(child)
        child.set_defaults(_run=module.run)
    return parser


def _available(entry: Subcommand) -> bool:
    try:
        return module_exists(entry.module)
    except (ImportError, ValueError) as exc:
        logger.debug("subcommand module %s unavailable: %r", entry.module, exc)
        return False


def _chosen_command(argv: Sequence[str]) -> str | None:
    pre = KvtierParser(prog="kvtier", add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    return known.command if known.command in SUBCOMMANDS else None


def _run(argv: list[str]) -> int:
    try:
        chosen = _chosen_command(argv)
        if chosen is not None:
            try:
                load_subcommand(chosen)
            except ImportError as exc:
                print(f"kvtier: error: subcommand {chosen!r} is not available ({exc})", file=sys.stderr)
                return EXIT_USAGE
        args = build_parser(chosen).parse_args(argv)
        logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
        run = getattr(args, "_run", None)
        if run is None:
            print(f"kvtier: error: no command given: use one of {', '.join(SUBCOMMANDS)} (see 'kvtier --help')",
                  file=sys.stderr)
            return EXIT_USAGE
        return int(run(args))
    except KvtierError as exc:
        print(f"kvtier: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the kvtier console script; returns the exit code (see the module docstring)."""
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's shutdown
        return code
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing what is left at exit does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stdout (tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
