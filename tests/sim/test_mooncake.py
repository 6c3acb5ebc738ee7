"""The Mooncake trace reader: lazy parsing, the id -> token expansion, and bad lines."""

from __future__ import annotations

import itertools
import json
import pathlib

import pytest

from kvproof.sim.mooncake import (
    MOONCAKE_BLOCK,
    iter_mooncake,
    is_mooncake_record,
    output_tokens,
    prompt_tokens,
    to_trace_request,
)

TRACE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def _write(tmp_path, records) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_shared_ids_give_shared_prefixes_and_a_partial_block_is_a_prefix(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 5, "input_length": 1300, "output_length": 2, "hash_ids": [7, 8, 9]},
        {"timestamp": 9, "input_length": 700, "output_length": 0, "hash_ids": [7, 10]},
    ])
    a, b, c = (prompt_tokens(r) for r in iter_mooncake(path))
    assert (len(a), len(b), len(c)) == (1100, 1300, 700)
    assert b[:1100] == a  # the 76-token tail of id 9 is a prefix of its 276-token tail
    assert c[:MOONCAKE_BLOCK] == a[:MOONCAKE_BLOCK] and c[MOONCAKE_BLOCK] != a[MOONCAKE_BLOCK]


def test_outputs_are_fresh(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": [1]},
        {"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": [1]},
    ])
    r0, r1 = iter_mooncake(path)
    out0, out1 = output_tokens(r0), output_tokens(r1)
    assert len(out0) == 4 and not set(out0) & set(out1)
    assert not set(out0) & set(prompt_tokens(r0))
    t = to_trace_request(r1, arrival=3)
    assert (t.id, t.arrival, t.output) == ("mc1", 3, out1)


def test_parsing_is_lazy_and_limited(tmp_path):
    path = _write(tmp_path, [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}, "not json"])
    assert len(list(iter_mooncake(path, limit=1))) == 1  # the bad second line is never read
    with pytest.raises(ValueError, match=r"t.jsonl: line 2: not valid JSON"):
        list(iter_mooncake(path))


@pytest.mark.parametrize(
    "record, message",
    [
        ({"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}, r"2 hash_ids for input_length 1100; expected 3"),
        ({"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}, r"'timestamp' -1 must be a non-negative integer"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, r"'input_length' 0"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1 << 24, "hash_ids": [1]}, r"'output_length' 16777216 is too large"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [True]}, r"'hash_ids' must be a list of integers"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1], "x": 1}, r"unknown x"),
        ([1, 2], r"expected a JSON object, got list"),
    ],
)
def test_bad_lines_name_the_line_and_field(tmp_path, record, message):
    path = _write(tmp_path, [{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}, record])
    with pytest.raises(ValueError, match=r"line 2: .*" + message):
        list(iter_mooncake(path))


def test_format_detection():
    assert is_mooncake_record({"hash_ids": []}) and not is_mooncake_record({"id": "a", "prompt": [1]})


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read trace"):
        list(iter_mooncake(str(tmp_path / "absent.jsonl")))


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not beside this checkout")
def test_the_real_trace_parses_and_shares_its_first_block():
    first = list(itertools.islice(iter_mooncake(str(TRACE)), 50))
    assert first[0].hash_ids[0] == first[1].hash_ids[0] == 0
    assert all(len(prompt_tokens(r)) == r.input_length for r in first)
