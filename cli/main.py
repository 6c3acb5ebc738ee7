"""Entry point of the ``kvproof`` console script."""

from __future__ import annotations

import os
import sys

from kvproof import __version__
from kvproof.cli import e2e, geometry, plan, prove, replay
from kvproof.cli.errors import EXIT_BAD_INPUT, EXIT_OK, OneLineArgumentParser

#: Subcommand modules; each has ``add_parser(subparsers)`` and sets ``run`` as a default.
COMMANDS = (plan, geometry, replay, prove, e2e)


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(
        prog="kvproof",
        description="A formally specified KV-cache block manager for hybrid models under DCP.",
    )
    parser.add_argument("--version", action="version", version=f"kvproof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineArgumentParser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return args.run(args)
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        # Python flushes stdout again at exit; point it at /dev/null so that cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
