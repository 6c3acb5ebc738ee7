"""``kvproof plan --engine vllm``: vLLM 0.33.0's Scheduler beside kvproof's replay, with vLLM's own
manager and with kvproof's, each row's numbers equal to the vLLM harness run directly on the same
trace with the manager its ``vllm serve`` command names (marker vllm)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvproof.sim.trace import read_trace  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402


def _engine_of(command: str) -> dict:
    """The manager class and Scheduler class a row's ``vllm serve`` command runs: vLLM's own, or
    kvproof's manager with the command's ``KVPROOF_OPTIONS`` (read back by kvproof's own option
    parser) in the Scheduler ``KVPROOF_MANAGER=kvproof`` installs (its split carries the
    checkpoint policy)."""
    import functools
    import shlex

    from kvproof.integrations.vllm import serving_options
    from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager
    from kvproof.integrations.vllm.kvproof_scheduler import KvproofScheduler
    from kvproof.integrations.vllm.plugin import manager_choice

    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words[: words.index("vllm")])
    if manager_choice(env.get("KVPROOF_MANAGER", "")) == "vllm":
        return {}
    return {"manager_class": functools.partial(KvproofKVCacheManager, options=serving_options.parse(env.get(serving_options.ENV))),
            "scheduler_cls": KvproofScheduler}


@pytest.mark.parametrize("eviction", ["lru", "compute"])
def test_vllm_rows_match_the_harness(tmp_path, plan_cli, eviction):
    from kvproof.integrations.vllm.engine_harness import EngineHarness

    shared = list(range(300))
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": shared[: 100 + 40 * i] + [5000 + i] * 7, "output": [9000 + i, 9100 + i],
                    "arrival": 1 + 6 * i + (1000 if i == 4 else 0)}) + "\n"
        for i in range(6)
    ))
    argv = ["--trace", str(path), "--group", "full_attention:16", "--group", "mamba:32", "--max-model-len", "2048",
            "--dcp", "1,2", "--num-blocks", "300", "--engine", "vllm", "--eviction", eviction, "--json", "--no-progress"]
    done = plan_cli(*argv)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    data = json.loads(done.stdout)
    assert [c["engine"] for c in data["configs"]] == ["kvproof", "kvproof"]
    assert [(c["engine"], c["dcp"], c["eviction"]) for c in data["vllm_configs"]] == [
        ("vllm", 1, "lru"), ("kvproof-vllm", 1, eviction), ("vllm", 2, "lru"), ("kvproof-vllm", 2, eviction)]
    assert [("KVPROOF_MANAGER=kvproof" in c["serve"], "eviction=compute" in c["serve"]) for c in data["vllm_configs"]] == [
        (False, False), (True, eviction == "compute")] * 2
    for c in data["vllm_configs"]:
        layout = resolve_layout(LayoutConfig(
            (CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.MAMBA, 32)), dcp=c["dcp"], max_model_len=2048))
        result = EngineHarness(layout, 300, max_num_batched_tokens=8192, max_num_seqs=256,
                               **_engine_of(c["serve"])).run(read_trace(str(path)))
        assert c["cached_tokens"] == sum(result.num_cached_tokens.values()) > 0
        assert c["requests_with_hit"] == sum(1 for n in result.num_cached_tokens.values() if n)
        assert (c["cow_copies"], c["evictions"], c["preemptions"]) == (result.copies, result.evictions, result.preemptions)
        assert c["prefill_tokens"] == sum(n for step in result.steps for rid, start, n in step.chunks
                                          if start < result.num_prompt_tokens[rid])


def test_vllm_engine_refuses_what_vllm_cannot_run(tmp_path, plan_cli):
    done = plan_cli("--limit", "5", "--engine", "vllm", "--no-partial-hash-hits", "--no-progress")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "always allows partial hash hits" in done.stderr


def test_checkpoint_policies_in_vllms_scheduler(tmp_path, plan_cli):
    """``--engine vllm --checkpoints vllm,reuse``: kvproof's manager in vLLM's Scheduler under each
    policy (its command carrying ``KVPROOF_OPTIONS=checkpoints=reuse``), stock vLLM once, each
    row's cached tokens those of the harness running its command's engine; on next turns that
    re-send all but the prompt's last partial 512-token id, ``reuse`` caches more than vLLM's
    policy, and than stock vLLM, at both DCP sizes."""
    import math

    from kvproof.integrations.vllm.engine_harness import EngineHarness
    from kvproof.sim.mooncake import iter_mooncake, to_trace_request

    lines, next_id = [], 0
    for conv in range(4):
        ids = [next_id, next_id + 1]
        next_id += 2
        for turn in range(3):
            lines.append({"timestamp": 2000 * (3 * conv + turn), "input_length": 512 * (len(ids) - 1) + 300,
                          "output_length": 2, "hash_ids": list(ids)})
            ids = ids[:-1] + [next_id, next_id + 1]
            next_id += 2
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 128), CacheGroup(GroupKind.MAMBA, 256))
    done = plan_cli("--trace", str(path), "--group", "full_attention:128", "--group", "mamba:256", "--max-model-len", "8192",
                    "--dcp", "1,2", "--num-blocks", "400", "--engine", "vllm", "--checkpoints", "vllm,reuse", "--json",
                    "--no-progress", "--jobs", "1")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    rows = json.loads(done.stdout)["vllm_configs"]
    assert [(c["engine"], c["dcp"], c["checkpoints"]) for c in rows] == [
        (engine, dcp, policy) for dcp in (1, 2) for engine, policy in (("vllm", "vllm"), ("kvproof-vllm", "vllm"), ("kvproof-vllm", "reuse"))]
    assert [("checkpoints=reuse" in c["serve"]) for c in rows] == [False, False, True] * 2
    trace = [to_trace_request(r, math.floor(r.timestamp_ms / 50.0)) for r in iter_mooncake(str(path))]
    for c in rows:
        layout = resolve_layout(LayoutConfig(groups, dcp=c["dcp"], max_model_len=8192))
        result = EngineHarness(layout, 400, max_num_batched_tokens=8192, max_num_seqs=256, **_engine_of(c["serve"])).run(trace)
        assert c["cached_tokens"] == sum(result.num_cached_tokens.values()), c
    by = {(c["engine"], c["dcp"], c["checkpoints"]): c["cached_tokens"] for c in rows}
    for dcp in (1, 2):
        assert by[("kvproof-vllm", dcp, "reuse")] > by[("kvproof-vllm", dcp, "vllm")] >= by[("vllm", dcp, "vllm")]
