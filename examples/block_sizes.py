"""The worked example of docs/glossary.md: the kimi-k3 preset's groups at DCP 8, its four block
sizes, and where a 1,000-token prompt's positions land (every number from the spec's own rules).

    python examples/block_sizes.py
"""

from kvproof.cli.presets import PRESETS
from kvproof.impl.request import Request
from kvproof.spec.arith import cdiv
from kvproof.spec.layout import LayoutConfig, resolve_layout
from kvproof.spec.placement import local_position, owner_rank, table_index

preset = PRESETS["kimi-k3"]
layout = resolve_layout(LayoutConfig(preset.groups, dcp=8, max_model_len=preset.max_model_len))
mla, mamba = layout.groups
print("per-rank block sizes bs_g", [g.group.block_size for g in layout.groups])
print("effective block sizes B_g", [g.effective_block_size for g in layout.groups])
print("scheduler block size S", layout.scheduler_block_size, "hash block size H", layout.hash_block_size,
      "cache-hit alignment A", layout.cache_hit_alignment)
prompt = Request("example", list(range(1000)), layout.hash_block_size)
print("1,000-token prompt: block hashes", len(prompt.block_hashes), "hashed tokens", prompt.hashed_len)
print("row entries: mla", cdiv(1000, mla.effective_block_size), "mamba", cdiv(1000, mamba.effective_block_size))
bs, dcp, il = mla.group.block_size, layout.dcp, layout.config.interleave
print("position 999: mla row entry", table_index(999, bs, dcp, True), "owner rank", owner_rank(999, dcp, il),
      "slot", local_position(999, bs, dcp, il), "| mamba row entry", table_index(999, mamba.group.block_size, dcp, False))
print("EAGLE unit of the mla group", layout.eagle_unit(mla))
