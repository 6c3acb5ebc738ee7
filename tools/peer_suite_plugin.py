"""pytest plugin that tools/peer_suite.py loads into vLLM's own tests (``-p peer_suite_plugin``).

It takes its orders from the environment the runner sets:

* ``KVPROOF_PEER_REPORT``: a file to which one JSON line per test is appended when the test
  finishes: its node id, outcome (pass, fail, error, skip, xfail, xpass), a one-line reason, its
  duration, and how it built KV-cache managers (below); and first the collected node ids.
* ``KVPROOF_PEER_MANAGER`` (``module:Class``, optional): the class vLLM's Scheduler builds in place
  of its ``KVCacheManager``. The Scheduler module binds the name ``KVCacheManager`` at import and
  calls it in ``__init__``; that name is replaced. With ``KVPROOF_PEER_SUBSTITUTE=all`` the class
  also replaces ``vllm.v1.core.kv_cache_manager.KVCacheManager`` and the name in every collected
  test module, so tests that build a manager themselves get it too.
* ``KVPROOF_CONTRACTS`` (optional): kvproof's checks, installed as its vLLM plugin installs them.

What a test builds is observed, not guessed: a manager built while a Scheduler is being built
counts as ``scheduler``, any other as ``direct``; a block pool or coordinator built outside any
manager counts as ``pool`` / ``coordinator`` (a unit test of vLLM's internals).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time

import pytest

_current: dict | None = None  # the running test's record
_depth = {"scheduler": 0, "kv": 0}  # how deep inside a Scheduler's / a KV-cache object's __init__


def _wrap_init(cls, key: str, kind=None) -> None:
    """Mutates ``cls``: its ``__init__`` keeps ``_depth[key]`` positive while it runs and, when
    ``kind`` is given and no KV-cache object is being built around it, records ``kind()`` for
    the running test."""
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if kind is not None and _depth["kv"] == 0 and _current is not None:
            _current["builds"].add(kind())
        _depth[key] += 1
        try:
            original(self, *args, **kwargs)
        finally:
            _depth[key] -= 1

    cls.__init__ = __init__


def _install_probes(manager_classes) -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler

    _wrap_init(Scheduler, "scheduler")
    for cls in manager_classes:
        _wrap_init(cls, "kv", lambda: "scheduler" if _depth["scheduler"] else "direct")
    _wrap_init(KVCacheCoordinator, "kv", lambda: "coordinator")
    _wrap_init(BlockPool, "kv", lambda: "pool")


def _load_class(spec: str):
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise pytest.UsageError(f"KVPROOF_PEER_MANAGER={spec!r}: expected module:Class")
    return getattr(importlib.import_module(module_name), class_name)


def pytest_configure(config):
    import vllm.v1.core.kv_cache_manager as manager_module
    import vllm.v1.core.sched.scheduler as scheduler_module

    stock = manager_module.KVCacheManager
    spec = os.environ.get("KVPROOF_PEER_MANAGER")
    substitute = _load_class(spec) if spec else None
    if substitute is not None:
        scheduler_module.KVCacheManager = substitute
        if os.environ.get("KVPROOF_PEER_SUBSTITUTE", "scheduler") == "all":
            manager_module.KVCacheManager = substitute
    config._kvproof_peer = (stock, substitute)
    _install_probes([stock] + ([substitute] if substitute is not None and substitute is not stock else []))
    if os.environ.get("KVPROOF_CONTRACTS"):
        from kvproof.integrations.vllm.plugin import register

        register()


def pytest_collection_modifyitems(config, items):
    stock, substitute = config._kvproof_peer
    if substitute is None or os.environ.get("KVPROOF_PEER_SUBSTITUTE", "scheduler") != "all":
        return
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if getattr(module, "KVCacheManager", None) is stock:
            module.KVCacheManager = substitute


def pytest_collection_finish(session):
    _append({"collected": [item.nodeid for item in session.items]})


def _append(record: dict) -> None:
    with open(os.environ["KVPROOF_PEER_REPORT"], "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = {"test": item.nodeid, "phases": {}, "reason": "", "builds": set()}
    start = time.monotonic()
    yield
    record, _current = _current, None
    record["seconds"] = round(time.monotonic() - start, 3)
    record["outcome"] = _outcome(record.pop("phases"))
    record["builds"] = sorted(record["builds"])
    _append(record)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _current is None:
        return
    _current["phases"][report.when] = (report.outcome, hasattr(report, "wasxfail"))
    if _current["reason"]:
        return
    if report.failed and call.excinfo is not None:
        _current["reason"] = _one_line(f"{call.excinfo.typename}: {call.excinfo.value}")
    elif report.skipped:
        longrepr = report.longrepr
        text = longrepr[2] if isinstance(longrepr, tuple) else getattr(report, "wasxfail", "") or str(longrepr)
        _current["reason"] = _one_line(text)


def _outcome(phases: dict) -> str:
    setup, call, teardown = (phases.get(when, ("passed", False)) for when in ("setup", "call", "teardown"))
    if setup[0] == "failed":
        return "error"
    if setup[0] == "skipped":
        return "skip"
    if call[0] == "failed":
        return "fail"
    if call[0] == "skipped":
        return "xfail" if call[1] else "skip"
    if teardown[0] == "failed":
        return "error"
    return "xpass" if call[1] else "pass"


def _one_line(text: str, limit: int = 200) -> str:
    first = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    return first if len(first) <= limit else first[: limit - 3] + "..."
