"""The ``phalanx`` command.

Each subcommand lives in its own module of this package, which exposes ``register(subparsers)``: it adds
its parser and sets ``handler`` (a function of the parsed arguments returning the exit code). Subcommand
modules keep heavy imports inside their handlers so ``phalanx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from phalanx import __version__
from phalanx.api.errors import PhalanxError

# name -> module under phalanx.cli; the order is the order in --help.
SUBCOMMANDS: dict[str, str] = {
    "local": "local",
    "master": "master",
    "operator": "operator",
    "status": "status",
    "timeline": "timeline",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="phalanx keeps PyTorch training jobs alive through failures.",
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        importlib.import_module(f"phalanx.cli.{module}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args))
    except PhalanxError as exc:
        print(f"phalanx: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
