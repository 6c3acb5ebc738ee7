"""``kvproof plan`` end to end on small workloads: its numbers against a direct replay, the
built-in workload, the JSON shape, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import math
import random
import subprocess

import pytest

from kvproof.cli.main import main
from kvproof.planner.memory import ModelMemory, plan_pool
from kvproof.planner.run import config_layout
from kvproof.sim.mooncake import iter_mooncake, to_trace_request
from kvproof.sim.replay import replay
from kvproof.sim.trace import read_trace
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

from ..conftest import kvproof_command
from .conftest import write_next_turn_trace

SMALL = ["--group", "full_attention:128", "--group", "mamba:256", "--max-model-len", "8192", "--no-progress", "--jobs", "1"]


def run_plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def mooncake_trace(tmp_path):
    """Multi-turn chat in Mooncake's form: conversations that extend earlier prompts (at most 8
    ids of 512 tokens), several sharing a system prefix."""
    rng = random.Random(7)
    lines, chains, next_id = [], [], 1000
    for i in range(40):
        base = rng.choice(chains) if chains else []
        if rng.random() < 0.6 and 0 < len(base) <= 5:
            ids = list(base)
        else:
            ids = [rng.randrange(3)]
        extra = rng.randint(1, 3)
        ids += list(range(next_id, next_id + extra))
        next_id += extra
        chains.append(ids)
        n_in = 512 * (len(ids) - 1) + rng.randint(1, 512)
        lines.append({"timestamp": 40 * i, "input_length": n_in, "output_length": rng.randint(1, 20), "hash_ids": ids})
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def direct(trace, groups, dcp, num_blocks, budget=8192, max_len=8192):
    layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=max_len))
    held = [0]

    def watch(plan, sched) -> None:  # the pool's blocks held at once, all groups together
        held[0] = max(held[0], sum(sched.kv.occupancy()))

    result = replay(trace, layout, num_blocks, budget, oracle=False, on_step=watch)
    assert result.violations == []
    reqs = result.requests
    return {
        "cached_tokens": sum(r.num_cached_tokens for r in reqs),
        "prompt_tokens": sum(r.num_prompt_tokens for r in reqs),
        "requests_with_hit": sum(1 for r in reqs if r.num_cached_tokens > 0),
        "cow_copies": result.cow_copies,
        "evictions": result.evictions,
        "preemptions": result.preemptions,
        "requests": len(reqs),
        "no_preemption_prefill": sum(r.num_prompt_tokens - r.num_cached_tokens for r in reqs),
        "peak_blocks": held[0],
    }


@pytest.mark.parametrize("num_blocks", ["600", "120"])
def test_numbers_match_a_direct_replay_of_a_mooncake_trace(plan_json, mooncake_trace, num_blocks):
    step_ms = 20.0
    data = plan_json("--trace", mooncake_trace, *SMALL, "--dcp", "1,2,4", "--num-blocks", num_blocks, "--step-ms", str(step_ms))
    trace = [to_trace_request(r, math.floor(r.timestamp_ms / step_ms)) for r in iter_mooncake(mooncake_trace)]
    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 128), CacheGroup(GroupKind.MAMBA, 256))
    assert [c["dcp"] for c in data["configs"]] == [1, 2, 4]
    evicted = 0
    for c in data["configs"]:
        want = direct(trace, groups, c["dcp"], int(num_blocks))
        for key in ("cached_tokens", "prompt_tokens", "requests_with_hit", "cow_copies", "evictions", "preemptions", "requests",
                    "peak_blocks"):
            assert c[key] == want[key], (c["dcp"], key)
        # The peak of the total: at least each group's peak, never above the pool, the pool
        # once it evicted (a block is evicted only when none is free).
        assert max(c["peak_blocks_per_group"]) <= c["peak_blocks"] <= min(sum(c["peak_blocks_per_group"]), int(num_blocks) - 1)
        assert not c["evictions"] or c["peak_blocks"] == int(num_blocks) - 1
        assert c["hit_rate"] == pytest.approx(want["cached_tokens"] / want["prompt_tokens"], abs=1e-6)
        if not want["preemptions"]:
            assert c["prefill_tokens"] == want["no_preemption_prefill"]
        assert c["violations"] == [] and c["num_blocks"] == int(num_blocks)
        assert c["cached_tokens"] > 0 and c["attention_hit_rate"] >= c["hit_rate"]
        evicted += c["evictions"]
    assert num_blocks != "120" or evicted > 0  # the small pool is under pressure


def test_memory_sized_pool_replays_vllm_groups(capsys, tmp_path):
    path = tmp_path / "kv.jsonl"
    shared = list(range(100))
    path.write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": shared + [1000 + i] * (i + 1), "output": [5, 6], "arrival": 3 * i}) + "\n"
        for i in range(12)
    ))
    argv = ["--trace", str(path), "--group", "full_attention:16", "--group", "mamba:32", "--max-model-len", "8192",
            "--no-progress", "--jobs", "1", "--dcp", "2", "--bytes-per-token", "256", "--bytes-per-state", "6000",
            "--layers", "2,6", "--kv-memory-gib", "0.0005", "--json"]
    code, out, err = run_plan(capsys, *argv)
    assert code == 0, err
    (c,) = json.loads(out)["configs"]
    base = LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.MAMBA, 32)), max_model_len=8192)
    pool = plan_pool(resolve_layout(base), ModelMemory((2, 6), 256, 6000), kv_memory_bytes=int(0.0005 * 2**30))
    assert pool.vllm_groups == (1, 3) and c["num_blocks"] == pool.num_blocks and c["block_bytes"] == 2 * 6000
    layout = config_layout(base, 2, pool)
    assert len(layout.groups) == 4
    result = replay(read_trace(str(path)), layout, pool.num_blocks, 8192, oracle=False)
    assert c["cached_tokens"] == sum(r.num_cached_tokens for r in result.requests) > 0
    assert c["evictions"] == result.evictions


def test_builtin_workload_and_json_shape(plan_json):
    data = plan_json("--limit", "40")
    assert data["workload"]["requests"] == 40 and "Mooncake" in data["workload"]["description"]
    assert [c["dcp"] for c in data["configs"]] == [1, 2, 4, 8]
    keys = {"dcp", "num_blocks", "hit_rate", "requests_with_hit", "prefill_tokens", "cow_copies", "evictions",
            "preemptions", "table_bytes_per_group", "violations"}
    for c in data["configs"]:
        assert keys <= set(c)
        assert len(c["table_bytes_per_group"]) == 2 and c["largest_request"] == 262_144
    assert data["layout"]["groups"] == ["mla:256", "mamba:256"] and data["layout"]["vllm_groups_per_group"] == [1, 3]
    assert data["recommendation"]["choice"]["dcp"] in (1, 2, 4, 8)
    assert data["recommendation"]["choice"]["gpus"] == 8  # the kimi-k3 preset's bytes are per GPU of TP 8
    assert isinstance(data["diagnoses"], list)


def test_text_report(plan_cli):
    done = plan_cli("--limit", "20", "--dcp", "1,8", "--no-progress")
    assert done.returncode == 0 and done.stderr == ""
    out = done.stdout
    assert "DCP  hit rate" in out and "recommendation: hit-rate: DCP " in out and "invariant violations: none" in out
    # kvproof's default rules (keys at every hash boundary) are served by its manager inside vLLM.
    assert "\n  KVPROOF_MANAGER=kvproof vllm serve <model> --tensor-parallel-size 8 " in out
    assert " engine  DCP  peak mla  peak mamba  tables mla  tables mamba  largest req\n" in out
    # Everything but the command to copy and the diagnoses' sentences fits 100 columns.
    wide = [line for line in out.splitlines() if len(line) > 100 and "vllm serve " not in line and not line.startswith("  [")]
    assert not wide, wide


def test_generated_workload_and_memory_sweep(capsys):
    argv = ["--generate", "--requests", "30", "--system-prompt-len", "40-200", "--suffix-len", "10-50",
            "--output-len", "2-6", *SMALL, "--dcp", "1,2", "--bytes-per-token", "256", "--bytes-per-state", "4096",
            "--layers", "1,3", "--kv-memory-gib", "0.002", "--memory-sweep", "0.0005,0.001", "--json"]
    code, out, err = run_plan(capsys, *argv)
    assert code == 0, err
    data = json.loads(out)
    assert data["workload"]["requests"] == 30
    points = {(c["dcp"], c["kv_memory_gib"]) for c in data["memory_sweep"]}
    assert points == {(d, round(g, 6)) for d in (1, 2) for g in (0.0005, 0.001, 0.002)}
    by_memory = {}
    for c in data["memory_sweep"]:
        by_memory.setdefault(c["dcp"], []).append((c["kv_memory_gib"], c["num_blocks"]))
    for pts in by_memory.values():
        pts.sort()
        assert [n for _, n in pts] == sorted(n for _, n in pts)  # more memory, more blocks
    choice = data["recommendation"]["choice"]
    assert (choice["dcp"], choice["kv_memory_gib"]) in points


def test_parallel_jobs_give_the_same_numbers(plan_json, mooncake_trace):
    argv = ["--trace", mooncake_trace, *SMALL[:-2], "--dcp", "1,2", "--num-blocks", "120"]
    runs = []
    for jobs in ("1", "2"):
        data = plan_json(*argv, "--jobs", jobs)
        runs.append([{k: v for k, v in c.items() if k != "seconds"} for c in data["configs"]])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/nonexistent/t.jsonl"], "cannot read trace '/nonexistent/t.jsonl'"),
    (["--dcp", "1,x"], "DCP size 'x' is not a decimal integer; expected digits 0-9 only \\(in '1,x'\\)"),
    (["--dcp", "1, 2"], "DCP size ' 2' is not a decimal integer"),
    (["--dcp", "1,4096"], "DCP size '4096' in '1,4096' must be an integer in \\[1, 1024\\]"),
    (["--dcp", "3", "--group", "full_attention:16", "--group", "mamba:16", "--interleave", "5", "--num-blocks", "100"],
     "interleave 5 does not divide block size 16"),
    (["--group", "full_attention:16", "--group", "mamba:16"], "this layout has no memory figures"),
    (["--num-blocks", "1"], "--num-blocks 1 must be >= 2"),
    (["--num-blocks", "100", "--kv-memory-gib", "4"], "exclude each other"),
    (["--layers", "12"], "1 layer count\\(s\\) for 2 cache group\\(s\\)"),
    (["--kv-memory-gib", "0.001"], "DCP 1: 0.001 GiB per GPU make a pool of 0 block\\(s\\) \\(3.38 MiB per block\\)"),
    (["--kv-memory-gib", "nan"], "argument --kv-memory-gib: 'nan' is not a decimal number"),
    (["--kv-memory-gib", "-1"], "KV memory -1.0 GiB must be a positive finite number"),
    (["--num-blocks", "100", "--memory-sweep"], "--memory-sweep sizes pools from KV memory"),
    (["--kv-memory-gib", "0.02", "--limit", "50"], "holds a request of at most"),
    (["--generate", "--trace", "x.jsonl"], "--generate and --trace exclude each other"),
    (["--generate", "--suffix-len", "9-x"], "suffix length '9-x' must be LO-HI"),
    (["--plot", "out.txt"], "plot file 'out.txt' must end in .png"),
    (["--plot", "/nonexistent/dir/p.png"], "folder '/nonexistent/dir' is missing"),
    (["--eviction", "lru,fifo"], "eviction policy 'fifo' in --eviction 'lru,fifo' must be one of lru, compute"),
    (["--checkpoints", "vllm,every"], "checkpoint policy 'every' in --checkpoints 'vllm,every' must be one of vllm, reuse"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_plan(capsys, *argv, "--no-progress", "--jobs", "1")
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvproof plan: error: "), err
    assert __import__("re").search(message, lines[0]), lines[0]


def test_malformed_line_is_named(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "prompt": [1, 2]}\n{"id": "b", "prompt": [1, -2]}\n')
    code, _, err = run_plan(capsys, "--trace", str(path), *SMALL, "--num-blocks", "50")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"kvproof plan: error: {path}: line 2") and "'prompt'" in err


def test_violations_exit_1(capsys, mooncake_trace, monkeypatch):
    from kvproof.impl.coordinator import Hit, HybridCoordinator

    real = HybridCoordinator.find_longest_hit

    def off_grid(self, request, bound):  # a joint hit one token off the hit grid
        hit = real(self, request, bound)
        return Hit(hit.num_tokens + 1, hit.blocks) if hit.num_tokens else hit

    monkeypatch.setattr(HybridCoordinator, "find_longest_hit", off_grid)
    code, out, err = run_plan(capsys, "--trace", mooncake_trace, *SMALL, "--dcp", "1", "--num-blocks", "600")
    assert code == 1 and "INV-HIT-BOUND" in out and err == "kvproof plan: 1 invariant violation(s)\n"


def test_eviction_policies_side_by_side(capsys, mooncake_trace):
    """``--eviction lru,compute``: one row per policy and DCP size, the JSON configs carry the
    policy, and each row's numbers are a direct replay's with that policy (lru: as before)."""
    argv = ["--trace", mooncake_trace, *SMALL, "--dcp", "1,2", "--num-blocks", "120", "--eviction", "lru,compute"]
    code, out, err = run_plan(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"]["eviction"] == ["lru", "compute"]
    assert [(c["dcp"], c["eviction"]) for c in data["configs"]] == [(1, "lru"), (1, "compute"), (2, "lru"), (2, "compute")]
    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 128), CacheGroup(GroupKind.MAMBA, 256))
    trace = [to_trace_request(r, math.floor(r.timestamp_ms / 50.0)) for r in iter_mooncake(mooncake_trace)]
    for c in data["configs"]:
        layout = resolve_layout(LayoutConfig(groups, dcp=c["dcp"], max_model_len=8192, eviction=c["eviction"]))
        result = replay(trace, layout, 120, 8192, oracle=False)
        assert c["cached_tokens"] == sum(r.num_cached_tokens for r in result.requests)
        assert c["evictions"] == result.evictions > 0
    code, out, err = run_plan(capsys, *argv)
    assert code == 0, err
    assert " engine  eviction  DCP" in out and "kvproof   compute    2" in out


@pytest.fixture
def next_turn_trace(tmp_path):
    """As the real Mooncake trace (``write_next_turn_trace``), six conversations."""
    path = tmp_path / "turns.jsonl"
    write_next_turn_trace(path, 6)
    return str(path)


def test_checkpoint_policies_side_by_side(capsys, next_turn_trace):
    """``--checkpoints vllm,reuse``: the plan's rows stay vLLM's policy; a table per policy and
    DCP size, whose JSON configs are each a direct replay's with that policy; next turns sharing
    all but the prompt's tail resume at the ladder's rung, where vLLM's rule has no state."""
    mooncake_trace = next_turn_trace
    argv = ["--trace", mooncake_trace, *SMALL, "--dcp", "1,2", "--num-blocks", "400", "--checkpoints", "vllm,reuse"]
    code, out, err = run_plan(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"]["checkpoints"] == ["vllm", "reuse"]
    assert [(c["dcp"], c["checkpoints"]) for c in data["configs"]] == [(1, "vllm"), (2, "vllm")]
    assert [(c["dcp"], c["checkpoints"]) for c in data["checkpoint_configs"]] == [(1, "reuse"), (2, "reuse")]
    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 128), CacheGroup(GroupKind.MAMBA, 256))
    trace = [to_trace_request(r, math.floor(r.timestamp_ms / 50.0)) for r in iter_mooncake(mooncake_trace)]
    for c in data["configs"] + data["checkpoint_configs"]:
        layout = resolve_layout(LayoutConfig(groups, dcp=c["dcp"], max_model_len=8192, checkpoints=c["checkpoints"]))
        result = replay(trace, layout, 400, 8192, oracle=False)
        assert c["cached_tokens"] == sum(r.num_cached_tokens for r in result.requests)
    by = {(c["dcp"], c["checkpoints"]): c["cached_tokens"] for c in data["configs"] + data["checkpoint_configs"]}
    assert by[(1, "reuse")] > by[(1, "vllm")] and by[(2, "reuse")] > by[(2, "vllm")]
    code, out, err = run_plan(capsys, *argv)
    assert code == 0, err
    assert "checkpoints  DCP  hit rate  attn alone  ratio  x vllm" in out and "      reuse    2" in out


SWEEP_ARGV = ["--generate", "--requests", "6", "--system-prompt-len", "2000-2000", "--suffix-len", "10-10",
              "--output-len", "2-2", *SMALL, "--dcp", "1,2", "--bytes-per-token", "256", "--bytes-per-state", "4096",
              "--layers", "1,3", "--kv-memory-gib", "0.01"]


def test_a_sweep_size_too_small_for_the_workload_is_refused_before_any_replay(capsys, monkeypatch):
    import kvproof.planner.plan as plan_module

    monkeypatch.setattr(plan_module.Task, "run", lambda *a: pytest.fail("a replay ran before the check"))
    code, out, err = run_plan(capsys, *SWEEP_ARGV, "--memory-sweep", "0.0002,0.005")
    assert code == 2 and out == ""
    assert err.startswith("kvproof plan: error: --memory-sweep 0.0002 GiB per GPU: at DCP 1 the pool of ")
    assert err.rstrip().endswith("give --memory-sweep sizes that hold it")


def test_the_automatic_sweep_leaves_out_what_cannot_hold_the_workload(capsys):
    code, out, err = run_plan(capsys, *SWEEP_ARGV, "--memory-sweep", "--json")
    assert code == 0, err
    data = json.loads(out)
    (note,) = data["notes"]
    assert note.startswith("memory sweep: left out 0.0003125 GiB at DCP 1") and "longest request" in note
    swept = {(c["dcp"], c["kv_memory_gib"]) for c in data["memory_sweep"]}
    assert (1, 0.0003125) not in swept and (1, 0.01) in swept


def test_warm_up_halves_split_the_hit_rate(tmp_path, plan_json):
    # Ten distinct prompts, then the same ten again: the first half can only miss, the second hit.
    prompts = [list(range(1000 * i, 1000 * i + 300)) for i in range(10)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": p, "output": [9, 9], "arrival": 40 * i}) + "\n"
        for i, p in enumerate(prompts + prompts)))
    data = plan_json("--trace", str(path), *SMALL[:6], "--dcp", "1", "--num-blocks", "400", "--jobs", "1")
    (config,) = data["configs"]
    first, second = config["hit_rate_by_half"]
    assert first == 0 and second > 0.8
    assert first <= config["hit_rate"] <= second  # the whole is an average of its halves


def test_every_plan_has_a_stock_vllm_row_per_dcp_size(plan_json, plan_cli):
    """Without vLLM installed: each DCP size also replays under stock vLLM 0.33.0's rules, which
    are the plan's flags with vLLM's keying rule given by hand (--attention-keys prompt-tail):
    that plan's own rows are the same numbers, and it replays nothing twice (its stock rows are
    its kvproof rows). The stock rows' commands run stock vLLM (no KVPROOF_MANAGER)."""
    counts = ("cached_tokens", "requests_with_hit", "prefill_tokens", "cow_copies", "evictions", "peak_blocks_per_group")
    data = plan_json("--limit", "60", "--dcp", "1,4,8", "--kv-memory-gib", "4")
    stock = {c["dcp"]: c for c in data["stock_configs"]}
    assert sorted(stock) == [1, 4, 8] and all(c["engine"] == "stock" for c in stock.values())
    assert all(c["serve"].startswith("vllm serve ") for c in stock.values())
    assert all(c["serve"].startswith("KVPROOF_MANAGER=kvproof vllm serve ") for c in data["configs"])
    by_hand = plan_json("--limit", "60", "--dcp", "1,4,8", "--kv-memory-gib", "4", "--attention-keys", "prompt-tail")
    for c in by_hand["configs"]:
        assert {k: c[k] for k in counts} == {k: stock[c["dcp"]][k] for k in counts}
        assert "KVPROOF_OPTIONS=attention_keys=prompt-tail " in c["serve"]  # kvproof's manager under vLLM's rules
    assert by_hand["recommendation"]["serve"] == by_hand["recommendation"]["stock_serve"]  # stock vLLM serves them
    assert [{k: c[k] for k in counts} for c in by_hand["stock_configs"]] == [{k: c[k] for k in counts} for c in by_hand["configs"]]
    # Under DCP 8 vLLM's keys lose the shared prefixes inside 2,048-token blocks; kvproof's keep them.
    kvproof = {c["dcp"]: c for c in data["configs"]}
    assert kvproof[8]["cached_tokens"] > stock[8]["cached_tokens"]
    rec = data["recommendation"]
    assert rec["stock_hit_rate"] == stock[rec["choice"]["dcp"]]["hit_rate"]
    text = plan_cli("--limit", "20", "--dcp", "1,8", "--no-progress").stdout
    assert "\n  stock    8 " in text and "\n  stock vLLM with the same flags (no KVPROOF_MANAGER): " in text


def test_a_step_time_that_moves_the_recommended_hit_rate_is_noted(plan_json, plan_cli, tmp_path):
    """The recommended configuration is replayed at half and double --step-ms; each rate is what
    a plan at that step time measures, and a move of more than a point gets one note (the built-in
    workload at DCP 1: 6.2 % at 50 ms, 4.6 % at 100). A trace read from a pipe is not re-read."""
    data = plan_json("--dcp", "1")
    rec = data["recommendation"]
    for ms, rate in rec["step_ms_sensitivity"].items():
        again = plan_json("--dcp", "1", "--step-ms", ms)
        assert again["configs"][0]["hit_rate"] == rate
    assert max(abs(r - rec["choice"]["hit_rate"]) for r in rec["step_ms_sensitivity"].values()) > 0.01
    assert [n for n in rec["notes"] if n.startswith("step time matters: --step-ms 25 gives ")]
    quiet = plan_json("--limit", "100", "--dcp", "1")["recommendation"]
    assert sorted(quiet["step_ms_sensitivity"]) == ["100", "25"]
    assert not [n for n in quiet["notes"] if n.startswith("step time matters")]
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": list(range(40)), "output": [1, 2], "arrival": 0}) + "\n")
    done = subprocess.run(f"cat {path} | {' '.join(kvproof_command())} plan --trace /dev/stdin --group full_attention:16 "
                          "--num-blocks 50 --dcp 1 --json --no-progress", shell=True, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "step_ms_sensitivity" not in json.loads(done.stdout)["recommendation"]
