"""Remedies, tested: a diagnosis that names flags to change is replayed with each of them, and
with their combinations, at its DCP size in the same pool; only a remedy that raised the hit rate
is offered, with the gain it measured, and a combination only when it beats each of its parts
(docs/plan.md, "Recommendations and diagnoses").

A remedy is a set of layout changes, each spelled as the flag that makes it. The candidates per
diagnosis are the changes its cause names; a change already in the plan's layout is not tried.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from kvproof.planner.diagnose import Diagnosis
from kvproof.planner.run import ConfigReport
from kvproof.spec.layout import LayoutConfig, resolve_layout

#: A remedy is offered when it raised the hit rate by at least this much (a fraction), and a
#: combination when it beat each remedy made of its parts by as much.
MIN_GAIN = 0.001


@dataclasses.dataclass(frozen=True)
class Change:
    flag: str  # as the operator types it
    field: str  # the LayoutConfig field it sets
    value: object


@dataclasses.dataclass(frozen=True)
class Remedy:
    changes: tuple[Change, ...]

    @property
    def flags(self) -> str:
        return " ".join(c.flag for c in self.changes)

    def apply(self, config: LayoutConfig) -> LayoutConfig:
        return dataclasses.replace(config, **{c.field: c.value for c in self.changes})


@dataclasses.dataclass(frozen=True)
class Trial:
    """One remedy replayed for one diagnosis."""

    diagnosis: Diagnosis
    remedy: Remedy
    before: ConfigReport
    after: ConfigReport

    @property
    def gain(self) -> float:
        return self.after.hit_rate - self.before.hit_rate


def _changes(diagnosis: Diagnosis, config: LayoutConfig, fine_unit: int) -> list[Change]:
    """The changes ``diagnosis``'s cause names that ``config`` does not have yet."""
    keep_states = Change("--retention-interval none", "retention_interval", None)
    checkpoint = Change("--shared-prefix-checkpoint", "shared_prefix_checkpoint", True)
    finer = Change(f"--hash-block-size {fine_unit}", "hash_block_size", fine_unit)
    named = {
        "mamba-checkpoint-cliff": [keep_states, checkpoint],
        "hash-unit-too-coarse": [finer, checkpoint],
    }.get(diagnosis.id, [])
    return [c for c in named if getattr(config, c.field) != c.value]


def candidates(diagnosis: Diagnosis, config: LayoutConfig, fine_unit: int) -> list[Remedy]:
    """Each change alone, then every combination of them; those whose layout does not resolve at
    the diagnosis's DCP size (a hash unit the geometry refuses) are left out."""
    changes = _changes(diagnosis, config, fine_unit)
    out = []
    for n in range(1, len(changes) + 1):
        for combo in itertools.combinations(changes, n):
            remedy = Remedy(combo)
            try:
                resolve_layout(dataclasses.replace(remedy.apply(config), dcp=diagnosis.dcp))
            except ValueError:
                continue
            out.append(remedy)
    return out


def offered(trials: list[Trial]) -> list[Trial]:
    """The trials worth offering, the best first: each raised the hit rate by MIN_GAIN, and beat
    by MIN_GAIN every trial whose changes are a part of its own."""
    def parts(t: Trial) -> list[Trial]:
        return [o for o in trials if o is not t and set(o.remedy.changes) < set(t.remedy.changes)]

    good = [t for t in trials if t.gain >= MIN_GAIN
            and all(t.after.hit_rate - o.after.hit_rate >= MIN_GAIN for o in parts(t))]
    return sorted(good, key=lambda t: -t.gain)


def summary(trials: list[Trial]) -> Optional[str]:
    """The measured remedies of one diagnosis as one clause; None when none was tried. A remedy
    that did not help is not offered (the clause says so)."""
    if not trials:
        return None
    helped = offered(trials)
    if not helped:
        return f"replayed, no remedy helps (tried: {', '.join(t.remedy.flags for t in trials)})"
    return "replayed: " + "; ".join(
        f"{t.remedy.flags} -> {100 * t.after.hit_rate:.1f} % (+{100 * t.gain:.1f} points)" for t in helped)


def to_json(trials: list[Trial]) -> list[dict]:
    helped = offered(trials)
    return [{"flags": t.remedy.flags, "hit_rate": round(t.after.hit_rate, 6), "gain": round(t.gain, 6),
             "offered": t in helped} for t in trials]
