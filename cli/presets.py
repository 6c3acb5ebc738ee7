"""Named hybrid layouts for ``--preset``. Each states what it assumes (docs/geometry.md).

The numbers are illustrative approximations of public model families, not their exact
serving configurations: block sizes follow vLLM's align-mode rule (the attention block is
grown so its page is at least the Mamba page, and the Mamba block then equals it).
"""

from __future__ import annotations

import dataclasses

from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode


@dataclasses.dataclass(frozen=True)
class PresetMemory:
    """What one GPU stores, for ``kvproof plan``'s pool sizing (illustrative, like the
    geometry): layers per group, bytes of one attention token of one layer, bytes of one
    Mamba / linear-attention state of one layer; ``note`` says where the numbers come from;
    ``tensor_parallel_size`` the GPUs they are per."""

    layers: tuple[int, ...]
    bytes_per_token: int
    bytes_per_state: int
    note: str
    #: The GPUs the bytes are per: each layer split over this many (DCP reuses them).
    tensor_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    groups: tuple[CacheGroup, ...]
    dcp: int
    max_model_len: int
    memory: PresetMemory | None = None


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
            memory=PresetMemory(
                (12, 36), 1_152, 271_360,
                "48 layers, one MLA per three linear-attention layers; MLA caches a 512 + 64 latent per "
                "token in bf16 (1,152 bytes); a linear-attention state is 4 heads (32 over TP 8) of a "
                "128 x 128 fp32 matrix plus a 9,216-byte convolution state. With vLLM's align rule "
                "(MLA kernel alignment 128) the attention block stays 256.",
                tensor_parallel_size=8,
            ),
        ),
        Preset(
            "qwen3-next",
            "Qwen3-Next-like: gated attention 544 + gated DeltaNet state 544 (align), no DCP, 256K context",
            (CacheGroup(_FA, 544), CacheGroup(_MAMBA, 544)),
            dcp=1,
            max_model_len=262_144,
            memory=PresetMemory(
                (12, 36), 2_048, 1_097_728,
                "48 layers, one gated-attention per three gated-DeltaNet layers, TP 1, bf16; attention "
                "caches 2 KV heads of 256 (2,048 bytes per token); a DeltaNet state is 32 heads of "
                "128 x 128 plus a 49,152-byte convolution state. vLLM's align rule (kernel alignment 16) "
                "gives the 544-token block of this preset.",
            ),
        ),
        Preset(
            "jamba",
            "Jamba-like: attention 16 + Mamba state without prefix caching (mode none), 256K context",
            (CacheGroup(_FA, 16), CacheGroup(_MAMBA, 16, mamba_cache_mode=MambaCacheMode.NONE)),
            dcp=1,
            max_model_len=262_144,
            memory=PresetMemory(
                (4, 28), 4_096, 573_440,
                "32 layers, one attention per seven Mamba layers, TP 1, bf16; attention caches 8 KV "
                "heads of 128 (4,096 bytes per token); a Mamba state is 8,192 x 16 fp32 plus a "
                "49,152-byte convolution state.",
            ),
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
