"""Shared geometry for the e2e tests. Every test here needs torch; the DCP > 1 ones spawn
gloo ranks on loopback (a fork server is started once per test process, about 3 s)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvproof.cli.layout_args import parse_group  # noqa: E402
from kvproof.spec.layout import LayoutConfig  # noqa: E402

#: Attention 4 + Mamba 8 with hash block 2: partial hits inside attention blocks at every DCP
#: size tried (the attention virtual block is 4, 8, 16 tokens at DCP 1, 2, 4).
HYBRID = ("full_attention:4", "mamba:8")


def layout_config(groups=HYBRID, dcp: int = 1, max_model_len: int = 128, hash_block_size=2, interleave: int = 1):
    """Dense retention: every chunk end keeps its state, so the workload reaches decode-state
    hits (``d``) as well as prompt checkpoints."""
    return LayoutConfig(
        groups=tuple(parse_group(g) for g in groups), dcp=dcp, max_model_len=max_model_len,
        hash_block_size=hash_block_size, interleave=interleave, retention_interval=None,
    )
