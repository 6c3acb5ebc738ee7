"""DCP ranks: real processes on this machine talking torch.distributed over gloo on loopback.

:func:`spawn_ranks` starts ``world_size`` processes (``spawn`` start method), each joining a
gloo process group on ``127.0.0.1`` at a free port with a timeout, one OpenMP thread each, and
runs ``fn(comm, *args)``. It returns rank 0's result, or raises :class:`RankError` with the
first error any rank raised (its type name and message), after every process has ended.

The communicators give the model the two collectives it needs: ``all_gather`` (attention
partials and their log-sum-exp) and ``broadcast_object`` (rank 0's scheduler plan).
:class:`SingleRank` is the same interface for DCP 1, run in the calling process.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds a collective may wait for a peer before gloo gives up (a rank that died or hung).
COLLECTIVE_TIMEOUT_S = 120
#: Seconds the whole run may take before every rank is terminated.
RUN_TIMEOUT_S = 1800
_PORT_ATTEMPTS = 3
#: Seconds the other ranks get to stop on their own after one failed.
_GRACE_S = 10
#: Modules the fork server imports once, so forked ranks start with them loaded.
_PRELOAD = ("torch", "torch.distributed", "kvproof.e2e.runner")


class RankError(RuntimeError):
    """A rank raised: ``kind`` is the exception's type name, ``message`` its text."""

    def __init__(self, rank: int, kind: str, message: str) -> None:
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message = rank, kind, message


class SingleRank:
    """DCP 1 in the calling process: the collectives are identities."""

    rank = 0
    size = 1

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class GlooRanks:
    """This process's rank in the default (gloo) process group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), indexed by rank."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (rank 0 binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
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
        _record_error(outdir, rank, e)
        raise
    try:
        result = fn(GlooRanks(), *args)
    except BaseException as e:
        # Stamped before the group is torn down: the peers fail only once it is, so the
        # cause is always the earliest record.
        _record_error(outdir, rank, e)
        raise
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(outdir, "result.pkl"), "wb") as f:
            pickle.dump(result, f)


def _record_error(outdir: str, rank: int, error: BaseException) -> None:
    record = {"rank": rank, "time": time.time(), "kind": type(error).__name__, "message": str(error),
              "traceback": traceback.format_exc()}
    with open(os.path.join(outdir, f"error-{rank}.json"), "w") as f:
        json.dump(record, f)


def _first_error(outdir: str) -> dict | None:
    records = []
    for name in os.listdir(outdir):
        if name.startswith("error-"):
            with open(os.path.join(outdir, name)) as f:
                records.append(json.load(f))
    # The earliest error is the cause; later ones are peers losing their connection to it.
    return min(records, key=lambda r: r["time"]) if records else None


def _port_in_use(error: dict) -> bool:
    text = error["message"].lower()
    return "address already in use" in text or "eaddrinuse" in text


def spawn_ranks(fn: Callable, world_size: int, args: tuple, timeout_s: float = RUN_TIMEOUT_S) -> Any:
    """Run ``fn(comm, *args)`` on ``world_size`` spawned gloo ranks; return rank 0's result.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Raises RankError
    for the first error of any rank (the others are terminated), TimeoutError after
    ``timeout_s``. Retries with a new port if the chosen one was taken meanwhile.
    """
    for attempt in range(_PORT_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="kvproof-e2e-") as outdir:
            error = _run_once(fn, world_size, args, timeout_s, outdir)
            if error is None:
                with open(os.path.join(outdir, "result.pkl"), "rb") as f:
                    return pickle.load(f)
        if not (_port_in_use(error) and attempt + 1 < _PORT_ATTEMPTS):
            raise RankError(error["rank"], error["kind"], error["message"])
    raise AssertionError("unreachable")


def _start_method() -> str:
    """``forkserver`` where available: one server process imports torch and kvproof once
    (about 3 s on a CI core), and every rank of every later run forks from it in
    milliseconds. The server never runs a torch op, so no OpenMP pool or lock is live when it
    forks. ``spawn`` elsewhere (each rank imports torch itself)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(_PRELOAD))
    return "forkserver"


def _run_once(fn: Callable, world_size: int, args: tuple, timeout_s: float, outdir: str) -> dict | None:
    # Children inherit the environment at start: one OpenMP thread per rank, so that ranks on
    # a 2-core CI machine do not oversubscribe it.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        ctx = mp.start_processes(
            _rank_main, args=(world_size, free_port(), outdir, fn, args),
            nprocs=world_size, join=False, start_method=_start_method(),
        )
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return _wait(ctx.processes, outdir, timeout_s)


def _wait(processes, outdir: str, timeout_s: float) -> dict | None:
    """Wait for every rank; None if all succeeded, else the first error. After a rank fails
    the others get a grace period to stop on their own (rank 0 tells them when scheduling
    failed; a peer's collective fails once its partner is gone) before they are terminated."""
    deadline = time.monotonic() + timeout_s
    grace_end = None
    while True:
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            break
        now = time.monotonic()
        if grace_end is None and any(p.exitcode not in (None, 0) for p in processes):
            grace_end = now + _GRACE_S
        if now > deadline or (grace_end is not None and now > grace_end):
            for p in alive:
                p.terminate()
            for p in alive:
                p.join()
            if now > deadline:
                raise TimeoutError(f"DCP ranks still running after {timeout_s:.0f} s; terminated")
            break
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=1.0)
    error = _first_error(outdir)
    if error is None:
        failed = [(rank, p.exitcode) for rank, p in enumerate(processes) if p.exitcode != 0]
        if failed:  # died without raising (killed, out of memory)
            rank, code = failed[0]
            return {"rank": rank, "kind": "ProcessExited", "message": f"rank {rank} exited with code {code}"}
    return error
