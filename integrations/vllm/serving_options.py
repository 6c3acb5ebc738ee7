"""kvproof's rules as serving options: ``KVPROOF_OPTIONS``, read when vLLM's Scheduler builds
kvproof's manager (``KVPROOF_MANAGER=kvproof``, docs/vllm.md "Serving with kvproof's manager").

    KVPROOF_OPTIONS="rules=vllm"                          # stock vLLM's rule choices
    KVPROOF_OPTIONS="eviction=compute,retention=dense"    # kvproof's rules, two changed

Comma-separated ``name=value`` pairs; each is validated at start and a bad one stops the engine
with one line naming it and what was expected:

* ``rules``: ``kvproof`` (default: a key at every hash boundary the forward pass wrote) or
  ``vllm`` (vLLM 0.33.0's choices: keys only at block ends and each prompt's tail, LRU
  eviction). Options given after it override single rules.
* ``attention_keys``: ``every-hash``, ``chunk-ends`` or ``prompt-tail`` (``spec.layout.ATTENTION_KEYS``).
* ``eviction``: ``lru`` or ``compute`` (``spec.eviction.POLICIES``).
* ``checkpoints``: ``vllm`` or ``reuse`` (``spec.checkpoints.CHECKPOINT_POLICIES``): where Mamba
  states are made and kept. ``reuse`` adds each prompt's turn-end ladder: vLLM's Scheduler then
  ends chunks at its rungs too (``kvproof_scheduler``) and the manager keeps their states.
* ``retention``: ``dense`` (every Mamba / sliding-window chunk-end state stays cached), or an
  int K >= 0 (vLLM's ``prefix_cache_retention_interval``); default: what vLLM was configured with.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from kvproof.spec.checkpoints import CHECKPOINT_POLICIES, VLLM
from kvproof.spec.eviction import LRU, POLICIES
from kvproof.spec.layout import ATTENTION_KEYS

ENV = "KVPROOF_OPTIONS"

#: The rule sets ``rules=`` selects: the LayoutConfig fields each fixes.
RULE_SETS = {
    "kvproof": {"attention_keys": "every-hash", "eviction": LRU, "checkpoints": VLLM},
    "vllm": {"attention_keys": "prompt-tail", "eviction": LRU, "checkpoints": VLLM},
}

_UNSET = object()


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """The LayoutConfig choices an operator made. ``retention`` unset: keep vLLM's value."""

    rules: str = "kvproof"
    attention_keys: str = RULE_SETS["kvproof"]["attention_keys"]
    eviction: str = RULE_SETS["kvproof"]["eviction"]
    checkpoints: str = RULE_SETS["kvproof"]["checkpoints"]
    retention: object = _UNSET

    def retention_interval(self, configured: Optional[int]) -> Optional[int]:
        """The retention interval to serve with, given vLLM's configured one."""
        return configured if self.retention is _UNSET else self.retention


def parse(text: Optional[str]) -> ServingOptions:
    """``KVPROOF_OPTIONS``'s value (None or empty: the defaults). Raises ValueError naming the
    first bad pair. Pure."""
    fields: dict = {}
    for pair in (text or "").split(","):
        pair = pair.strip()
        if not pair:
            continue
        name, sep, value = pair.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"{ENV}: {pair!r} must be name=value")
        if name == "rules":
            if value not in RULE_SETS:
                raise ValueError(f"{ENV}: rules={value!r} must be one of {', '.join(RULE_SETS)}")
            fields.update(RULE_SETS[value], rules=value)
        elif name == "attention_keys":
            fields[name] = _one_of(name, value, ATTENTION_KEYS)
        elif name == "eviction":
            fields[name] = _one_of(name, value, POLICIES)
        elif name == "checkpoints":
            fields[name] = _one_of(name, value, CHECKPOINT_POLICIES)
        elif name == "retention":
            fields[name] = _retention(value)
        else:
            raise ValueError(f"{ENV}: unknown option {name!r}; expected rules, attention_keys, eviction, checkpoints or retention")
    return ServingOptions(**fields)


def from_environment() -> ServingOptions:
    return parse(os.environ.get(ENV))


def _one_of(name: str, value: str, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"{ENV}: {name}={value!r} must be one of {', '.join(allowed)}")
    return value


def _retention(value: str) -> Optional[int]:
    if value == "dense":
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV}: retention={value!r} must be 'dense' or an int >= 0")
    return int(value)
