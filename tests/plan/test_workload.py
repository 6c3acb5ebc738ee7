"""Workloads: format detection per file, lazy building equal to the eager readers, one pass over
any readable stream (pipes, FIFOs, gzip), the step-time model, the generator, and malformed input
named by file, line and field."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest

from kvproof.sim.mooncake import iter_mooncake, to_trace_request
from kvproof.sim.trace import read_trace
from kvproof.sim.workload import GeneratorSpec, generate, read_workload


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return str(path)


def mooncake(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


@pytest.fixture
def mc(tmp_path):
    return write(tmp_path, "mc.jsonl", [
        mooncake(0, 600, 3, [1, 2]), mooncake(120, 1100, 2, [1, 2, 3]), mooncake(99, 300, 1, [7]), mooncake(480, 512, 0, [1]),
    ])


@pytest.fixture
def kv(tmp_path):
    return write(tmp_path, "kv.jsonl", [
        {"id": "b", "prompt": [1, 2, 3], "output": [9], "arrival": 4},
        "",
        {"id": "a", "prompt": [1, 2], "arrival": 0},
        {"id": "c", "prompt": [5], "output": [6, 7], "arrival": 4},
    ])


def test_format_is_detected_per_file(mc, kv):
    assert "(Mooncake format, 4 requests" in read_workload(mc).description
    assert "(kvproof format, 3 requests)" in read_workload(kv).description


@pytest.mark.parametrize("fmt", ["mc", "kv"])
def test_a_fifo_and_a_gzip_stream_read_once_as_the_file(request, tmp_path, fmt):
    """Read once, front to back: a FIFO (no seek, no second pass) and a gzip stream through a
    FIFO give the requests of the plain file; the file's later fate does not matter."""
    path = request.getfixturevalue(fmt)
    expected = list(read_workload(path).requests())
    with open(path, "rb") as f:
        data = f.read()
    for name, payload in (("plain", data), ("gz", gzip.compress(data))):
        fifo = str(tmp_path / f"{fmt}-{name}.fifo")
        os.mkfifo(fifo)
        writer = threading.Thread(target=lambda: open(fifo, "wb").write(payload))  # noqa: SIM115 (closed on exit)
        writer.start()
        w = read_workload(fifo)
        writer.join()
        assert list(w.requests()) == expected, name
    gz = tmp_path / f"{fmt}.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    w = read_workload(str(gz))
    gz.write_bytes(b"")  # truncated after reading: the replay builds from what was read
    assert list(w.requests()) == expected


def test_a_damaged_gzip_stream_names_the_file(tmp_path, kv):
    with open(kv, "rb") as f:
        packed = gzip.compress(f.read() * 50)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: the gzip stream is damaged or cut short"):
        read_workload(str(cut))


def test_kvproof_trace_builds_the_parsed_requests_in_arrival_order(kv):
    w = read_workload(kv, step_ms=7.0)  # arrival steps are taken as they are
    expected = sorted(read_trace(kv), key=lambda t: t.arrival)
    assert list(w.requests()) == expected
    assert [t.id for t in w.requests()] == ["a", "b", "c"]  # equal arrivals keep file order
    assert w.prompt_tokens == 6 and w.longest_request == 3  # b: 3 prompt + 1 output - 1
    assert [t.id for t in read_workload(kv, limit=2).requests()] == ["a", "b"]


@pytest.mark.parametrize("step_ms, arrivals", [(50.0, [0, 1, 2, 9]), (100.0, [0, 0, 1, 4]), (1.0, [0, 99, 120, 480])])
def test_mooncake_arrivals_follow_the_step_time_model(mc, step_ms, arrivals):
    w = read_workload(mc, step_ms=step_ms)
    got = list(w.requests())
    assert [t.arrival for t in got] == arrivals
    by_id = {t.id: t for t in got}
    for r in iter_mooncake(mc):
        t = to_trace_request(r, 0)
        assert (by_id[t.id].prompt, by_id[t.id].output) == (t.prompt, t.output)


def test_generator_is_deterministic_and_shares_what_it_promises():
    spec = GeneratorSpec(requests=60, system_prompts=2, system_prompt_len=(30, 40), suffix_len=(5, 9),
                         continuation=0.6, output_len=(2, 4), rate=10.0, seed=3)
    a, b = list(generate(spec).requests()), list(generate(spec).requests())
    assert a == b and len(a) == 60
    assert list(generate(GeneratorSpec(**{**spec.__dict__, "seed": 4})).requests()) != a
    history = []
    continued = 0
    for t in a:
        assert 2 <= len(t.output) <= 4
        earlier = [h for h in history if t.prompt[:len(h)] == h and len(h) < len(t.prompt)]
        continued += bool(earlier)
        history.append(t.prompt + t.output)
    assert 15 <= continued <= 50  # about 60 % continue an earlier prompt + answer
    heads = {t.prompt[:30] for t in a}
    assert 2 <= len(heads)  # system prompts are shared


def test_generator_respects_max_tokens():
    spec = GeneratorSpec(requests=200, system_prompts=1, system_prompt_len=(50, 50), suffix_len=(50, 50),
                         continuation=1.0, output_len=(50, 50), seed=1)
    assert max(len(t.prompt) + len(t.output) - 1 for t in generate(spec, max_tokens=600).requests()) <= 600
    with pytest.raises(ValueError, match="needs 149 tokens > max_model_len 100"):
        generate(spec, max_tokens=100)


@pytest.mark.parametrize("field, value, message", [
    ("requests", 0, "requests 0 must be an integer in"),
    ("continuation", 1.5, "continuation probability 1.5 must be in"),
    ("suffix_len", (9, 3), "suffix length upper bound 3 must be an integer in \\[9,"),
    ("rate", float("inf"), "arrival rate inf"),
])
def test_generator_names_a_bad_parameter(field, value, message):
    with pytest.raises(ValueError, match=message):
        generate(GeneratorSpec(**{field: value}))


@pytest.mark.parametrize("lines, message", [
    ([mooncake(0, 600, 3, [1, 2]), "{not json"], "line 2: not valid JSON"),
    ([mooncake(0, 600, 3, [1, 2]), mooncake(5, 600, 3, [1])], "line 2: 1 hash_ids for input_length 600"),
    ([mooncake(0, 600, 3, [1, 2]), {"timestamp": -1, "input_length": 1, "output_length": 0, "hash_ids": [1]}], "line 2: 'timestamp' -1"),
    ([{"id": "a", "prompt": [1]}, {"id": "a", "prompt": [2]}], "line 2: duplicate request id 'a'"),
    ([{"id": "a", "prompt": [1]}, {"id": "b", "prompt": []}], "line 2 .*'prompt' must hold at least one token"),
    (["", ""], "holds no request"),
    ([mooncake(0, 600, 3, [1, 2]), '{"timestamp": 1' + "0" * 400 + ', "input_length": 3, "output_length": 1, "hash_ids": [1]}'],
     r"line 2: 'timestamp' 1000000000000000000000000000000000000\.\.\. is too large; expected at most "
     r"9,223,372,036,854,775,807"),
    (['{"timestamp": 0, "timestamp": 5, "input_length": 3, "output_length": 1, "hash_ids": [1]}'],
     "line 1: field 'timestamp' appears twice in one object"),
    (['{"id": "a", "prompt": [' + "7" * 5000 + "]}"], "line 1: an integer of thousands of digits"),
    (['{"timestamp": ' + "7" * 5000 + ', "input_length": 3, "output_length": 1, "hash_ids": [1]}'],
     "line 1: an integer of thousands of digits"),
])
def test_malformed_traces_name_file_and_line(tmp_path, lines, message):
    path = write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message) as e:
        read_workload(path)
    assert str(e.value).startswith(path)


def test_unreadable_and_undecodable_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read trace '.*missing.jsonl': No such file"):
        read_workload(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bytes.jsonl"
    bad.write_bytes(b'{"id": "a", "prompt": [1]}\n{"id": "\xff"}\n')
    with pytest.raises(ValueError, match=r"line 2: not valid UTF-8 \(byte 0xff at column 9\)"):
        read_workload(str(bad))
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match="line 1: .*nested too deeply"):
        read_workload(str(deep))


@pytest.mark.parametrize("step_ms", [0.0, -1.0, float("nan"), 1e9])
def test_bad_step_time(mc, step_ms):
    with pytest.raises(ValueError, match="step time .* ms must be a number"):
        read_workload(mc, step_ms=step_ms)
