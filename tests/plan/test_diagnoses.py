"""Each diagnosis fires on a workload built to show its cliff, and stays quiet on one that does
not; the recommendation names the measured best."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def plan(tmp_path, plan_json):
    """Plan a kvproof-format trace of ``prompts`` (arriving 50 steps apart, 3 outputs each)."""
    def run(prompts, *argv):
        path = tmp_path / "t.jsonl"
        path.write_text("".join(
            json.dumps({"id": f"r{i}", "prompt": p, "output": [9000 + 10 * i, 9001 + 10 * i, 9002 + 10 * i], "arrival": 50 * i}) + "\n"
            for i, p in enumerate(prompts)
        ))
        return plan_json("--trace", str(path), *argv, "--jobs", "1")

    return run


def ids(data) -> set[str]:
    return {d["id"] for d in data["diagnoses"]}


FA_M = ["--group", "full_attention:16", "--group", "mamba:64", "--max-model-len", "4096", "--num-blocks", "600"]


def pairs(n: int, shared_len: int) -> list[list[int]]:
    """n prefixes, each used by exactly two prompts that then diverge."""
    out = []
    for k in range(n):
        shared = list(range(k * 1000, k * 1000 + shared_len))
        out += [shared + list(range(500_000 + 200 * k, 500_000 + 200 * k + 50)), shared + list(range(700_000 + 200 * k, 700_000 + 200 * k + 60))]
    return out


def test_mamba_checkpoint_cliff(plan):
    # The second of each pair could take 96 tokens from attention, but no Mamba state sits at
    # or below 96: the first prompt's chunks ended at 128 and at its end.
    data = plan(pairs(6, 96), *FA_M, "--dcp", "1")
    (c,) = data["configs"]
    assert c["attention_hit_rate"] > 0.25 and c["hit_rate"] < 0.5 * c["attention_hit_rate"]
    assert "mamba-checkpoint-cliff" in ids(data)
    # The same pairs sharing 128 tokens (a Mamba block end): the state is there, no cliff.
    data = plan(pairs(6, 128), *FA_M, "--dcp", "1")
    assert data["configs"][0]["hit_rate"] > 0.3 and "mamba-checkpoint-cliff" not in ids(data)


def test_prompts_below_the_hit_unit(plan):
    short = [[i, i + 1, i + 2] for i in range(0, 60, 3)]
    data = plan(short + pairs(2, 128), *FA_M, "--dcp", "1")
    assert "prompts-below-hit-unit" in ids(data)
    assert "prompts-below-hit-unit" not in ids(plan(pairs(4, 128), *FA_M, "--dcp", "1"))


def test_max_model_len_below_the_block(plan):
    argv = ["--group", "full_attention:16", "--group", "mamba:64", "--num-blocks", "500", "--dcp", "1"]
    prompts = [list(range(30)) + [100 + i] for i in range(5)]
    assert "max-model-len-below-block" in ids(plan(prompts, *argv, "--max-model-len", "48"))
    assert "max-model-len-below-block" not in ids(plan(prompts, *argv, "--max-model-len", "64"))


def test_partial_hits_off_and_auto_raised_block(plan):
    hymba = ["--group", "full_attention:16", "--group", "sliding_window:64:replicated:window=256", "--group", "mamba:64",
             "--max-model-len", "4096", "--num-blocks", "600", "--dcp", "2"]
    assert "partial-hits-off" in ids(plan(pairs(2, 128), *hymba))
    assert "partial-hits-off" not in ids(plan(pairs(2, 128), *FA_M, "--dcp", "2"))
    mem = ["--group", "full_attention:16", "--group", "mamba:16", "--max-model-len", "4096", "--dcp", "1",
           "--bytes-per-token", "256", "--layers", "1,1", "--kv-memory-gib", "0.1"]
    raised = plan(pairs(2, 128), *mem, "--bytes-per-state", "40000")
    (d,) = [d for d in raised["diagnoses"] if d["id"] == "auto-raised-block-size"]
    assert "to 160 tokens" in d["message"]  # 16 x cdiv(40,000, 16 x 256)
    assert "auto-raised-block-size" not in ids(plan(pairs(2, 128), *mem, "--bytes-per-state", "4096"))


def test_hash_unit_too_coarse(plan):
    coarse = ["--group", "full_attention:256", "--max-model-len", "4096", "--num-blocks", "200", "--dcp", "1"]
    assert "hash-unit-too-coarse" in ids(plan(pairs(5, 200), *coarse))
    assert "hash-unit-too-coarse" not in ids(plan(pairs(5, 512), *coarse))


def test_pool_and_tables_against_max_model_len(plan):
    argv = ["--group", "full_attention:16", "--group", "mamba:16", "--dcp", "1", "--bytes-per-token", "256",
            "--bytes-per-state", "4096", "--layers", "1,1"]
    small = plan(pairs(2, 64), *argv, "--max-model-len", "1048576", "--kv-memory-gib", "0.25")
    assert {"pool-below-max-model-len", "block-tables-large"} <= ids(small)
    assert small["configs"][0]["largest_request"] < 1048576
    roomy = plan(pairs(2, 64), *argv, "--max-model-len", "4096", "--kv-memory-gib", "0.25")
    assert not {"pool-below-max-model-len", "block-tables-large"} & ids(roomy)


def test_recommendation_names_the_measured_best(plan):
    data = plan(pairs(4, 100), *FA_M, "--dcp", "1,2,4")
    best = max(data["configs"], key=lambda c: (c["hit_rate"], -c["dcp"]))
    choice = data["recommendation"]["choice"]
    assert (choice["dcp"], choice["hit_rate"]) == (best["dcp"], best["hit_rate"])
    assert data["recommendation"]["text"].startswith(f"hit-rate: DCP {best['dcp']} on {best['dcp']} GPU")
    assert f"--decode-context-parallel-size {best['dcp']}" in data["recommendation"]["serve"] or best["dcp"] == 1


@pytest.mark.parametrize("dcp", ["1", "8"])
def test_real_traffic_shows_no_false_cliff(plan_json, dcp):
    found = ids(plan_json("--limit", "60", "--dcp", dcp, "--kv-memory-gib", "400"))
    assert not found & {"hash-unit-too-coarse", "max-model-len-below-block", "partial-hits-off", "auto-raised-block-size"}


def _remedies(data, diagnosis_id):
    (d,) = [d for d in data["diagnoses"] if d["id"] == diagnosis_id]
    return d, {r["flags"]: r for r in d["remedies"]}


def test_remedies_are_replayed_and_only_those_that_help_are_offered(plan_json):
    """On real traffic the cliff's remedies are replayed: keeping every state helps, and its hit
    rate is what a plan with that flag measures; the checkpoint adds nothing here (kvproof already
    keeps junction states), so neither it nor the combination is offered."""
    argv = ["--model", "qwen3-next", "--tensor-parallel-size", "8", "--limit", "300", "--dcp", "1", "--jobs", "1"]
    data = plan_json(*argv)
    d, tried = _remedies(data, "mamba-checkpoint-cliff")
    assert set(tried) == {"--retention-interval none", "--shared-prefix-checkpoint",
                          "--retention-interval none --shared-prefix-checkpoint"}
    keep = tried["--retention-interval none"]
    direct = plan_json(*argv, "--retention-interval", "none")["configs"][0]
    assert keep["offered"] and keep["gain"] > 0.01 and keep["hit_rate"] == direct["hit_rate"]
    assert keep["gain"] == pytest.approx(direct["hit_rate"] - data["configs"][0]["hit_rate"], abs=2e-6)  # each rounded to 6 places
    assert not tried["--shared-prefix-checkpoint"]["offered"]
    assert not tried["--retention-interval none --shared-prefix-checkpoint"]["offered"]
    assert "replayed: --retention-interval none -> " in d["message"] and "shared-prefix" not in d["message"]


def test_a_remedy_that_does_not_help_is_not_offered(plan_json):
    """One 2,000-token shared prompt: a finer hash unit lets attention restore more, but no Mamba
    state sits at 2,000 with or without the checkpoint, so the plan says no remedy helps."""
    data = plan_json("--generate", "--system-prompts", "1", "--system-prompt-len", "2000-2000", "--continuation", "0",
                     "--requests", "300", "--dcp", "1", "--jobs", "1")
    d, tried = _remedies(data, "hash-unit-too-coarse")
    assert "--hash-block-size 16" in tried and not any(r["offered"] for r in tried.values())
    assert d["message"].endswith("replayed, no remedy helps (tried: --hash-block-size 16, --shared-prefix-checkpoint, "
                                 "--hash-block-size 16 --shared-prefix-checkpoint)")
