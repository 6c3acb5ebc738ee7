"""Run one subcommand so that its exit status is the whole story, whatever happens around it.

Every subcommand runs through :func:`run_command` (``cli/main.py``), so each one, present or
future, gets the same behaviour for free:

- **Ctrl-C / SIGTERM**: one line (``kvproof X: interrupted``) and status 128 + the signal
  (130, 143). The command's ``finally`` blocks run first (e2e stops its ranks there).
- **A reader that leaves** (``kvproof replay t.jsonl | head -1``): later output is discarded and
  the status is still the command's own -- a run that found violations exits 1 even when
  nobody read its table.
- **Output that cannot be written** (a closed stdout, ``> /dev/full``, an I/O error): later
  output is discarded, the command runs to its end, and then one line says why the output was
  lost and the status is 74 (sysexits' EX_IOERR) -- unless the command failed on its own (1, 2).
  ``--help`` and ``--version`` are output too.
- **A missing optional extra** (``kvproof.extras.MissingExtra``, raised before any work): one
  line naming the extra and its install command, status 2.
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
from typing import Callable, Iterator, Optional

from kvproof.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL_ERROR,
    EXIT_OK,
    EXIT_OUTPUT_ERROR,
    EXIT_SIGNAL_BASE,
    one_line,
    print_error,
    say,
)
from kvproof.extras import MissingExtra


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (a KeyboardInterrupt, so ``except Exception`` passes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class OutputGuard:
    """Stands in for stdout while a command runs. Once a write fails, everything written later
    is dropped and stdout's descriptor points at /dev/null, so neither this run nor the
    interpreter's final flush fails on it. A reader that left (a broken pipe) is no error;
    any other failure is kept in :attr:`error` (mutated by every write and flush).
    ``inner`` None is a stdout that was closed before the run began."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.dropping = inner is None
        self.error: Optional[str] = None

    def write(self, text: str) -> int:
        if not self.dropping:
            try:
                return self.inner.write(text)
            except (OSError, ValueError) as e:  # ValueError: a stdout someone closed
                self._failed(e)
        elif self.inner is None and text and self.error is None:
            self.error = "stdout is closed"
        return len(text)

    def flush(self) -> None:
        if not self.dropping:
            try:
                self.inner.flush()
            except (OSError, ValueError) as e:
                self._failed(e)

    def isatty(self) -> bool:
        return not self.dropping and self.inner.isatty()

    def _failed(self, e: Exception) -> None:
        self.dropping = True
        if not isinstance(e, BrokenPipeError):
            self.error = "stdout is closed" if isinstance(e, ValueError) else (e.strerror or str(e))
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
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


def _fill_closed_descriptors() -> None:
    """Open /dev/null on a closed stdin, stdout or stderr: otherwise the next file this process
    opens takes that number, and whatever a child process prints lands in it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)


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


def _exit_code(code: object) -> int:
    """The status a ``SystemExit(code)`` stands for (argparse's --help: None or 0)."""
    if code is None:
        return EXIT_OK
    return code if isinstance(code, int) else EXIT_BAD_INPUT


def run_command(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status, with the handling described in the module docstring
    (``SystemExit`` included: argparse's --help, --version and refusals)."""
    _fill_closed_descriptors()
    stdout = sys.stdout
    sys.stdout = guard = OutputGuard(stdout)
    try:
        with _signals_raise():
            try:
                try:
                    code = run()
                except SystemExit as e:
                    code = _exit_code(e.code)
                guard.flush()  # what is still buffered fails here, not in the interpreter's last flush
            except KeyboardInterrupt as e:  # Ctrl-C arriving outside the handler's window too
                _ignore_signals()
                signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
                say(f"{prog}: {'interrupted' if signum == signal.SIGINT else 'terminated'}")
                return EXIT_SIGNAL_BASE + signum
            except MissingExtra as e:
                print_error(prog, str(e))
                return EXIT_BAD_INPUT
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
        sys.stdout = stdout
    if guard.error is None or code == EXIT_BAD_INPUT:
        return code
    print_error(prog, f"cannot write the output: {guard.error}")
    return EXIT_OUTPUT_ERROR if code == EXIT_OK else code
