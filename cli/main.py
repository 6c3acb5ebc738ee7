"""Entry point of the ``kvproof`` console script."""

from __future__ import annotations

import sys

from kvproof import __version__
from kvproof.cli import e2e, geometry, plan, prove, replay
from kvproof.cli.errors import OneLineArgumentParser, fail_bad_input
from kvproof.cli.guard import run_command

#: Subcommand modules; each has ``add_parser(subparsers)`` and sets ``run`` as a default.
COMMANDS = (geometry, replay, prove, e2e, plan)


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(
        prog="kvproof",
        description="A formally specified KV-cache block manager for hybrid models under DCP.",
    )
    parser.add_argument("--version", action="version", version=f"kvproof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineArgumentParser)
    for command in COMMANDS:
        command.add_parser(sub)
    parser.set_defaults(command_names=tuple(sub.choices), command_parsers=dict(sub.choices))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (argparse's own exits included: --help is 0,
    bad flags 2). Signals, output errors and unexpected errors: ``cli/guard.py``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    names = parser.get_default("command_names")
    command = next((a for a in argv if not a.startswith("-")), None)
    prog = f"kvproof {command}" if command in names else "kvproof"

    def dispatch() -> int:
        args, extra = parser.parse_known_args(argv)
        if args.command is None:
            return fail_bad_input("kvproof", f"a command is required; expected one of {', '.join(names)} (see kvproof --help)")
        if extra:  # refused by the command's parser, so that the line names the command
            args.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        return args.run(args)

    return run_command(prog, dispatch)


if __name__ == "__main__":
    sys.exit(main())
