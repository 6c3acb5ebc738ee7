"""Exit statuses, and bad input as one clean line on stderr with status 2."""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_PROPERTY_FAILED = 1
EXIT_BAD_INPUT = 2
#: A bug in kvproof (an exception no command expected): one line, this status (EX_SOFTWARE).
EXIT_INTERNAL_ERROR = 70
#: The output could not be written (a closed stdout, a full disk): one line, this status (EX_IOERR).
EXIT_OUTPUT_ERROR = 74
#: Ended by a signal (Ctrl-C: SIGINT, or SIGTERM): 128 + the signal number, as shells report it.
EXIT_SIGNAL_BASE = 128


def one_line(message: str) -> str:
    """``message`` on a single line that a terminal shows as it is: line breaks become spaces,
    other control characters (an ANSI escape in a quoted value) their escape sequence."""
    text = str(message).replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    return text if text.isprintable() else "".join(c if c.isprintable() else printable(c)[1:-1] for c in text)


def printable(text: str) -> str:
    """``text`` itself when a terminal shows it as it is, else its quoted escaped form
    (``repr``): a request id holding a newline or an ANSI escape cannot break a table."""
    return text if text.isprintable() else repr(text)


def print_error(prog: str, message: str) -> None:
    """``PROG: error: MESSAGE`` as one line on stderr; a closed stderr is ignored."""
    say(f"{prog}: error: {one_line(message)}")


def say(line: str) -> None:
    """``line`` on stderr, flushed; nothing if stderr is closed (never stdout instead)."""
    if sys.stderr is None:  # closed before the run: print(file=None) would write to stdout
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def fail_bad_input(prog: str, message: str) -> int:
    print_error(prog, message)
    return EXIT_BAD_INPUT


class _StoreOnce(argparse._StoreAction):
    """A single-valued option given twice is refused (``--dcp 2 --dcp 4``), not "last wins"."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_once", {})
        if self.dest in given:
            raise argparse.ArgumentError(self, f"given twice ({given[self.dest]!r} and {values!r}); expected it once")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad input as a single line (no usage dump) with status 2, and
    refuses a repeated single-valued option. Subcommand parsers are of this class too, so
    every subcommand gets both."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Argument groups share these registries, so their options get it as well.
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> None:  # type: ignore[override]
        print_error(self.prog, message)
        self.exit(EXIT_BAD_INPUT)
