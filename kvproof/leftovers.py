"""Temporary paths that name the process that made them, so that what a killed run left behind
(SIGKILL runs no cleanup) is found and removed by the next run -- and nothing a live run still
uses is touched.

A path is ``PREFIX + OWNER + "-" + random`` (a directory: ``PREFIX + OWNER``), OWNER being ``PID.START`` in base 36 (short: a Unix
socket's path holds 108 bytes): the process id and, on Linux, its start time in clock ticks
since boot (``/proc/PID/stat``), so that a process id the system has since given to another
process does not keep a dead run's leftovers alive. Standard library only: ``kvproof.e2e`` (the fork server's socket directory) and ``kvproof.planner`` (the
plot's temporary file) use it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Optional

_TAG = re.compile(r"([0-9a-z]+)\.([0-9a-z]+)")


def _base36(n: int) -> str:
    digits = ""
    while True:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
        if not n:
            return digits


def _start_time(pid: int) -> Optional[int]:
    """``pid``'s start time in clock ticks since boot; None where it cannot be read (no such
    process, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])  # field 22 of stat(5); the name may hold spaces


def owner_tag(pid: Optional[int] = None) -> str:
    """``PID.START`` of ``pid`` (default: this process) in base 36; START is 0 where it cannot
    be read."""
    pid = os.getpid() if pid is None else pid
    return f"{_base36(pid)}.{_base36(_start_time(pid) or 0)}"


def owner_alive(tag: str) -> bool:
    """Whether the process named by ``tag`` (see :func:`owner_tag`) still runs. A tag that does
    not parse counts as alive: never remove what this module did not name."""
    match = _TAG.fullmatch(tag)
    if match is None:
        return True
    pid, start = int(match[1], 36), int(match[2], 36)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    except (OverflowError, ValueError):  # no process has such a number
        return False
    now = _start_time(pid)
    return now is None or start == 0 or now == start


def make_temp_dir(prefix: str, folder: Optional[str] = None) -> str:
    """A new private directory ``prefix + owner`` in ``folder`` (default: the temporary
    directory), no longer than it must be (it may hold a Unix socket); ``prefix + owner + "-" +
    random`` if that name is taken. Mutates the file system."""
    folder = tempfile.gettempdir() if folder is None else folder
    path = os.path.join(folder, prefix + owner_tag())
    try:
        os.mkdir(path, 0o700)  # never follows a symbolic link planted under that name
    except FileExistsError:
        return tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=folder)
    return os.path.abspath(path)


def make_temp_file(prefix: str, suffix: str, folder: str) -> tuple[int, str]:
    """A new private file ``prefix + owner + "-" + random + suffix`` in ``folder``, open for
    writing: ``(descriptor, path)``, as ``tempfile.mkstemp``."""
    return tempfile.mkstemp(prefix=f"{prefix}{owner_tag()}-", suffix=suffix, dir=folder)


def remove_stale(folder: str, prefix: str) -> int:
    """Remove every entry of ``folder`` named ``prefix + owner + "-..."`` whose owner no longer
    runs (files and whole directories); returns how many went. Entries that vanish or cannot be
    removed meanwhile are skipped: another run may be cleaning up too."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if not name.startswith(prefix):
            continue
        tag = name[len(prefix):].partition("-")[0]
        if owner_alive(tag):
            continue
        path = os.path.join(folder, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
