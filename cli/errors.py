"""Bad input as one clean line and exit status 2."""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_PROPERTY_FAILED = 1
EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad command-line input; the message names the value and what was expected."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad input as a single line (no usage dump) with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def fail_bad_input(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT
