"""Diagnoses: what the measured configurations mean, each with its reason in words (the
recommendation is planner/recommend.py). Every diagnosis is a rule over measured numbers or
the geometry; the thresholds are named below so the docs can quote them."""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvproof.planner.memory import ModelMemory, vllm_attention_block_size
from kvproof.planner.run import ConfigReport
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout

#: The Mamba-checkpoint cliff: the joint hit rate is below this share of what attention alone
#: could restore, and at least MIN_GAP lower in absolute terms.
CLIFF_SHARE = 0.5
MIN_GAP = 0.01
#: Prompts too short to ever hit: flagged when at least this share of requests are.
SHORT_PROMPT_SHARE = 0.05
#: Block tables: flagged when they take at least this share of the KV memory.
TABLE_SHARE = 0.01
#: Hash unit too coarse: the fine-grained reuse exceeds the coarse by this much, absolute and
#: relative.
COARSE_GAP = 0.02
COARSE_RELATIVE = 0.10


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    id: str
    message: str
    #: The DCP size it was measured at (None: it holds for every size).
    dcp: Optional[int] = None
    #: Its remedies as replayed (``planner/remedies.py``), JSON-ready.
    remedies: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        out = {"id": self.id, "message": self.message}
        if self.remedies:
            out["remedies"] = list(self.remedies)
        return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def diagnose(
    layouts: dict[int, Layout],
    reports: list[ConfigReport],
    prompt_lengths: list[int],
    max_num_seqs: int,
    memory: Optional[ModelMemory],
    reuse: Optional[dict[int, float]] = None,
) -> list[Diagnosis]:
    """Every diagnosis that applies. ``layouts`` maps each DCP size to its (user-level)
    layout; ``reuse`` maps granularities to the reuse fraction (:mod:`kvproof.planner.reuse`)."""
    out: list[Diagnosis] = []
    any_layout = next(iter(layouts.values()))
    max_len = any_layout.config.max_model_len
    n = len(prompt_lengths)

    for r in reports:
        if r.largest_request < max_len:
            out.append(Diagnosis(
                "pool-below-max-model-len",
                f"DCP {r.dcp}: the pool ({r.num_blocks:,} blocks of {r.block_bytes / 2**20:.2f} MiB) holds one request "
                f"of at most {r.largest_request:,} tokens, below max-model-len {max_len:,}: vLLM refuses to start with "
                "this memory (or shortens max-model-len when asked to fit it); raise the KV memory or lower max-model-len",
            ))
        kv_bytes = r.num_blocks * r.block_bytes
        tables = sum(r.table_bytes_per_group)
        if kv_bytes and tables >= TABLE_SHARE * kv_bytes:
            out.append(Diagnosis(
                "block-tables-large",
                f"DCP {r.dcp}: the block tables take {tables / 2**20:,.1f} MiB per GPU ({_pct(tables / kv_bytes)} of the KV "
                f"memory): every one of the {max_num_seqs} request slots reserves a row wide enough for max-model-len "
                f"{max_len:,}; small blocks in a replicated group make rows long",
            ))

    hybrid = any(g.group.kind is GroupKind.MAMBA and g.group.prefix_cacheable for g in any_layout.groups)
    if hybrid:
        for r in reports:
            if r.attention_hit_rate is not None and r.attention_hit_rate - r.hit_rate >= MIN_GAP and r.hit_rate < CLIFF_SHARE * r.attention_hit_rate:
                retention = any_layout.config.retention_interval
                out.append(Diagnosis(
                    "mamba-checkpoint-cliff",
                    f"DCP {r.dcp}: hit rate {_pct(r.hit_rate)} although the attention groups alone could restore "
                    f"{_pct(r.attention_hit_rate)}: a hit needs a Mamba state at exactly its length, and the states kept "
                    f"(retention {'none' if retention is None else retention}) sit where chunks ended, inside request-unique "
                    "tokens rather than at the shared prefix's end (vllm#45238)", r.dcp,
                ))

    for dcp, layout in sorted(layouts.items()):
        a = layout.cache_hit_alignment
        short = sum(1 for p in prompt_lengths if p <= a)
        if n and short / n >= SHORT_PROMPT_SHARE:
            out.append(Diagnosis(
                "prompts-below-hit-unit",
                f"DCP {dcp}: {short:,} of {n:,} prompts ({_pct(short / n)}) are at most {a:,} tokens, the unit hits land "
                "on, so they can never hit (a hit must leave one token to compute)",
            ))
        s = layout.scheduler_block_size
        if layout.config.max_model_len < s:
            out.append(Diagnosis(
                "max-model-len-below-block",
                f"DCP {dcp}: max-model-len {layout.config.max_model_len:,} is below the scheduler block of {s:,} tokens: "
                "no request ever fills a whole block of every group, so no full-block key is ever written and "
                "block-aligned hits cannot happen (vllm#48401)",
            ))
        if layout.partial.warning:
            out.append(Diagnosis(
                "partial-hits-off",
                f"DCP {dcp}: hits land on whole scheduler blocks ({s:,} tokens), not on the hash unit "
                f"({layout.hash_block_size:,}): {layout.partial.warning}",
            ))

    if memory is not None:
        out += auto_raised_blocks(any_layout, memory, prompt_lengths)

    if reuse:
        fine = min(reuse)
        for dcp, layout in sorted(layouts.items()):
            coarse = layout.cache_hit_alignment
            if coarse in reuse and coarse != fine:
                gap = reuse[fine] - reuse[coarse]
                if gap >= COARSE_GAP and gap >= COARSE_RELATIVE * reuse[fine]:
                    out.append(Diagnosis(
                        "hash-unit-too-coarse",
                        f"DCP {dcp}: hits land on multiples of {coarse:,} tokens; with an unbounded cache the traffic "
                        f"allows {_pct(reuse[fine])} reuse in {fine}-token steps but only {_pct(reuse[coarse])} in "
                        f"{coarse:,}-token steps: its shared prefixes end between hit boundaries", dcp,
                    ))
    return out


def auto_raised_blocks(layout: Layout, memory: ModelMemory, prompt_lengths: list[int]) -> list[Diagnosis]:
    """``auto-raised-block-size`` for each attention group of ``layout`` whose block vLLM would
    grow, next to any Mamba page (align or not: one page size), to hold a Mamba state."""
    out = []
    n = len(prompt_lengths)
    mamba = [g for g in layout.groups if g.group.kind is GroupKind.MAMBA]
    for g in layout.groups:
        if not g.group.kind.is_attention or not mamba:
            continue
        raised = vllm_attention_block_size(g.group, memory, memory.bytes_per_state)
        if raised > g.group.block_size:
            shorter = sum(1 for p in prompt_lengths if p <= raised)
            out.append(Diagnosis(
                "auto-raised-block-size",
                f"group {g.index} ({g.group.label}): vLLM would raise this attention block to {raised:,} tokens so its "
                f"page ({memory.bytes_per_token:,} bytes per token) holds a Mamba state of {memory.bytes_per_state:,} "
                f"bytes (vllm#40696); then {shorter:,} of {n:,} prompts ({_pct(shorter / n) if n else '0 %'}) are no "
                "longer than one block and never hit; the plan above uses the block sizes as given",
            ))
    return out
