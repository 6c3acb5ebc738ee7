"""Single-type managers: one per cache group, each knowing how its kind of cache is looked up,
allocated, cached and freed. ``MANAGER_FOR_KIND`` maps a group kind to its class."""

from __future__ import annotations

from kvproof.impl.managers.base import SingleTypeManager, StepLedger
from kvproof.impl.managers.full_attention import FullAttentionManager
from kvproof.impl.managers.mamba import MambaManager
from kvproof.impl.managers.sliding_window import SlidingWindowManager
from kvproof.spec.groups import GroupKind

MANAGER_FOR_KIND = {
    GroupKind.FULL_ATTENTION: FullAttentionManager,
    GroupKind.MLA: FullAttentionManager,
    GroupKind.SLIDING_WINDOW: SlidingWindowManager,
    GroupKind.MAMBA: MambaManager,
}

__all__ = ["SingleTypeManager", "StepLedger", "FullAttentionManager", "MambaManager", "SlidingWindowManager", "MANAGER_FOR_KIND"]
