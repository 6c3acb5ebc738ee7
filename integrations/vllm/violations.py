"""The staging switches and what happens when a check fails.

``KVPROOF_CONTRACTS``: unset or empty = checks off; ``cheap`` = per-call checks (O(1) or
O(blocks touched)); ``slow`` = those plus whole-state checks once per scheduler step.
``KVPROOF_ON_VIOLATION``: ``raise`` (default; the engine stops with the message) or ``log``
(log the message, count it, keep serving). Counts are Prometheus counters next to vLLM's:
``kvproof_violations_total{invariant=...}`` and ``kvproof_checked_steps_total`` (they reach
``/metrics`` from the engine-core process when ``PROMETHEUS_MULTIPROC_DIR`` is set, as in any
multi-process vLLM deployment; docs/vllm.md).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Optional

from kvproof.spec.contracts import InvariantViolation

MODES = ("cheap", "slow")
ACTIONS = ("raise", "log")

# A child of vLLM's own logger, so messages go wherever vLLM's logging config sends them.
logger = logging.getLogger("vllm.kvproof")


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
    """The process's Prometheus counters, created once (a registry refuses duplicates)."""

    _instance: Optional["_Metrics"] = None

    def __init__(self) -> None:
        from prometheus_client import Counter as PromCounter

        self.violations = PromCounter(
            "kvproof_violations", "kvproof invariant violations found inside vLLM", ["invariant"])
        self.checked_steps = PromCounter(
            "kvproof_checked_steps", "vLLM scheduler steps checked by kvproof")

    @classmethod
    def get(cls) -> Optional["_Metrics"]:
        if cls._instance is None:
            try:
                cls._instance = cls()
            except ImportError:  # prometheus_client comes with vLLM; without it, counts stay local
                return None
        return cls._instance


class ViolationSink:
    """Where checks report. ``report`` raises :class:`InvariantViolation` in ``raise`` mode, or
    logs and counts in ``log`` mode (mutates ``counts``)."""

    def __init__(self, action: Optional[str] = None) -> None:
        self.action = violation_action(action)
        self.counts: Counter[str] = Counter()
        self.messages: list[str] = []
        self._metrics = _Metrics.get()

    def report(self, inv_id: str, detail: str) -> None:
        if self.action == "raise":
            raise InvariantViolation(inv_id, detail)
        self.counts[inv_id] += 1
        self.messages.append(f"{inv_id}: {detail}")
        logger.error("kvproof %s: %s", inv_id, detail)
        if self._metrics is not None:
            self._metrics.violations.labels(invariant=inv_id).inc()

    def step_checked(self) -> None:
        if self._metrics is not None:
            self._metrics.checked_steps.inc()
