"""``kvproof replay``: the issue's worked case, JSON shape, malformed traces."""

from __future__ import annotations

import json

import pytest

from kvproof.cli.main import main

SHARED = list(range(1000, 1256))
K3 = ["--group", "full_attention:256", "--group", "mamba:256"]


@pytest.fixture
def k3_trace(tmp_path):
    path = tmp_path / "k3.jsonl"
    path.write_text(
        json.dumps({"id": "prime", "prompt": SHARED + [7], "output": [1, 2], "arrival": 0, "cache_salt": None}) + "\n"
        + json.dumps({"id": "replay", "prompt": SHARED + [8, 9], "output": [3], "arrival": 10, "cache_salt": None}) + "\n"
    )
    return str(path)


def replay_json(capsys, *argv):
    code = main(["replay", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out else None, err


@pytest.mark.parametrize("dcp, partial, expected", [("2", True, 256), ("1", True, 256), ("2", False, 0)])
def test_k3_worked_case(capsys, k3_trace, dcp, partial, expected):
    argv = [k3_trace, *K3, "--dcp", dcp] + ([] if partial else ["--no-partial-hash-hits"])
    code, data, _ = replay_json(capsys, *argv)
    assert code == 0
    cached = {r["id"]: r["num_cached_tokens"] for r in data["requests"]}
    assert cached == {"prime": 0, "replay": expected}
    assert data["violations"] == []
    assert set(data["totals"]) >= {"hit_rate", "cow_copies", "evictions", "preemptions"}
    assert data["totals"]["hit_rate"] == pytest.approx(expected / (257 + 258), abs=1e-6)


def test_preemption_under_a_small_pool(capsys, tmp_path):
    path = tmp_path / "busy.jsonl"
    path.write_text("".join(
        json.dumps({"id": f"r{i}", "prompt": list(range(i, i + 30)), "output": list(range(20)), "arrival": 0}) + "\n"
        for i in range(6)
    ))
    code, data, _ = replay_json(capsys, str(path), "--group", "full_attention:4", "--group", "mamba:8",
                                "--num-blocks", "30", "--max-num-batched-tokens", "64")
    assert code == 0 and data["violations"] == []
    assert data["totals"]["preemptions"] > 0
    assert data["totals"]["evictions"] > 0  # 30 blocks cannot keep every cached prefix


def test_slow_tier_checks_every_step(capsys, k3_trace, monkeypatch):
    from kvproof.impl.kv_cache_manager import KVCacheManager

    calls = []
    real = KVCacheManager.check_state
    monkeypatch.setattr(KVCacheManager, "check_state", lambda self: calls.append(1) or real(self))
    code, data, _ = replay_json(capsys, k3_trace, *K3, "--dcp", "2", "--slow")
    assert code == 0 and data["violations"] == []
    assert len(calls) == data["totals"]["steps_run"]


def test_table_output(capsys, k3_trace):
    assert main(["replay", k3_trace, *K3, "--dcp", "2"]) == 0
    out = capsys.readouterr().out
    assert "replay" in out and "256" in out and "no violations" in out


@pytest.mark.parametrize(
    "lines, needle",
    [
        (['{"id": "a", "prompt": [1, 2]}', "{not json"], "line 2: not valid JSON"),
        (['{"id": "a"}'], "line 1 (request 'a'): missing 'prompt'"),
        (['{"id": "a", "prompt": []}'], "line 1 (request 'a'): 'prompt' must hold at least one token"),
        (['{"id": "a", "prompt": [1, -2]}'], "line 1 (request 'a'): 'prompt' token -2 at index 1 is not a token id"),
        (['{"id": "a", "prompt": [1], "arrival": -1}'], "line 1 (request 'a'): 'arrival' -1"),
        (['{"id": "a", "prompt": [1]}', '{"id": "a", "prompt": [2]}'], "line 2: duplicate request id 'a'"),
        (['{"id": "a", "prompt": [1], "colour": 3}'], "line 1: unknown field(s) 'colour'"),
        (['[1, 2]'], "line 1: expected a JSON object"),
    ],
)
def test_malformed_trace_exits_2_naming_the_line(capsys, tmp_path, lines, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = main(["replay", str(path), *K3])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_missing_file_and_tiny_pool_are_bad_input(capsys, tmp_path, k3_trace):
    assert main(["replay", str(tmp_path / "nope.jsonl"), *K3]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["replay", k3_trace, *K3, "--num-blocks", "2"]) == 2
    assert "expected num_blocks >= 4" in capsys.readouterr().err


@pytest.mark.parametrize("keys, expected", [("every-hash", 192), ("chunk-ends", 0)])
def test_attention_keys_flag(capsys, tmp_path, keys, expected):
    """MLA 64 under DCP 4 (256-token blocks) hashed every 64 tokens: a producer computed in one
    chunk, then a consumer sharing 200 tokens. Every-hash keys give it 192 (3 hash units inside
    the block); chunk-end keys only the producer's chunk end (256), which it does not share."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"id": "p", "prompt": SHARED + [7], "output": [1], "arrival": 0}) + "\n"
        + json.dumps({"id": "c", "prompt": SHARED[:200] + [9] * 10, "output": [3], "arrival": 10}) + "\n"
    )
    code, data, _ = replay_json(capsys, str(path), "--group", "mla:64", "--dcp", "4", "--hash-block-size", "64",
                                "--attention-keys", keys)
    assert code == 0 and data["violations"] == []
    assert {r["id"]: r["num_cached_tokens"] for r in data["requests"]} == {"p": 0, "c": expected}


@pytest.mark.parametrize("argv, fragment", [
    (["--attention-keys", "sometimes"], "argument --attention-keys: invalid choice: 'sometimes'"),
    (["--attention-keys", "every-hash", "--attention-keys", "chunk-ends"], "--attention-keys: given twice"),
])
def test_bad_attention_keys_exit_2_with_one_line(capsys, k3_trace, argv, fragment):
    code = main(["replay", k3_trace, *K3, *argv])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
