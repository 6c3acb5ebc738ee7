"""The whole Mooncake conversation trace (12,031 requests, 145 M prompt tokens) through
``kvproof plan``: one attention group of 512-token blocks, DCP 1, a pool too large to evict.
Its hit rate must equal what the trace's hash ids allow, computed here from the ids alone.

The trace is shared material, not part of the repository (``../shared/traces/mooncake`` beside
the checkout, or ``KVPROOF_MOONCAKE_TRACE``); the test is skipped without it. Requests are
replayed one after another (timestamps respaced so none overlaps the next) with one output
token each: the bound assumes every earlier prompt is cached when a request looks up, and
outputs are fresh tokens that no later prompt contains, so they cannot change a hit.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE = pathlib.Path(os.environ.get("KVPROOF_MOONCAKE_TRACE", ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"))
BLOCK = 512

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TRACE.is_file(), reason=f"shared trace not found at {TRACE}")]


def id_bound(records: list[dict]) -> tuple[int, int, float]:
    """(reusable prompt tokens, prompt tokens, share of prompt blocks that are a reused prefix)
    with an unbounded cache. A prefix is reusable as far as its chain of *full* 512-token ids
    equals a chain of full ids some earlier request had (a partial last block never completes
    a cached block); a hit leaves at least one token to compute."""
    chains: dict[tuple[int, int], int] = {}  # (parent chain, id) -> chain number
    all_blocks: set[tuple[int, int]] = set()  # the README's count: every id, partial ones too
    reused = total = blocks_reused = blocks_total = 0
    for rec in records:
        ids, n = rec["hash_ids"], rec["input_length"]
        total += n
        full = n // BLOCK
        parent, hit, matching = -1, 0, True
        for j in range(full):
            key = (parent, ids[j])
            known = chains.get(key)
            if matching and known is not None and BLOCK * (j + 1) <= n - 1:
                hit = BLOCK * (j + 1)
            elif known is None:
                matching = False
            parent = known if known is not None else chains.setdefault(key, len(chains))
        reused += hit
        parent, matching = -1, True
        for i in ids:
            key = (parent, i)
            blocks_total += 1
            if matching and key in all_blocks:
                blocks_reused += 1
            else:
                matching = False
            all_blocks.add(key)
            parent = hash(key)
    return reused, total, blocks_reused / blocks_total


def test_full_trace_hit_rate_equals_the_id_bound(tmp_path, plan_json):
    records = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    assert len(records) == 12_031
    reused, total, block_share = id_bound(records)
    assert round(block_share, 3) == 0.366  # the trace README's block-level figure
    sequential = tmp_path / "sequential.jsonl"
    sequential.write_text("".join(
        json.dumps({**rec, "timestamp": 1_000_000 * i, "output_length": 1}) + "\n" for i, rec in enumerate(records)
    ))
    data = plan_json(
        "--trace", str(sequential), "--step-ms", "1", "--group", "full_attention:512", "--dcp", "1",
        "--max-model-len", "131072", "--num-blocks", "320000", "--jobs", "1",
    )
    (c,) = data["configs"]
    assert c["violations"] == [] and c["evictions"] == 0 and c["requests"] == 12_031
    assert (c["prompt_tokens"], c["cached_tokens"]) == (total, reused)
    assert c["hit_rate"] == pytest.approx(reused / total, abs=1e-6)
