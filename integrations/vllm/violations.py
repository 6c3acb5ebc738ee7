"""The staging switches and what happens when a check fails.

``KVPROOF_CONTRACTS``: unset or empty = checks off; ``cheap`` = per-call checks (O(1) or
O(blocks touched)); ``slow`` = those plus whole-state checks once per scheduler step.
``KVPROOF_ON_VIOLATION``: ``raise`` (default; the engine stops with the message) or ``log``
(log the message, count it, keep serving) -- except for :data:`ALWAYS_FATAL`, the violations
after which serving on would corrupt memory or the pool's state: those stop the engine in
either mode, before the corrupting step runs.

In log mode each distinct violation is logged once, when first seen, and again with its
running count at 10, 100, 1,000, ... occurrences (a leaked block is found again at every step:
it is one violation, not one per step). Of one invariant, at most :data:`DISTINCT_LOGGED`
distinct violations are logged each in full; later ones are counted, and logged with the
invariant's running count at the same powers of ten. Counts are Prometheus counters next to
vLLM's: ``kvproof_violations_total{invariant=...}`` (distinct violations) and
``kvproof_checked_steps_total``, and from the CPU staging executor
``kvproof_content_checked_tokens_total`` (the tokens whose forward-pass reads the content oracle
checked, on every DCP rank); they reach ``/metrics`` from the engine-core process only when
``PROMETHEUS_MULTIPROC_DIR`` is set (docs/vllm.md), and a process creates them when it first
counts, so that a process that never counts (the API server) shows no counter stuck at 0.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from typing import Optional

from kvproof.integrations.vllm import stop_report
from kvproof.spec.contracts import InvariantViolation

MODES = ("cheap", "slow")
ACTIONS = ("raise", "log")

#: Violations whose continuation would corrupt memory or the block pool's state: refused (the
#: engine stops) whatever KVPROOF_ON_VIOLATION says. A write past a block-table row, or a
#: slot past it, writes out of bounds on a GPU; a double free, a free queue holding a referenced
#: block, a counter that disagrees with the queue, or a block in more rows than it has
#: references each end with one block handed to two requests.
ALWAYS_FATAL = frozenset({
    "INV-TABLE-WRITE-BOUND", "INV-SLOT-INDEX-BOUND", "INV-POOL-REF-NONNEG", "INV-POOL-FREE-IFF-UNREF",
    "INV-POOL-CONSERVE", "INV-TABLE-HELD",
})
#: Distinct violations of one invariant logged in full, each; later ones are counted.
DISTINCT_LOGGED = 10
#: What to do when an invariant stops vLLM (the last line of its output names it).
FIXES = {
    "INV-TABLE-WRITE-BOUND": "this request is longer than vLLM's block-table row holds (INV-TABLE-WIDTH at start-up says "
                             "by how much): lower --max-model-len, or use a vLLM that sizes each group's row itself",
    "INV-SLOT-INDEX-BOUND": "vLLM's block-table row is too narrow for this request: lower --max-model-len",
    "INV-POOL-REF-NONNEG": "vLLM's KV-cache manager freed a block twice; report it to vLLM with this line",
}
DEFAULT_FIX = ("a KV-cache bug in vLLM, or a case kvproof's model does not cover: report it with this line "
               "(docs/vllm.md lists what each id means); KVPROOF_ON_VIOLATION=log counts it and serves on")

# A child of vLLM's own logger, so messages go wherever vLLM's logging config sends them.
logger = logging.getLogger("vllm.kvproof")

_STEP = re.compile(r"\bstep \d+")


def contracts_mode(value: Optional[str] = None) -> Optional[str]:
    """The check tier asked for (``KVPROOF_CONTRACTS`` unless ``value`` is given): None when
    off. Raises ValueError naming a value that is neither empty, ``cheap`` nor ``slow``."""
    raw = os.environ.get("KVPROOF_CONTRACTS", "") if value is None else value
    mode = raw.strip().lower()
    if not mode:
        return None
    if mode not in MODES:
        raise ValueError(f"KVPROOF_CONTRACTS={raw!r}; expected one of {', '.join(MODES)} (or unset to turn checks off)")
    return mode


def violation_action(value: Optional[str] = None) -> str:
    """``raise`` or ``log`` (``KVPROOF_ON_VIOLATION`` unless ``value`` is given; default raise)."""
    raw = os.environ.get("KVPROOF_ON_VIOLATION", "") if value is None else value
    action = raw.strip().lower() or "raise"
    if action not in ACTIONS:
        raise ValueError(f"KVPROOF_ON_VIOLATION={raw!r}; expected one of {', '.join(ACTIONS)}")
    return action


class _Metrics:
    """The process's Prometheus counters, created on first use (a registry refuses duplicates)."""

    _instance: Optional["_Metrics"] = None
    _missing = False

    def __init__(self) -> None:
        from prometheus_client import Counter as PromCounter

        self.violations = PromCounter(
            "kvproof_violations", "distinct kvproof invariant violations found inside vLLM", ["invariant"])
        self.checked_steps = PromCounter(
            "kvproof_checked_steps", "vLLM scheduler steps checked by kvproof")
        self.content_checked_tokens = PromCounter(
            "kvproof_content_checked_tokens",
            "scheduled tokens whose forward-pass reads kvproof's content oracle checked on every DCP rank")

    @classmethod
    def get(cls) -> Optional["_Metrics"]:
        if cls._instance is None and not cls._missing:
            try:
                cls._instance = cls()
            except ImportError:  # prometheus_client comes with vLLM; without it, counts stay local
                cls._missing = True
        return cls._instance


def _is_power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


class ViolationSink:
    """Where checks report. ``report`` raises :class:`InvariantViolation` in ``raise`` mode and
    for :data:`ALWAYS_FATAL` ids (recording why for ``stop_report``), or logs and counts in
    ``log`` mode (mutates ``counts``, ``occurrences``, ``messages``)."""

    def __init__(self, action: Optional[str] = None) -> None:
        self.action = violation_action(action)
        self.counts: Counter[str] = Counter()  # distinct violations per invariant id
        self.occurrences: Counter[tuple[str, str]] = Counter()  # per distinct violation
        self.messages: list[str] = []  # each distinct violation once, first seen first

    def report(self, inv_id: str, detail: str, fix: Optional[str] = None) -> None:
        """``detail`` says where (``step N, request ...``) and what; ``fix`` what to do if it
        stops vLLM (default: :data:`FIXES`, else :data:`DEFAULT_FIX`)."""
        fatal = self.action == "raise" or inv_id in ALWAYS_FATAL
        self._count(inv_id, detail, logged=not fatal)
        if fatal:
            if self.action == "log":
                logger.error("kvproof %s: %s (always fatal: serving on would corrupt memory or the pool)", inv_id, detail)
            stop_report.record(f"{inv_id}: {detail}; to fix: {fix or FIXES.get(inv_id, DEFAULT_FIX)}")
            raise InvariantViolation(inv_id, detail)

    def _count(self, inv_id: str, detail: str, logged: bool) -> None:
        key = (inv_id, _STEP.sub("step _", detail))  # the same violation, found again at a later step
        n = self.occurrences[key] = self.occurrences[key] + 1
        if n == 1:
            self.counts[inv_id] += 1
            self.messages.append(f"{inv_id}: {detail}")
            metrics = _Metrics.get()
            if metrics is not None:
                metrics.violations.labels(invariant=inv_id).inc()
        if not logged:
            return
        distinct = self.counts[inv_id]
        if n == 1 and distinct <= DISTINCT_LOGGED:
            logger.error("kvproof %s: %s", inv_id, detail)
        elif n == 1 and _is_power_of_ten(distinct):
            logger.error("kvproof %s: %d distinct violations so far, each counted (the first %d logged); latest: %s",
                         inv_id, distinct, DISTINCT_LOGGED, detail)
        elif n > 1 and _is_power_of_ten(n) and distinct <= DISTINCT_LOGGED:
            logger.error("kvproof %s: seen %d times so far; latest: %s", inv_id, n, detail)

    def step_checked(self) -> None:
        metrics = _Metrics.get()
        if metrics is not None:
            metrics.checked_steps.inc()

    def content_checked(self, num_tokens: int) -> None:
        """The content oracle checked the reads of ``num_tokens`` scheduled tokens."""
        metrics = _Metrics.get()
        if metrics is not None and num_tokens:
            metrics.content_checked_tokens.inc(num_tokens)
