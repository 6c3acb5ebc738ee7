"""planner/reuse.py: the hash-id probe of a Mooncake trace gives exactly what the token probe
gives on the expanded requests, and the token probe says how far it looked."""

from __future__ import annotations

import json
from importlib import resources

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.planner.reuse import mooncake_reusable_fraction, reusable_fraction, workload_reuse
from kvproof.sim.mooncake import MooncakeRequest, to_trace_request
from kvproof.sim.workload import read_workload

from ..conftest import REACH_SETTINGS

UNITS = (16, 144, 256, 512, 1000)


def test_both_probes_agree_on_the_built_in_traffic():
    with resources.as_file(resources.files("kvproof.planner") / "data" / "mooncake_conversation_head1000.jsonl") as path:
        workload = read_workload(str(path))
    by_ids = workload_reuse(workload, UNITS)
    by_tokens = reusable_fraction(workload.requests(), UNITS, max_tokens=1 << 40)
    assert by_ids == by_tokens and by_ids.examined_tokens == workload.prompt_tokens
    assert 0.2 < by_ids.fractions[16] < 0.25  # real reuse, not an empty probe


@st.composite
def mooncake_requests(draw):
    """Prompts drawn from a few shared id chains, cut at any length: full and partial blocks
    that match, diverge, or stop inside an earlier prompt's block."""
    chains = draw(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=5), min_size=1, max_size=3))
    out = []
    for i in range(draw(st.integers(1, 8))):
        ids = list(draw(st.sampled_from(chains)))
        ids = ids[:draw(st.integers(1, len(ids)))] + draw(st.lists(st.integers(0, 6), max_size=2))
        length = 512 * (len(ids) - 1) + draw(st.sampled_from([1, 17, 144, 511, 512]))
        out.append(MooncakeRequest(i, 0, length, draw(st.integers(0, 3)), tuple(ids)))
    return out


@settings(max_examples=150, deadline=None, **REACH_SETTINGS)
@given(requests=mooncake_requests())
def test_the_id_probe_equals_the_token_probe(reach, requests):
    reach.minimums = {"reuse past a block": 20, "reuse inside a first block": 5, "a prompt ending inside a reused block": 5}
    by_ids = mooncake_reusable_fraction(requests, UNITS)
    by_tokens = reusable_fraction((to_trace_request(r, 0) for r in requests), UNITS, max_tokens=1 << 40)
    reused = by_ids.fractions[16] * by_ids.examined_tokens
    if reused >= 512:
        reach("reuse past a block")
    elif reused:
        reach("reuse inside a first block")
    seen: set[int] = set()
    for r in requests:
        if r.input_length % 512 and r.hash_ids[-1] in seen:
            reach("a prompt ending inside a reused block")
        seen.update(r.hash_ids)
    assert by_ids == by_tokens


def test_the_token_probe_says_where_it_stopped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": list(range(100)), "output": [1], "arrival": i}) + "\n"
                            for i in range(5)))
    workload = read_workload(str(path))
    probe = reusable_fraction(workload.requests(), (16,), max_tokens=250)
    assert probe.examined_tokens == 300  # stops after the request that reaches 250
    assert probe.fractions[16] == 2 * 96 / 300
