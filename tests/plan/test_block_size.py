"""``kvproof plan --block-size 16,64,256``: each block size a configuration at every DCP size,
its numbers a replay of that layout, its command carrying ``--block-size``, the recommendation
choosing over all of them; vLLM's raise applied with ``--model``, warned about otherwise; bad
values one line naming the value."""

from __future__ import annotations

import json
import math
import re

import pytest

from kvproof.planner.memory import plan_pool
from kvproof.planner.model_config import model_layout
from kvproof.sim.mooncake import iter_mooncake, to_trace_request
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

from .test_plan_cli import SMALL, direct, mooncake_trace, run_plan  # noqa: F401 (a fixture)


def test_each_block_size_is_a_replayed_configuration_with_its_command(capsys, mooncake_trace):
    step_ms = 20.0
    code, out, err = run_plan(capsys, "--trace", mooncake_trace, *SMALL, "--dcp", "1,2", "--num-blocks", "150",
                              "--step-ms", str(step_ms), "--block-size", "64,256", "--json")
    assert code == 0, err
    data = json.loads(out)
    trace = [to_trace_request(r, math.floor(r.timestamp_ms / step_ms)) for r in iter_mooncake(mooncake_trace)]
    for key in ("configs", "stock_configs"):
        assert sorted((c["block_size"], c["dcp"]) for c in data[key]) == [(64, 1), (64, 2), (256, 1), (256, 2)]
    # The reuse bound is probed at every compared layout's hit unit, not only the first block size's.
    assert {str(c["cache_hit_alignment"]) for c in data["configs"]} <= set(data["reuse_bound"]), data["reuse_bound"]
    for c in data["configs"]:
        b = c["block_size"]
        # Every group at the block asked for (the Mamba group's too, as vLLM's align mode has it).
        want = direct(trace, (CacheGroup(GroupKind.FULL_ATTENTION, b), CacheGroup(GroupKind.MAMBA, b)), c["dcp"], 150)
        for name in ("cached_tokens", "prompt_tokens", "requests_with_hit", "evictions", "preemptions"):
            assert c[name] == want[name], (b, c["dcp"], name)
        assert f" --block-size {b}" in c["serve"]
    assert {c["hit_rate"] for c in data["configs"] if c["block_size"] == 64} != \
        {c["hit_rate"] for c in data["configs"] if c["block_size"] == 256}  # the block size matters here
    choice = data["recommendation"]["choice"]
    best = max(c["hit_rate"] for c in data["configs"])
    assert choice["hit_rate"] == best
    assert any((c["block_size"], c["dcp"]) == (choice["block_size"], choice["dcp"]) and c["hit_rate"] == best
               for c in data["configs"])
    assert data["recommendation"]["serve"].endswith(f"--block-size {choice['block_size']}") or \
        f"--block-size {choice['block_size']} " in data["recommendation"]["serve"]


def test_the_text_names_each_block_size_and_fits_100_columns(capsys, mooncake_trace):
    code, out, err = run_plan(capsys, "--trace", mooncake_trace, *SMALL, "--dcp", "1,2", "--num-blocks", "150",
                              "--block-size", "64,256")
    assert code == 0, err
    assert "block sizes compared: 64 (full_attention:64, mamba:64); 256 (full_attention:256, mamba:256)" in out
    assert out.count("--block-size 64 (full_attention:64, mamba:64):\n") == 2  # both tables
    assert out.count("--block-size 256 (full_attention:256, mamba:256):\n") == 2
    assert re.search(r"recommendation: hit-rate: DCP \d block (64|256) ", out)
    wide = [line for line in out.splitlines() if len(line) > 100 and "vllm serve " not in line
            and not line.startswith(("  [", "workload: /"))]  # the commands, the diagnoses and the trace's path
    assert not wide, wide


def test_with_a_model_vllm_raises_each_block_as_it_would(plan_json):
    data = plan_json("--model", "qwen3-next", "--tensor-parallel-size", "8", "--limit", "30", "--dcp", "1",
                     "--block-size", "16,256")
    by_block = {c["block_size"]: c for c in data["configs"]}
    assert sorted(by_block) == [16, 256]
    for b, c in by_block.items():
        model = model_layout("qwen3-next", 8, b)  # block 16 raised to hold a gated-DeltaNet state
        layout = resolve_layout(LayoutConfig(model.groups, max_model_len=model.max_model_len))
        assert c["block_bytes"] == plan_pool(layout, model.memory, 40 * 2**30).block_bytes
        assert f" --block-size {b}" in c["serve"]  # what the operator asks vllm serve for
    assert model_layout("qwen3-next", 8, 16).block_size > 16
    assert by_block[16]["block_bytes"] != by_block[256]["block_bytes"]
    assert not [d for d in data["diagnoses"] if d["id"] == "auto-raised-block-size"]  # applied, not warned


def test_without_a_model_the_raise_is_warned_per_block_size(plan_json):
    data = plan_json("--limit", "30", "--dcp", "1", "--block-size", "64,256")
    raised = [d["message"] for d in data["diagnoses"] if d["id"] == "auto-raised-block-size"]
    assert len(raised) == 1 and raised[0].startswith("--block-size 64: group 0 (mla:64): vLLM would raise")
    assert all(d["message"].startswith(("--block-size 64: ", "--block-size 256: ")) for d in data["diagnoses"])
    assert sorted(c["block_size"] for c in data["configs"]) == [64, 256]


def test_one_block_size_overrides_the_layout(plan_json):
    data = plan_json("--limit", "20", "--dcp", "1", "--block-size", "128")
    (c,) = data["configs"]
    assert c["block_size"] == 128 and data["layout"]["groups"] == ["mla:128", "mamba:128"]
    assert data["recommendation"]["serve"].endswith("--block-size 128")


@pytest.mark.parametrize("value, message", [
    ("0", "block size '0' in '0' must be an integer in [1, 1048576]"),
    ("16,x", "block size 'x' is not a decimal integer"),
    ("16,-4", "block size '-4' in '16,-4'"),
    ("48", "--block-size 48 at DCP 1: "),
])
def test_a_bad_block_size_is_one_line_naming_it(capsys, value, message):
    code, out, err = run_plan(capsys, *SMALL, "--num-blocks", "100", "--hash-block-size", "32", "--block-size", value)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kvproof plan: error: ") and message in err, err


def test_several_block_sizes_with_a_memory_sweep_are_refused_up_front(capsys):
    code, out, err = run_plan(capsys, "--block-size", "64,256", "--memory-sweep", "--no-progress")
    assert code == 2 and out == ""
    assert "--block-size 64,256: several block sizes are compared at the stated memory" in err and "--memory-sweep" in err
