"""DCP ranks as processes: real processes on this machine joining a torch.distributed gloo group
on loopback, supervised from start to end (the collectives they then use:
:mod:`kvproof.e2e.communicators`).

:func:`spawn_ranks` starts ``world_size`` processes, each joining a gloo process group on
``127.0.0.1`` at a free port with a timeout, one OpenMP thread each, and runs
``fn(comm, *args)`` with ``comm`` its :class:`~kvproof.e2e.communicators.GlooRanks`. It returns rank 0's result, or raises :class:`RankError` naming the rank
that failed first (its exception's type name and message, or how it died), after every
process has ended.

**Nothing outlives the caller, nothing is left on disk.** Results and errors come back over one
pipe per rank, never through files. A rank ignores Ctrl-C (the terminal sends it to the whole
process group; the caller decides) and dies with its parent: a watchdog thread waits on
multiprocessing's parent sentinel, which the operating system closes when the caller exits or
is killed (even by SIGKILL), and on Linux the kernel also kills it when the fork server that
forked it dies (``PR_SET_PDEATHSIG``). Whenever the caller leaves :func:`spawn_ranks` -- an
error, Ctrl-C, a timeout -- the ranks still running are terminated and reaped first. The fork
server's socket directory, which a killed caller cannot remove, is removed by the fork server
itself when it ends (:mod:`kvproof.e2e.forkserver_exit`), and when both were killed, by the
next run (it names its owner: :mod:`kvproof.leftovers`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from kvproof import leftovers
from kvproof.e2e.communicators import GlooRanks

#: Seconds a collective may wait for a peer before gloo gives up (a rank that died or hung).
COLLECTIVE_TIMEOUT_S = 120
#: Seconds the whole run may take before every rank is terminated.
RUN_TIMEOUT_S = 1800
_PORT_ATTEMPTS = 3
#: Seconds the other ranks get to stop on their own after one failed.
_GRACE_S = 10
#: Seconds a terminated rank gets before it is killed.
_TERMINATE_S = 2
#: Modules the fork server imports once, so forked ranks start with them loaded.
_PRELOAD = ("kvproof.e2e.forkserver_exit", "torch", "torch.distributed", "kvproof.e2e.runner")
#: Exit status of a rank whose parent went away (it stops at once, reporting nothing).
_EXIT_ORPHANED = 3


class RankError(RuntimeError):
    """A rank failed: ``kind`` is its exception's type name (``RankDied`` when the process
    died without raising: killed, out of memory), ``message`` the text."""

    def __init__(self, rank: int, kind: str, message: str) -> None:
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message = rank, kind, message


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (rank 0 binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- in each rank ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Make this rank end as soon as the process that started it does (see the module doc)."""
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the fork server's death kills us
        if os.getppid() != parent:  # it died before the call took effect
            os._exit(_EXIT_ORPHANED)
    parent_process = multiprocessing.parent_process()
    if parent_process is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent_process.sentinel])
        os._exit(_EXIT_ORPHANED)  # the caller is gone: nobody will read our result

    threading.Thread(target=watch, name="kvproof-parent-watchdog", daemon=True).start()


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the caller decides
    # Loopback only: the store and gloo's pairs both bind 127.0.0.1 / the lo interface.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    except BaseException as e:
        _send(out, ("error", _error_record(rank, e)))
        sys.exit(1)
    try:
        result = fn(GlooRanks(), *args)
    except BaseException as e:
        # Sent before the group is torn down: the peers fail only once it is, so the cause is
        # always the earliest record.
        _send(out, ("error", _error_record(rank, e)))
        code = 1
    else:
        _send(out, ("ok", result if rank == 0 else None))
        code = 0
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def _error_record(rank: int, error: BaseException) -> dict:
    return {"rank": rank, "time": time.time(), "kind": type(error).__name__, "message": str(error),
            "traceback": traceback.format_exc()}


def _send(out, message: tuple) -> None:
    # Plain pickle: torch's reducers for multiprocessing would move tensors into shared memory.
    try:
        out.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        out.close()
    except OSError:
        pass  # the caller is gone; the watchdog ends this rank


# --- in the caller --------------------------------------------------------------------------------


def spawn_ranks(fn: Callable, world_size: int, args: tuple, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    """Run ``fn(comm, *args)`` on ``world_size`` gloo ranks; return rank 0's result.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Raises RankError
    for the rank that failed first (the others are terminated), TimeoutError after
    ``timeout_s``. Retries with a new port if the chosen one was taken meanwhile. Every rank
    has ended when this returns or raises (KeyboardInterrupt included)."""
    for attempt in range(_PORT_ATTEMPTS):
        outcome = _run_once(fn, world_size, args, timeout_s)
        if outcome.error is None:
            return outcome.result
        if not (_port_in_use(outcome.error) and attempt + 1 < _PORT_ATTEMPTS):
            raise RankError(outcome.error["rank"], outcome.error["kind"], outcome.error["message"])
    raise AssertionError("unreachable")


@dataclasses.dataclass
class _Outcome:
    result: Any = None
    error: Optional[dict] = None


def _port_in_use(error: dict) -> bool:
    text = error["message"].lower()
    return "address already in use" in text or "eaddrinuse" in text


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the processes started inside the block, then restore."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context ranks start from, its fork server running (tests call it
    early, so that the server's socket directory is not in a temporary directory they watch).

    ``forkserver`` where available: one server process imports torch and kvproof once
    (about 3 s on a CI core), and every rank of every later run forks from it in
    milliseconds. The server never runs a torch op, so no OpenMP pool or lock is live when it
    forks. ``spawn`` elsewhere (each rank imports torch itself). Children get one OpenMP
    thread each, so that ranks on a 2-core CI machine do not oversubscribe it."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    # Started here (once per process) so that it inherits these variables; its socket lives
    # in multiprocessing's temporary directory, which the server removes when it ends.
    with _environment(OMP_NUM_THREADS="1", KVPROOF_FORKSERVER_DIR=_socket_temp_dir()), _sigint_ignored_by_children():
        multiprocessing.forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Processes started in the block begin with SIGINT ignored (an ignored signal stays ignored
    across exec, and Python then keeps it so): the fork server hands that to every rank from
    its first instruction, so a Ctrl-C to the process group can never interrupt a rank that has
    not yet reached ``_rank_main``. Here a Ctrl-C meanwhile is held and delivered after the
    block (main thread, POSIX). Only SIGINT: a held signal stays held in the children too."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


#: ``sun_path`` holds 108 bytes; the server's socket is ``<directory>/listener-XXXXXXXX``.
_SOCKET_PATH_MAX, _SOCKET_SUFFIX = 107, len("/listener-xxxxxxxx")
#: The socket directory: ``<tmp>/kvproof-<owner>`` (kvproof.leftovers), so that the
#: next run removes one that a killed run left (its fork server killed with it).
SOCKET_DIR_PREFIX = "kvproof-"


def _socket_temp_dir() -> str:
    """multiprocessing's temporary directory (removed when this process ends, or by the fork
    server when it ends, or by the next run if both were killed). Directories that killed runs
    left are removed first."""
    config = multiprocessing.process.current_process()._config  # where get_temp_dir keeps it
    if config.get("tempdir") is not None:
        return config["tempdir"]
    base = _socket_dir_base()
    leftovers.remove_stale(base, SOCKET_DIR_PREFIX)
    path = config["tempdir"] = leftovers.make_temp_dir(SOCKET_DIR_PREFIX, base)
    # As multiprocessing.util.get_temp_dir registers the removal of a directory it makes.
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-100)
    return path


def _socket_dir_base() -> str:
    """Where the socket directory goes: the temporary directory, or ``/tmp`` when that path
    (TMPDIR) is too long for a Unix socket. ValueError if neither will do."""
    base = tempfile.gettempdir()
    name = SOCKET_DIR_PREFIX + leftovers.owner_tag()
    if len(os.fsencode(os.path.join(base, name))) + _SOCKET_SUFFIX <= _SOCKET_PATH_MAX:
        return base
    if not os.access("/tmp", os.W_OK | os.X_OK):
        most = _SOCKET_PATH_MAX - _SOCKET_SUFFIX - len(name) - 1
        raise ValueError(
            f"the temporary directory {base!r} ({len(os.fsencode(base))} bytes) is too long for the rank "
            f"processes' Unix socket (at most {most} bytes) and /tmp is not writable; set TMPDIR to a shorter "
            "directory"
        )
    return "/tmp"


def _run_once(fn: Callable, world_size: int, args: tuple, timeout_s: float) -> _Outcome:
    ctx = rank_context()
    port = free_port()
    processes, readers = [], []
    try:
        with _environment(OMP_NUM_THREADS="1"):
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, writer),
                                name=f"kvproof-rank-{rank}", daemon=True)
                processes.append(p)
                readers.append(reader)
                p.start()
                writer.close()  # the rank holds it now: its death is EOF here
        return _collect(processes, readers, timeout_s)
    finally:
        _stop(processes)
        for r in readers:
            r.close()


def _collect(processes: list, readers: list, timeout_s: float) -> _Outcome:
    """Read every rank's message and wait for every rank to end (a failure gives the others
    ``_GRACE_S`` to stop on their own; then they are terminated)."""
    deadline = time.monotonic() + timeout_s
    messages: dict[int, tuple] = {}
    unread = dict(enumerate(readers))
    terminated: set[int] = set()
    grace_end = None
    while unread or any(p.exitcode is None for p in processes):
        now = time.monotonic()
        failed = any(m[0] == "error" for m in messages.values()) or any(
            p.exitcode not in (None, 0) for p in processes
        )
        if failed and grace_end is None:
            grace_end = now + _GRACE_S
        if now > deadline or (grace_end is not None and now > grace_end):
            alive = [i for i, p in enumerate(processes) if p.exitcode is None]
            terminated.update(alive)
            _stop(processes)
            if now > deadline:
                raise TimeoutError(f"DCP ranks still running after {timeout_s:.0f} s; terminated")
            break
        handles = {r: i for i, r in unread.items()}
        ready = multiprocessing.connection.wait(
            list(handles) + [p.sentinel for p in processes if p.exitcode is None], timeout=1.0
        )
        for h in ready:
            rank = handles.get(h)
            if rank is None:
                continue
            del unread[rank]
            try:
                messages[rank] = pickle.loads(h.recv_bytes())
            except (EOFError, OSError):
                pass  # ended without a word: died
    for p in processes:
        p.join()
    for rank, r in unread.items():  # what ranks said before they were stopped
        try:
            if r.poll():
                messages[rank] = pickle.loads(r.recv_bytes())
        except (EOFError, OSError):
            pass
    return _outcome(processes, messages, terminated)


def _outcome(processes: list, messages: dict[int, tuple], terminated: set[int]) -> _Outcome:
    if all(messages.get(i, ("",))[0] == "ok" and p.exitcode == 0 for i, p in enumerate(processes)):
        return _Outcome(result=messages[0][1])
    # A rank that died without a word is the cause: its peers' errors ("Connection reset by
    # peer") are the consequence.
    for rank, p in enumerate(processes):
        if rank not in messages and rank not in terminated:
            return _Outcome(error={"rank": rank, "kind": "RankDied", "message": f"rank {rank} {_death(p.exitcode)}"})
    records = [m[1] for m in messages.values() if m[0] == "error"]
    if records:  # the earliest error is the cause; later ones are peers losing their connection
        return _Outcome(error=min(records, key=lambda r: r["time"]))
    rank, p = next((i, p) for i, p in enumerate(processes) if p.exitcode != 0)
    return _Outcome(error={"rank": rank, "kind": "RankDied", "message": f"rank {rank} {_death(p.exitcode)}"})


def _death(exitcode: Optional[int]) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} before it could report an error (out of memory, or killed from outside)"
    return f"exited with status {exitcode} without reporting an error"


def _stop(processes: list) -> None:
    """Terminate the ranks still running, kill those that do not stop, and reap them all. A
    second Ctrl-C meanwhile is held back until they are gone."""
    with _signals_held():
        alive = [p for p in processes if p.pid is not None and p.exitcode is None]
        for p in alive:
            p.terminate()
        end = time.monotonic() + _TERMINATE_S
        for p in alive:
            p.join(max(end - time.monotonic(), 0))
            if p.exitcode is None:
                p.kill()
                p.join()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM are delivered only after the block (main thread, POSIX)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
