"""Run one subcommand so that its exit status is the whole story, whatever happens around it.

Every subcommand runs through :func:`run_command` (``cli/main.py``), so each one, present or
future, gets the same behaviour for free:

- **Ctrl-C / SIGTERM**: one line (``kvproof X: interrupted``) and status 128 + the signal
  (130, 143). The command's ``finally`` blocks run first (e2e stops its ranks there).
- **A closed stdout** (``kvproof replay t.jsonl | head -1``): later output is discarded and
  the status is still the command's own -- a run that found violations exits 1 even when
  nobody read its table.
- **Out of memory**: one line, status 2 (the input was too large for this machine).
- **Any other exception** is a bug in kvproof: one line naming it, status 70. Set
  ``KVPROOF_DEBUG=1`` to get the traceback instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

from kvproof.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL_ERROR,
    EXIT_SIGNAL_BASE,
    one_line,
    print_error,
)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (a KeyboardInterrupt, so ``except Exception`` passes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class PipeTolerantStdout:
    """Wraps stdout: once the reader has gone (BrokenPipeError), everything written later is
    dropped and stdout's descriptor points at /dev/null, so neither this run nor the
    interpreter's final flush fails on it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.inner.write(text)
            except BrokenPipeError:
                self._drop_output()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.inner.flush()
            except BrokenPipeError:
                self._drop_output()

    def _drop_output(self) -> None:
        self.reader_gone = True
        try:
            fd = self.inner.fileno()
        except (AttributeError, OSError, ValueError):
            return  # not a real descriptor (a test's capture): dropping the text is enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _ignore_signals() -> None:
    """A second Ctrl-C while the first is reported must not turn into a traceback."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def run_command(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status, with the handling described in the module docstring."""
    stdout = sys.stdout
    sys.stdout = guarded = PipeTolerantStdout(stdout)
    try:
        with _signals_raise():
            try:
                return run()
            except KeyboardInterrupt as e:  # Ctrl-C arriving outside the handler's window too
                _ignore_signals()
                signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
                _say(f"{prog}: {'interrupted' if signum == signal.SIGINT else 'terminated'}")
                return EXIT_SIGNAL_BASE + signum
            except MemoryError:
                print_error(prog, "out of memory: the input is too large for this machine")
                return EXIT_BAD_INPUT
            except Exception as e:
                if os.environ.get("KVPROOF_DEBUG"):
                    raise
                print_error(prog, f"internal error (a bug in kvproof, please report it): {type(e).__name__}: "
                            f"{one_line(str(e))[:500]}; KVPROOF_DEBUG=1 shows the traceback")
                return EXIT_INTERNAL_ERROR
    finally:
        guarded.flush()  # a reader that left now must not fail the interpreter's last flush
        sys.stdout = stdout


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
