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
from .conftest import write_next_turn_trace  # noqa: E402


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

    path = tmp_path / "turns.jsonl"
    write_next_turn_trace(path, 4)
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


#: The counts the stock column and vLLM's own engine must share.
_COUNTS = ("cached_tokens", "requests_with_hit", "prefill_tokens", "cow_copies", "evictions", "preemptions")


def _conversations(path, n: int = 24) -> None:
    """Chat requests one after another (each arrives long after the one before finished): new
    prompts on two shared system prompts, continuations of an earlier prompt and its outputs,
    and siblings cut at random points of an earlier prompt."""
    import random

    rng = random.Random(0)
    systems = [list(range(1000 * k, 1000 * k + n)) for k, n in ((1, 700), (2, 333))]
    fresh = iter(range(100_000, 1 << 30))
    done: list[tuple[list[int], list[int]]] = []
    lines = []
    for i in range(n):
        kind = rng.choice(["new", "continue", "sibling"]) if done else "new"
        if kind == "new":
            prompt = rng.choice(systems) + [next(fresh) for _ in range(rng.randint(5, 120))]
        elif kind == "continue":
            p, o = rng.choice(done)
            prompt = p + o + [next(fresh) for _ in range(rng.randint(5, 120))]
        else:
            p, _ = rng.choice(done)
            prompt = p[: rng.randint(len(p) // 2, len(p))] + [next(fresh) for _ in range(rng.randint(5, 60))]
        output = [next(fresh) for _ in range(rng.randint(2, 20))]
        done.append((prompt, output))
        lines.append(json.dumps({"id": f"r{i}", "prompt": prompt, "output": output, "arrival": 1 + 5000 * i}) + "\n")
    path.write_text("".join(lines))


def _by_dcp(configs, engine):
    return {c["dcp"]: c for c in configs if c["engine"] == engine}


def test_the_stock_column_is_vllms_own_engine_on_requests_one_after_another(tmp_path, plan_cli):
    """kvproof's replay under vLLM's rules (the stock column every plan prints) against vLLM
    0.33.0's real Scheduler and manager: on requests that never share a step, every count is
    equal at every DCP size, evictions included, and the two rows name the same command. The
    kvproof column differs where vLLM's keys lose hits (inside DCP-sized blocks), so the stock
    column is not kvproof's run relabelled."""
    path = tmp_path / "chat.jsonl"
    _conversations(path)
    done = plan_cli("--trace", str(path), "--group", "full_attention:16", "--group", "mamba:16", "--max-model-len", "8192",
                    "--num-blocks", "150", "--dcp", "1,2,4,8", "--engine", "vllm", "--json", "--no-progress")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    data = json.loads(done.stdout)
    stock, vllm, ours = _by_dcp(data["stock_configs"], "stock"), _by_dcp(data["vllm_configs"], "vllm"), _by_dcp(data["configs"], "kvproof")
    assert sorted(stock) == sorted(vllm) == [1, 2, 4, 8]
    for d in stock:
        assert {k: stock[d][k] for k in _COUNTS} == {k: vllm[d][k] for k in _COUNTS}, d
        assert stock[d]["serve"] == vllm[d]["serve"] and "KVPROOF" not in stock[d]["serve"]
    assert vllm[1]["evictions"] > 0
    assert any(ours[d]["cached_tokens"] > stock[d]["cached_tokens"] for d in (2, 4, 8))


def test_the_stock_column_tracks_vllm_on_mooncake_traffic(plan_cli):
    """The same on real overlapping traffic (the first 100 Mooncake requests): there kvproof's
    lookups see only finished steps while vLLM's also see keys registered earlier in the same
    step, which can move a request's junction and so which Mamba state retention 0 keeps (the
    class docs/plan.md names). Bound: hit rates within 0.1 point, hit requests within one."""
    done = plan_cli("--limit", "100", "--dcp", "1,8", "--engine", "vllm", "--json", "--no-progress")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    data = json.loads(done.stdout)
    stock, vllm = _by_dcp(data["stock_configs"], "stock"), _by_dcp(data["vllm_configs"], "vllm")
    for d in (1, 8):
        assert abs(stock[d]["hit_rate"] - vllm[d]["hit_rate"]) <= 0.001, d
        assert abs(stock[d]["requests_with_hit"] - vllm[d]["requests_with_hit"]) <= 1, d
    # vLLM keys no boundary inside a block but the prompt tail: the shared 512-token prefixes
    # inside DCP 8's 2,048-token blocks are not hit, as kvproof's own keys hit them.
    assert vllm[8]["requests_with_hit"] < vllm[1]["requests_with_hit"]
    assert _by_dcp(data["configs"], "kvproof")[8]["hit_rate"] > stock[8]["hit_rate"]
