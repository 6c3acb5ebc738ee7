"""Why kvproof stopped vLLM, as the last line of its output.

When kvproof refuses a start (a geometry violation such as the seed bug's INV-TABLE-WIDTH, a
configuration its checks cannot model) or stops the engine (a violation in raise mode, or one
that is always fatal), the process that raises it -- the engine core, a worker -- prints it
inside vLLM's tracebacks, tens of lines above the end. So each such refusal is also appended,
as one line naming the id (if any) and what to do, to one file: the first process that loads
the plugin (``vllm serve``'s API server, or the Python process of an offline ``LLM``) creates
it and names it in ``KVPROOF_STOP_REPORT`` for the processes it starts. When that process exits
with a refusal recorded, it prints the first one as ``kvproof: ...`` after everything vLLM
printed, and exits 1 -- ``vllm serve`` itself exits 0 when its engine dies while serving. The
file is named after its owner (``kvproof.leftovers``): one that a killed server left is removed
by the next.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from typing import Optional

from kvproof import leftovers

ENV = "KVPROOF_STOP_REPORT"
PREFIX = "kvproof-stop-"


def begin() -> bool:
    """In ``register()``: in the first process that loads the plugin, create the report file
    and arrange for its last line and exit status (mutates ``os.environ`` and the process's exit
    handlers). Does nothing in the processes that process starts; returns whether this one is
    the first."""
    if os.environ.get(ENV):
        return False
    folder = tempfile.gettempdir()
    leftovers.remove_stale(folder, PREFIX)
    fd, path = leftovers.make_temp_file(PREFIX, ".txt", folder)
    os.close(fd)
    os.environ[ENV] = path
    owner = os.getpid()
    atexit.register(_print_at_exit, path, owner)
    return True


def record(line: str) -> None:
    """Append ``line`` (one line) to the report, when a first process asked for one."""
    path = os.environ.get(ENV)
    if not path:
        return
    data = (" ".join(line.splitlines()) + "\n").encode("utf-8", "backslashreplace")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # one write: lines of several processes never mix
    except OSError:
        return
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def recorded(path: Optional[str] = None) -> list[str]:
    """The lines recorded so far (none when there is no report)."""
    path = path or os.environ.get(ENV)
    if not path:
        return []
    try:
        with open(path, encoding="utf-8", errors="backslashreplace") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError:
        return []


def final_line(lines: list[str]) -> Optional[str]:
    """What the first process prints last: the first refusal, and how many more there were."""
    if not lines:
        return None
    more = len(lines) - 1
    return f"kvproof: {lines[0]}" + (f" (and {more} more kvproof refusal(s) above)" if more else "")


def _print_at_exit(path: str, owner: int) -> None:
    """The first process's last word. With a stop recorded, it ends the process with status 1
    right after the line: the interpreter's own finalization would otherwise print after it
    (native extensions report leaks then: nanobind, under Triton, a dozen lines). The exit
    work of the standard library that is still due -- weakref finalizers (temporary
    directories), multiprocessing's (its children and their files), logging's -- runs first."""
    if os.getpid() != owner:  # a forked child that runs exit handlers
        return
    line = final_line(recorded(path))
    try:
        os.unlink(path)
    except OSError:
        pass
    if line is None:
        return
    import logging
    import multiprocessing.util
    import weakref

    for cleanup in (weakref.finalize._exitfunc, multiprocessing.util._exit_function, logging.shutdown):
        try:
            cleanup()
        except Exception:  # noqa: BLE001 -- the line and the status matter more than a cleanup
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.write(2, (line + "\n").encode("utf-8", "backslashreplace"))
    except OSError:
        pass
    os._exit(1)

