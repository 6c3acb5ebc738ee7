"""planner/recommend.py on measured numbers made up to show each rule: the objective picks the
choice, GPUs are counted as vLLM deploys DCP (on the TP ranks), a memory size is recommended only
where the rate has stopped rising, and the runners-up within a point are named."""

from __future__ import annotations

import pytest

from kvproof.planner.recommend import Deployment, Objective, recommend
from kvproof.planner.run import ConfigReport

GIB = 1 << 30


def report(dcp: int, gib: float, hit: float, eviction: str = "lru", violations=()) -> ConfigReport:
    prompt = 1_000_000
    return ConfigReport(
        dcp=dcp, kv_memory_bytes=int(gib * GIB), num_blocks=100, block_bytes=1, hash_block_size=16,
        cache_hit_alignment=16, requests=10, prompt_tokens=prompt, cached_tokens=round(hit * prompt),
        requests_with_hit=1, prefill_tokens=0, cow_copies=0, evictions=0, preemptions=0, steps=1,
        attention_cached_tokens=None, peak_blocks_per_group=None, table_bytes_per_group=[0], largest_request=1,
        violations=list(violations), seconds=0.0, eviction=eviction,
    )


HIT = Objective("hit-rate")
TP8 = Deployment(8)


def test_the_best_hit_rate_names_those_within_a_point():
    reports = [report(1, 40, 0.100), report(2, 40, 0.120), report(4, 40, 0.130), report(8, 40, 0.131)]
    out = recommend(reports, [], HIT, TP8)
    assert out["choice"]["dcp"] == 8 and out["choice"]["gpus"] == 8
    assert out["text"] == "hit-rate: DCP 8 on 8 GPUs, 40 GiB KV per GPU, 13.1 % hit rate; as good within a point: DCP 4 13.0 %"


def test_a_violating_or_unservable_configuration_is_never_chosen():
    reports = [report(1, 40, 0.10), report(2, 40, 0.30, violations=["INV-X"]), report(4, 40, 0.20)]
    assert recommend(reports, [], HIT, Deployment(4))["choice"]["dcp"] == 4
    # DCP reuses the TP ranks: DCP 4 cannot run on TP 2, and TP 8 does not fit 4 GPUs.
    assert recommend(reports, [], HIT, Deployment(2))["choice"]["dcp"] == 1
    out = recommend(reports, [], HIT, Deployment(8, gpu_budget=4))
    assert out["choice"] is None and "within 4 GPUs" in out["text"]
    # Bytes by hand (TP unknown): DCP d takes d GPUs at least.
    assert recommend(reports, [], HIT, Deployment(None, gpu_budget=2))["choice"]["dcp"] == 1


def test_memory_is_recommended_only_where_the_rate_stopped_rising():
    flat = [report(1, 10, 0.195), report(1, 20, 0.20), report(1, 40, 0.201)]
    out = recommend(flat[-1:], flat, HIT, TP8)
    assert out["choice"]["kv_memory_gib"] == 40 and out["text"].endswith("; 10 GiB per GPU is within a point (19.5 %)")
    assert "still rising" not in out["text"]
    rising = [report(1, 10, 0.03), report(1, 20, 0.038), report(1, 40, 0.062), report(1, 80, 0.112)]
    out = recommend(rising[-1:], rising, HIT, TP8)
    assert out["choice"]["kv_memory_gib"] == 80
    assert "still rising at 80 GiB per GPU, the largest tried: sweep larger sizes" in out["text"]


def test_per_gpu_counts_every_gpu_of_the_deployment():
    # At 8 GPUs for every DCP size, the one caching the most per GiB wins: DCP 8 here. Counting
    # DCP 1 as one GPU (as the planner once did) would have picked it.
    reports = [report(1, 40, 0.10), report(8, 40, 0.13)]
    out = recommend(reports, [], Objective("per-gpu"), TP8)
    assert out["choice"]["dcp"] == 8
    assert out["cached_tokens_per_gib"] == round(130_000 / (40 * 8), 1)
    sweep = [report(8, 10, 0.12), report(8, 40, 0.13)]
    assert recommend(reports, sweep, Objective("per-gpu"), TP8)["choice"]["kv_memory_gib"] == 10


def test_target_hit_takes_the_least_memory_that_reaches_it():
    sweep = [report(1, 10, 0.05), report(1, 40, 0.12), report(4, 10, 0.11), report(4, 40, 0.15)]
    out = recommend([sweep[1], sweep[3]], sweep, Objective.parse("target-hit=10"), TP8)
    assert (out["choice"]["dcp"], out["choice"]["kv_memory_gib"]) == (4, 10)
    out = recommend([sweep[1], sweep[3]], sweep, Objective.parse("target-hit=0.2"), TP8)
    assert out["choice"] is None and out["text"] == "no configuration reaches 20.0 %; the best is DCP 4 at 40 GiB per GPU, 15.0 %"


@pytest.mark.parametrize("text, want", [
    ("hit-rate", Objective("hit-rate")), ("per-gpu", Objective("per-gpu")),
    ("target-hit=20", Objective("target-hit", 0.2)), ("target-hit=20%", Objective("target-hit", 0.2)),
    ("target-hit=0.25", Objective("target-hit", 0.25)),
])
def test_objectives_parse(text, want):
    assert Objective.parse(text) == want


@pytest.mark.parametrize("text", ["", "best", "target-hit", "target-hit=", "target-hit=x", "target-hit=0", "target-hit=101",
                                  "target-hit=-5", "HIT-RATE"])
def test_a_bad_objective_names_the_choices(text):
    with pytest.raises(ValueError, match=r"--objective .* must be one of hit-rate, per-gpu, target-hit=X"):
        Objective.parse(text)
