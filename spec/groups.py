"""KV-cache group specifications: what one cache group is, independent of DCP.

A *group* is one kind of layer cache with one physical block size (tokens per block on one
rank). Full attention, MLA and sliding window are attention caches: DCP shards their token
positions across ranks by default. Mamba (and linear-attention) state is replicated on every
rank. Nothing here depends on the DCP size; :mod:`kvproof.spec.geometry` combines groups with
it.
"""

from __future__ import annotations

import dataclasses
import enum


class GroupKind(str, enum.Enum):
    FULL_ATTENTION = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"

    @property
    def is_attention(self) -> bool:
        return self is not GroupKind.MAMBA

    @property
    def supports_fine_grained_lookup(self) -> bool:
        """Whether a hit may end inside one of this kind's blocks at a hash boundary.

        Full attention / MLA: their KV is append-only, so a block holding a longer prefix also
        holds every shorter one. Mamba (align mode): a state summarises exactly one prefix
        length, and such states can be keyed at any hash boundary. Sliding window needs a
        contiguous window of whole blocks, so its hits are block-aligned.
        """
        return self is not GroupKind.SLIDING_WINDOW


class MambaCacheMode(str, enum.Enum):
    #: States are kept at block-aligned (and hash-aligned) positions: prefix-cacheable.
    ALIGN = "align"
    #: One running state per request: nothing is prefix-cacheable.
    NONE = "none"


KIND_NAMES = tuple(k.value for k in GroupKind)
MAMBA_MODE_NAMES = tuple(m.value for m in MambaCacheMode)


def parse_kind(name: str) -> GroupKind:
    """The :class:`GroupKind` named ``name``; ``ValueError`` naming the choices otherwise."""
    try:
        return GroupKind(name)
    except ValueError:
        raise ValueError(f"unknown group kind {name!r}; expected one of {', '.join(KIND_NAMES)}") from None


def parse_mamba_mode(name: str) -> MambaCacheMode:
    try:
        return MambaCacheMode(name)
    except ValueError:
        raise ValueError(f"unknown mamba cache mode {name!r}; expected one of {', '.join(MAMBA_MODE_NAMES)}") from None


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group (immutable).

    ``block_size`` is the physical block size on one rank, in tokens. ``dcp_sharded`` is
    ``None`` for the kind's default: attention kinds are sharded, Mamba is replicated.
    ``mamba_cache_mode`` and ``num_speculative_blocks`` only mean something for Mamba.
    ``token_alignment`` pads the block-table width (128 for attention; ``None`` for Mamba).
    ``sliding_window`` (tokens, >= 1) is required for a sliding-window group and refused for
    every other kind.
    """

    kind: GroupKind
    block_size: int
    dcp_sharded: bool | None = None
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN
    num_speculative_blocks: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        # Bad input is a ValueError naming the value (never a contract violation): groups are
        # built from user flags.
        if not isinstance(self.kind, GroupKind):
            object.__setattr__(self, "kind", parse_kind(str(self.kind)))
        if not isinstance(self.mamba_cache_mode, MambaCacheMode):
            object.__setattr__(self, "mamba_cache_mode", parse_mamba_mode(str(self.mamba_cache_mode)))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block size {self.block_size!r} of a {self.kind.value} group must be a positive integer")
        if not isinstance(self.num_speculative_blocks, int) or self.num_speculative_blocks < 0:
            raise ValueError(
                f"num_speculative_blocks {self.num_speculative_blocks!r} must be a non-negative integer"
            )
        window = self.sliding_window
        if self.kind is GroupKind.SLIDING_WINDOW:
            # No default window: capacity, the manager and vLLM's spec all read it.
            if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
                raise ValueError(
                    f"sliding window {window!r} of a sliding_window group must be a positive integer number of tokens"
                )
        elif window is not None:
            raise ValueError(f"sliding_window given for a {self.kind.value} group; only sliding_window groups have one")

    @property
    def is_sharded(self) -> bool:
        """Whether DCP shards this group's token positions across ranks."""
        if self.dcp_sharded is None:
            return self.kind.is_attention
        return self.dcp_sharded

    @property
    def prefix_cacheable(self) -> bool:
        """Mamba in mode ``none`` keeps only a running state, which no other request can reuse."""
        return not (self.kind is GroupKind.MAMBA and self.mamba_cache_mode is MambaCacheMode.NONE)

    @property
    def token_alignment(self) -> int | None:
        return None if self.kind is GroupKind.MAMBA else 128

    @property
    def label(self) -> str:
        return f"{self.kind.value}:{self.block_size}"
