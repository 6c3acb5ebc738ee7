"""``kvproof e2e`` under hostile input: sizes the machine cannot hold, ids torch cannot
take, arrivals far away and runs longer than the step limit -- one line, status 2, before any rank
starts; what is valid runs."""

from __future__ import annotations

import json

import pytest

from kvproof.cli import e2e as e2e_cli
from kvproof.cli.main import main
from kvproof.e2e import runner
from kvproof.e2e.workloads import hybrid_workload
from kvproof.sim.trace import dump_trace

HYBRID = ["--group", "full_attention:4", "--group", "mamba:8", "--hash-block-size", "2", "--max-model-len", "128"]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "hybrid.jsonl"
    path.write_text(dump_trace(hybrid_workload()))
    return str(path)


def write(tmp_path, *requests) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return str(path)


def bad_input(capsys, argv, needle):
    code = main(["e2e", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, err)
    assert len(err.splitlines()) == 1 and needle in err, err
    return err


@pytest.fixture
def no_ranks(monkeypatch):
    """Fails the test if a rank were started: every refusal here comes first."""
    def must_not_spawn(*args, **kwargs):
        raise AssertionError("ranks started for input that should have been refused")

    monkeypatch.setattr(runner, "spawn_ranks", must_not_spawn)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--num-blocks", "1000000"], "dcp 1 with num_blocks 1,000,000 needs about 2.0 GB (1 rank(s) of 2,048 MB"),
        (["--dcp", "1024"], "dcp 1024 with num_blocks 256 needs about 52.4 GB (1,024 rank(s) of 51 MB: process, "
                            "cache and block tables), but this machine has 1.0 GB available; expected dcp <= 13 at these sizes"),
        (["--group", "full_attention:1000000", "--group", "mamba:8"], "needs about 131.1 GB"),
    ],
)
def test_sizes_beyond_the_machine_are_refused_before_any_allocation(capsys, monkeypatch, no_ranks, trace, argv, needle):
    monkeypatch.setattr(e2e_cli, "available_memory", lambda: 1_000_000_000)
    base = HYBRID if argv[0] != "--group" else HYBRID[4:]
    bad_input(capsys, [trace, *base, *argv], needle)


def test_more_ranks_than_open_files_allow_are_refused(capsys, monkeypatch, no_ranks, trace):
    monkeypatch.setattr(runner, "max_ranks_by_descriptors", lambda: 3)
    bad_input(capsys, [trace, *HYBRID, "--dcp", "4"],
              "dcp 4 needs about 76 open files (pipes and gloo connections), more than this process may open "
              "(ulimit -n); expected dcp <= 3")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--num-speculative-blocks", "1000000000"], "argument --num-speculative-blocks: 1000000000 is too large"),
        (["--seed", str(10**23)], "argument --seed: 100000000000000000000000 is too large; expected at most "
                                  "18,446,744,073,709,551,615"),
        (["--seed", "-1"], "argument --seed: -1 is too small; expected at least 0"),
        (["--num-blocks", "9223372036854775808"], "argument --num-blocks: 9223372036854775808 is too large"),
    ],
)
def test_flags_out_of_range(capsys, no_ranks, trace, argv, needle):
    bad_input(capsys, [trace, *HYBRID, *argv], needle)


def test_a_token_torch_cannot_hold_is_refused_by_the_trace_reader(capsys, no_ranks, tmp_path):
    path = write(tmp_path, {"id": "a", "prompt": [1, 2**63]})
    bad_input(capsys, [path, *HYBRID], "t.jsonl: line 1 (request 'a'): 'prompt' token 9223372036854775808 at index 1")


def test_the_largest_token_and_seed_run(capsys, tmp_path):
    path = write(tmp_path, {"id": "a", "prompt": [2**63 - 1, 5, 7], "output": [2**63 - 1, 3]})
    assert main(["e2e", path, *HYBRID, "--seed", str(2**64 - 1), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 1


def test_a_far_arrival_costs_one_step_not_millions(capsys, tmp_path):
    """Idle steps before an arrival are skipped (the e2e side of replay's idle-step skipping)."""
    path = write(tmp_path, {"id": "a", "prompt": [1, 2, 3], "output": [4]},
                 {"id": "late", "prompt": [1, 2, 3, 9], "output": [5, 6], "arrival": 2_000_000})
    assert main(["e2e", path, *HYBRID, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 2


def test_more_outputs_than_the_step_limit_is_a_limit_error_up_front(capsys, no_ranks, tmp_path):
    path = write(tmp_path, {"id": "chatty", "prompt": [1], "output": [0] * 100_001})
    bad_input(capsys, [path, *HYBRID[:-1], "200000"],
              "request 'chatty' has 100,001 outputs, one step each, beyond the e2e runner's limit of 100,000 scheduler steps")


def test_running_past_the_step_limit_is_a_limit_error_not_an_invariant(monkeypatch, capsys, trace):
    # Every request has at most 6 outputs (passes the up-front check); the run takes more steps.
    monkeypatch.setattr(runner.E2EOptions, "__init__", _with_max_steps(runner.E2EOptions.__init__, 7))
    bad_input(capsys, [trace, *HYBRID], "the run did not finish within the e2e runner's limit of 7 scheduler steps")


def _with_max_steps(init, steps):
    def patched(self, *args, **kwargs):
        kwargs["max_steps"] = steps
        init(self, *args, **kwargs)

    return patched
