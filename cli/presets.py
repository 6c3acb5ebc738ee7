"""Named hybrid layouts for ``--preset``. Each states what it assumes (docs/geometry.md).

The numbers are illustrative approximations of public model families, not their exact
serving configurations: block sizes follow vLLM's align-mode rule (the attention block is
grown so its page is at least the Mamba page, and the Mamba block then equals it).
"""

from __future__ import annotations

import dataclasses

from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    groups: tuple[CacheGroup, ...]
    dcp: int
    max_model_len: int


_FA, _MLA, _SWA, _MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "seed-bug-1m",
            "the upstream bug's geometry: full attention 1536 + Mamba 16 (align), DCP 8, 1M context",
            (CacheGroup(_FA, 1536), CacheGroup(_MAMBA, 16)),
            dcp=8,
            max_model_len=1_048_576,
        ),
        Preset(
            "kimi-k3",
            "Kimi-K3-like: MLA 256 + linear-attention state 256 (align), DCP 2, 256K context",
            (CacheGroup(_MLA, 256), CacheGroup(_MAMBA, 256)),
            dcp=2,
            max_model_len=262_144,
        ),
        Preset(
            "qwen3-next",
            "Qwen3-Next-like: gated attention 544 + gated DeltaNet state 544 (align), no DCP, 256K context",
            (CacheGroup(_FA, 544), CacheGroup(_MAMBA, 544)),
            dcp=1,
            max_model_len=262_144,
        ),
        Preset(
            "jamba",
            "Jamba-like: attention 16 + Mamba state without prefix caching (mode none), 256K context",
            (CacheGroup(_FA, 16), CacheGroup(_MAMBA, 16, mamba_cache_mode=MambaCacheMode.NONE)),
            dcp=1,
            max_model_len=262_144,
        ),
        Preset(
            "hymba",
            "Hymba-like: global attention 16 + replicated sliding window 64 + Mamba 64, DCP 2 "
            "(the window group forces block-aligned hits)",
            (
                CacheGroup(_FA, 16),
                CacheGroup(_SWA, 64, dcp_sharded=False, sliding_window=1024),
                CacheGroup(_MAMBA, 64),
            ),
            dcp=2,
            max_model_len=32_768,
        ),
    )
}

DEFAULT_PRESET = "seed-bug-1m"
