"""The ``kvtier`` command.

Subcommands live in their own modules, listed in :data:`SUBCOMMANDS` and imported only when chosen (or to
list their one-line help). Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and may set
``HELP`` (else the first line of its docstring is used). A ``KvtierError`` becomes ``kvtier: error: ...`` on
stderr and exit code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from kvtier import __version__
from kvtier.errors import KvtierError

SUBCOMMANDS: dict[str, str] = {
    "check": "kvtier.cli_check",
    "demo": "kvtier.engine.demo",
    "bench": "kvtier.bench.cli",
}

logger = logging.getLogger(__name__)


def load_subcommand(name: str) -> ModuleType:
    """Import a subcommand's module; ``ImportError`` when it or its interface is missing."""
    module = importlib.import_module(SUBCOMMANDS[name])
    if not (callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None))):
        raise ImportError(f"{SUBCOMMANDS[name]} defines no add_arguments(parser) / run(args)")
    return module


def _help_of(module: ModuleType) -> str:
    text = getattr(module, "HELP", None) or (module.__doc__ or "").strip()
    return text.splitlines()[0] if text else ""


def _global_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default WARNING)")


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; only ``chosen``'s module is imported, or all of them (for help) when None."""
    parser = argparse.ArgumentParser(prog="kvtier", description="Multi-tier KV cache for LLM inference engines.")
    _global_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        if chosen is not None and name != chosen:
            continue
        try:
            module = load_subcommand(name)
        except Exception as exc:  # a missing or broken subcommand must not break the others
            logger.debug("subcommand %s unavailable: %r", name, exc)
            sub.add_parser(name, help="(not available)")
            continue
        child = sub.add_parser(name, help=_help_of(module), description=(module.__doc__ or "").strip() or None,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(child)
        child.set_defaults(_run=module.run)
    return parser


def _chosen_command(argv: Sequence[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(argv)
    return known.command if known.command in SUBCOMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen_command(argv)
    if chosen is not None:
        try:
            load_subcommand(chosen)
        except ImportError as exc:
            print(f"kvtier: error: subcommand {chosen!r} is not available ({exc})", file=sys.stderr)
            return 2
    try:
        args = build_parser(chosen).parse_args(argv)
        logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
        if getattr(args, "_run", None) is None:
            build_parser().print_help(sys.stderr)
            return 2
        return int(args._run(args))
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


if __name__ == "__main__":
    sys.exit(main())
