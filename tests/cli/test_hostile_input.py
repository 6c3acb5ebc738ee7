"""Hostile or careless input: every case ends with status 2 and one line on stderr that
names the value, before any work; decided cases that are accepted say so."""

from __future__ import annotations

import json

import pytest

from kvproof.cli import limits
from kvproof.cli.main import build_parser, main

SMALL = ["--group", "full_attention:16", "--group", "mamba:16"]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": [1, 2, 3], "output": [4, 5]}) + "\n")
    return str(path)


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(capsys, argv, needle):
    code, out, err = run(capsys, argv)
    assert code == 2, (code, err)
    assert out == ""
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert needle in err, err
    assert "Traceback" not in err
    return err


# --- numbers and sizes (items 7 and 9) ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dcp", "1_6"], "argument --dcp: '1_6' is not a decimal integer"),
        (["--dcp", "+16"], "argument --dcp: '+16' is not a decimal integer"),
        (["--dcp", "\u0661\u0666"], "argument --dcp: '\u0661\u0666' is not a decimal integer"),
        (["--dcp", " 2"], "argument --dcp: ' 2' is not a decimal integer"),
        (["--max-model-len", "4e3"], "argument --max-model-len: '4e3' is not a decimal integer"),
        (["--dcp", "9" * 5000], "argument --dcp: 999999999999... (5000 digits) is too large"),
        (["--group", "full_attention:1_6"], "group 'full_attention:1_6': block size '1_6' is not a decimal integer"),
        (["--group", "full_attention:4294967296"],
         "group 'full_attention:4294967296': block size 4294967296 is too large; expected at most 1,073,741,824"),
        (["--group", "full_attention:" + "1" + "0" * 30], "block size 100000000000... (31 digits) is too large"),
        (["--group", "sliding_window:16:replicated:window=99999999999"], "window 99999999999 is too large"),
        (["--group", "full_attention:2097152", "--group", "mamba:16", "--dcp", "1024"],
         "covers 2,147,483,648 tokens per block at dcp 1024; expected at most 1,073,741,824"),
        (["--num-speculative-blocks", "100000000000000000000"],
         "argument --num-speculative-blocks: 100000000000000000000 is too large; expected at most 128"),
        (["--interleave", "2000000000"], "argument --interleave: 2000000000 is too large"),
        (["--hash-block-size", "2000000000"], "argument --hash-block-size: 2000000000 is too large"),
        (["--retention-interval", "99999999999"], "retention interval 99999999999 is too large"),
    ],
)
def test_numbers_are_decimal_and_capped(capsys, argv, needle):
    assert_bad_input(capsys, ["geometry", *argv], needle)


def _numeric_flags():
    """(command, flag, kind) of every flag of every command whose argparse type is one of
    cli/values.py's parsers, found from the parsers themselves (a new flag is covered too)."""
    parser = build_parser()
    found = []
    for command, sub in parser.get_default("command_parsers").items():
        for action in sub._actions:
            kind = getattr(action.type, "__name__", None)
            if kind in ("decimal integer", "decimal number"):
                found.append((command, action.option_strings[-1], kind))
    return found


#: Forms int() or float() take that mean something else than the digits typed (or nothing).
_NOT_DECIMAL = ["\u0661\u0666", "\uff11\uff16", "1_6", "+16", " 16", "16 ", "0x10", "", "1e3"]
_NOT_A_NUMBER = ["\u0661\u0666", "\uff11\uff16", "1_6", "+16", " 16", "1e3", "inf", "nan", "0x10", ""]


def test_every_numeric_flag_of_every_command_goes_through_one_parser():
    """No command parses a number with int() or float() (plan's flags once did)."""
    for command, sub in build_parser().get_default("command_parsers").items():
        for action in sub._actions:
            assert action.type not in (int, float), (command, action.option_strings)
    commands = {c for c, _, _ in _numeric_flags()}
    assert {"geometry", "replay", "e2e", "plan", "prove"} <= commands


@pytest.mark.parametrize("command, flag, kind", _numeric_flags())
def test_numeric_flags_refuse_what_is_not_plain_decimal(capsys, trace, command, flag, kind):
    positional = [trace] if command in ("replay", "e2e") else []
    for text in _NOT_DECIMAL if kind == "decimal integer" else _NOT_A_NUMBER:
        err = assert_bad_input(capsys, [command, *positional, flag, text], f"argument {flag}: {text!r} is not a decimal")
        assert err.startswith(f"kvproof {command}: error: "), err


@pytest.mark.parametrize("argv, needle", [
    (["--dcp", "1,\u0662"], "DCP size '\u0662' is not a decimal integer"),
    (["--dcp", "1,+2"], "DCP size '+2' is not a decimal integer"),
    (["--layers", "1_2,36"], "layer count '1_2' is not a decimal integer"),
    (["--layers", ""], "layer count '' is not a decimal integer"),
    (["--memory-sweep", "1e3"], "memory size '1e3' in --memory-sweep must be a positive decimal number"),
    (["--generate", "--system-prompt-len", "1_0-20"], "system prompt length '1_0-20' must be LO-HI"),
    (["--max-num-batched-tokens", str(10**30)], "argument --max-num-batched-tokens: 100000000000... (31 digits) is too large"),
    (["--max-num-batched-tokens", str(2**31)], "argument --max-num-batched-tokens: 2147483648 is too large; expected at "
                                               "most 1,073,741,824"),
    (["--num-blocks", str(2**31)], "argument --num-blocks: 2147483648 is too large; expected at most 2,147,483,647"),
    (["--jobs", "5000"], "argument --jobs: 5000 is too large; expected at most 1,024"),
])
def test_plans_lists_ranges_and_caps(capsys, argv, needle):
    assert_bad_input(capsys, ["plan", "--no-progress", *argv], needle)


def test_the_largest_block_is_accepted(capsys):
    """2**20 tokens per rank at DCP 1024 is a block of exactly 2**30 tokens: the cap itself."""
    code, out, err = run(capsys, ["geometry", "--group", "full_attention:1048576", "--group", "mamba:16",
                                  "--dcp", "1024", "--json"])
    assert code == 0, err
    assert json.loads(out)["groups"][0]["effective_block_size"] == 1 << 30


def test_leading_zeros_are_decimal(capsys):
    """Decided: ``016`` is sixteen (plain decimal digits), as in a zero-padded script."""
    code, out, _ = run(capsys, ["geometry", *SMALL, "--dcp", "016", "--json"])
    assert code == 0 and json.loads(out)["dcp"] == 16


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--num-blocks", "9223372036854775808"],
         "argument --num-blocks: 9223372036854775808 is too large; expected at most 2,147,483,647 (block ids are int32"),
        (["--num-blocks", "1_000"], "argument --num-blocks: '1_000' is not a decimal integer"),
        (["--max-num-batched-tokens", "99999999999"], "argument --max-num-batched-tokens: 99999999999 is too large"),
    ],
)
def test_replay_pool_and_budget_flags(capsys, trace, argv, needle):
    assert_bad_input(capsys, ["replay", trace, *SMALL, *argv], needle)


def test_replay_pool_larger_than_memory_is_refused_before_allocating(capsys, trace, monkeypatch):
    monkeypatch.setattr(limits, "available_memory", lambda: 1_000_000_000)
    err = assert_bad_input(capsys, ["replay", trace, *SMALL, "--num-blocks", "100000000"],
                           "--num-blocks 100,000,000 needs about 24.0 GB (the block pool), but this machine has 1.0 GB "
                           "available; expected --num-blocks <= 4,166,666")
    assert err.startswith("kvproof replay: error: ")


# --- repeated and mixed flags (item 9) ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--dcp", "2", "--dcp", "4"], "argument --dcp: given twice (2 and 4); expected it once"),
        (["--preset", "kimi-k3", "--preset", "jamba"], "argument --preset: given twice ('kimi-k3' and 'jamba')"),
        (["--max-model-len", "64", "--max-model-len", "64"], "argument --max-model-len: given twice (64 and 64)"),
        (["--preset", "kimi-k3", "--group", "full_attention:16"],
         "--group cannot be combined with --preset kimi-k3: a preset fixes its groups"),
        (["--group", "mla:16:replicated:sharded"], "option 'sharded' in group 'mla:16:replicated:sharded' repeats or contradicts"),
        (["--group", "mla:16:sharded:sharded"], "repeats or contradicts"),
        (["--group", "sliding_window:16:replicated:window=32:window=64"], "option 'window=64'"),
        (["--list-presets", "--group", "x:1"], "--list-presets takes no layout flags (got --group)"),
        (["--list-presets", "--dcp", "2"], "--list-presets takes no layout flags (got --dcp)"),
    ],
)
def test_repeated_and_conflicting_flags(capsys, argv, needle):
    assert_bad_input(capsys, ["geometry", *argv], needle)


def test_a_preset_with_overrides_keeps_its_groups(capsys):
    """Decided: --dcp / --max-model-len override a preset's values; only --group conflicts."""
    code, out, _ = run(capsys, ["geometry", "--preset", "kimi-k3", "--dcp", "4", "--json"])
    data = json.loads(out)
    assert code == 0 and data["dcp"] == 4 and [g["kind"] for g in data["groups"]] == ["mla", "mamba"]


def test_list_presets_alone_and_as_json(capsys):
    code, out, _ = run(capsys, ["geometry", "--list-presets", "--json"])
    assert code == 0 and "kimi-k3" in json.loads(out)


def test_bare_kvproof_is_one_line_naming_the_commands(capsys):
    err = assert_bad_input(capsys, [], "kvproof: error: a command is required; expected one of geometry, replay")
    assert "(see kvproof --help)" in err


def test_help_still_goes_to_stdout_with_status_0(capsys):
    code, out, _ = run(capsys, ["replay", "--help"])
    assert code == 0 and "--num-blocks" in out


# --- traces (item 8) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"id": "a", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
         "t.jsonl: line 1: JSON nested too deeply; expected one flat object per request"),
        (b'{"id": "\\ud800", "prompt": [1]}\n', "t.jsonl: line 1: 'id' '\\ud800' is not valid Unicode (lone surrogate at index 0)"),
        (b'{"id": "a", "prompt": [1], "cache_salt": "x\\udfff"}\n', "line 1 (request 'a'): 'cache_salt' 'x\\udfff' is not valid Unicode"),
        (b'{"id": "a", "prompt": [1]}\n{"id": "b\xff", "prompt": [1]}\n', "t.jsonl: line 2: not valid UTF-8 (byte 0xff at column 10)"),
        (b'{"id": "a", "prompt": [1, 18446744073709551616]}\n',
         "t.jsonl: line 1 (request 'a'): 'prompt' token 18446744073709551616 at index 1 is not a token id; expected an integer with 0 <= id < 2**63"),
        (b'{"id": "a", "prompt": [9223372036854775808]}\n', "'prompt' token 9223372036854775808 at index 0 is not a token id"),
        (b'{"id": "a", "prompt": [1], "output": [2, 1.5]}\n', "line 1 (request 'a'): 'output' token 1.5 at index 1"),
        (b'{"id": "a", "prompt": [1], "arrival": 9223372036854775808}\n', "'arrival' 9223372036854775808 must be a scheduler step"),
        (b'{"id": "a", "prompt": [' + b"1" * 5000 + b"]}\n", "t.jsonl: line 1: an integer of thousands of digits; expected token ids and steps below 2**63"),
        (b'{"id": "a", "id": "b", "prompt": [1]}\n', "t.jsonl: line 1: field 'id' appears twice in one object"),
    ],
)
def test_hostile_traces_name_file_line_and_field(capsys, tmp_path, content, needle):
    path = tmp_path / "t.jsonl"
    path.write_bytes(content)
    for command in ("replay",):  # e2e reads traces with the same reader (tests/e2e/test_e2e_hostile.py)
        err = assert_bad_input(capsys, [command, str(path), *SMALL], needle)
        assert len(err) < 400


def test_the_largest_token_id_is_accepted(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": [2**63 - 1, 0], "output": [2**63 - 1]}) + "\n")
    code, _, err = run(capsys, ["replay", str(path), *SMALL])
    assert code == 0, err


def test_an_id_that_would_break_lines_stays_on_one_line(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a\nb", "prompt": [1]}) + "\n" + json.dumps({"id": "a\nb", "prompt": [2]}) + "\n")
    assert_bad_input(capsys, ["replay", str(path), *SMALL], "duplicate request id 'a\\nb'")


# --- smaller edges -------------------------------------------------------------------------------


def test_ids_a_terminal_would_act_on_are_escaped_in_tables(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a\x1b[2Jb\nc", "prompt": [1]}) + "\n" + json.dumps({"id": "ok", "prompt": [2]}) + "\n")
    code, out, _ = run(capsys, ["replay", str(path), *SMALL])
    assert code == 0 and "\x1b" not in out
    rows = out.splitlines()
    assert rows[1].startswith("'a\\x1b[2Jb\\nc'") and rows[2].startswith("ok ")


@pytest.mark.parametrize("command", ["replay", "e2e", "plan"])
@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_trace_is_bad_input_for_every_command(capsys, tmp_path, command, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    argv = [command, "--trace", str(path), "--no-progress"] if command == "plan" else [command, str(path), *SMALL]
    assert_bad_input(capsys, argv, f"kvproof {command}: error: {path}: the trace holds no request")


@pytest.mark.parametrize("argv", [["geometry", "--nope"], ["replay", "x.jsonl", "extra"], ["--json", "geometry"],
                                  ["prove", "-x"]])
def test_unknown_arguments_are_refused_by_the_commands_own_parser(capsys, argv):
    command = next(a for a in argv if not a.startswith("-"))
    assert_bad_input(capsys, argv, f"kvproof {command}: error: unrecognized arguments: ")
