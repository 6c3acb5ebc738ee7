"""Imported by the fork server alone (a preload module of :mod:`kvproof.e2e.ranks`): when the
server ends, remove the temporary directory that holds its socket.

The server ends once its client -- the kvproof process that started it -- and every rank it
forked have exited. A client that exits normally removes that directory itself; one that was
killed (SIGKILL, out of memory) cannot, so the server does it. The directory is named in
``KVPROOF_FORKSERVER_DIR``, which the client sets only while it starts the server; the variable
is dropped here so that ranks forked later never see it. If the server is killed too (a SIGKILL
to the process group), the next run removes the directory: its name says whose it is.
"""

from __future__ import annotations

import atexit
import os
import shutil

_directory = os.environ.pop("KVPROOF_FORKSERVER_DIR", None)
if _directory and os.path.basename(_directory).startswith("kvproof-"):  # ranks.SOCKET_DIR_PREFIX
    _server = os.getpid()

    def _remove_socket_directory() -> None:
        if os.getpid() == _server:  # never in a forked rank (they leave by os._exit anyway)
            shutil.rmtree(_directory, ignore_errors=True)

    atexit.register(_remove_socket_directory)
