"""``KVPROOF_RECORD``'s recorder (integrations/vllm/trace_recorder.py): Mooncake-format lines of
finished requests whose hash ids follow the prompts' shared prefixes, with no token content."""

from __future__ import annotations

import json
import os
import random
import types

import pytest

from kvproof.integrations.vllm import trace_recorder
from kvproof.integrations.vllm.trace_recorder import BlockIds, TraceRecorder, block_extras, check_path, request_seed
from kvproof.sim.mooncake import MOONCAKE_BLOCK, iter_mooncake, prompt_tokens
from kvproof.sim.workload import read_workload

B = MOONCAKE_BLOCK


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def request(prompt, outputs: int, arrival: float, salt=None, lora=None, mm=()):
    """The attributes of a vLLM ``Request`` the recorder reads."""
    features = [types.SimpleNamespace(identifier=i, mm_position=types.SimpleNamespace(offset=o, length=n))
                for i, o, n in mm]
    return types.SimpleNamespace(prompt_token_ids=list(prompt), prompt_embeds=None, num_output_tokens=outputs,
                                 arrival_time=arrival, cache_salt=salt, lora_request=lora, mm_features=features)


def test_shared_prefixes_share_ids_and_new_blocks_get_the_next_small_int():
    ids = BlockIds()
    system = tokens(2 * B + 100, 1)
    a = ids.hash_ids(system + tokens(B, 2))
    b = ids.hash_ids(system + tokens(B, 3))
    assert a == [0, 1, 2, 3]
    # The two whole system blocks are shared; the third block holds the first difference.
    assert b == [0, 1, 4, 5]
    assert ids.hash_ids(system + tokens(B, 2)) == a  # the same prompt again: the same ids


@pytest.mark.parametrize("position", [0, 5, B - 1, B, 2 * B + 7])
def test_a_different_token_changes_its_block_and_every_later_id(position):
    ids = BlockIds()
    prompt = tokens(4 * B, 4)
    changed = list(prompt)
    changed[position] += 1
    first, second = ids.hash_ids(prompt), ids.hash_ids(changed)
    block = position // B
    assert second[:block] == first[:block]
    # Blocks after the change hold equal tokens, but their prefix differs: every id differs.
    assert all(x != y for x, y in zip(first[block:], second[block:]))
    assert len(set(first) | set(second)) == 4 + 4 - block


def test_the_partial_last_block_is_counted_and_a_longer_prompt_that_extends_it_shares_its_id(tmp_path):
    path = str(tmp_path / "t.jsonl")
    recorder = TraceRecorder(path)
    turn1 = tokens(B + 100, 5)  # one whole block and a 100-token tail
    turn2 = turn1 + tokens(B + 300, 6)  # the next turn: the tail is now the head of a full block
    other = turn1[:B + 50] + tokens(462, 7)  # another full block after the same first one
    for i, prompt in enumerate([turn1, turn2, other, tokens(B, 8), tokens(1, 9)]):
        recorder.finished(request(prompt, 3, 10.0 + i))
    lines = [json.loads(line) for line in open(path)]
    assert [line["input_length"] for line in lines] == [B + 100, 2 * B + 400, 2 * B, B, 1]
    assert [len(line["hash_ids"]) for line in lines] == [2, 3, 2, 1, 1]
    t1, t2, o = (line["hash_ids"] for line in lines[:3])
    assert t2[:2] == t1 and o[0] == t1[0] and o[1] not in t1 + t2
    # kvproof's reader accepts the file, and its expansion gives the next turn the first turn's
    # whole prompt as a prefix -- its tail included.
    a, b, c, _, _ = (prompt_tokens(r) for r in iter_mooncake(path))
    assert b[:len(a)] == a and c[:B] == a[:B] and c[B] != a[B]
    assert len(read_workload(path).entries) == 5


def test_a_partial_block_never_claims_a_full_block_that_does_not_extend_it():
    ids = BlockIds()
    head = tokens(B, 10)
    tail = tokens(200, 11)
    (_, partial) = ids.hash_ids(head + tail)
    (_, unrelated, _) = ids.hash_ids(head + tokens(B, 12) + [1])
    (_, extended, _) = ids.hash_ids(head + tail + tokens(B - 200, 13) + [2])
    assert unrelated != partial and extended == partial
    # The id now names that one full block: a second extension is a new block.
    (_, second, _) = ids.hash_ids(head + tail + tokens(B - 200, 14) + [3])
    assert second not in (partial, unrelated)


def test_a_longer_partial_block_that_extends_a_partial_one_shares_its_id_and_replays_as_its_extension():
    ids = BlockIds()
    head, tail = tokens(B, 15), tokens(300, 16)
    (_, short) = ids.hash_ids(head + tail[:100])
    (_, longer) = ids.hash_ids(head + tail)
    (_, branch) = ids.hash_ids(head + tail[:100] + tokens(200, 17))  # extends the short one, not the longer
    (_, full, _) = ids.hash_ids(head + tail + tokens(B - 300, 18) + [4])
    assert longer == short == full and branch != short


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", range(6))
def test_the_replayed_prompts_share_exactly_the_whole_blocks_the_real_ones_share_and_nothing_false(tmp_path, seed):
    """Chats that extend each other (partial blocks extended by partial and full ones, branches)
    recorded, then expanded as the planner replays them: two expanded prompts never agree
    further than the real ones do, and agree at least on every whole block the real ones share."""
    rng = random.Random(seed)
    path = str(tmp_path / "t.jsonl")
    recorder = TraceRecorder(path)
    real = []
    for i in range(40):
        if real and rng.random() < 0.7:
            base = rng.choice(real)
            base = base[:rng.randrange(1, len(base) + 1)] if rng.random() < 0.3 else base
        else:
            base = tokens(rng.randrange(1, 3 * B), 100 + i)[:rng.randrange(1, 3 * B)]
        prompt = base + [rng.randrange(4) for _ in range(rng.randrange(1, 400))]  # small alphabet: chance agreements
        real.append(prompt)
        recorder.finished(request(prompt, 1, float(i)))
    replayed = [prompt_tokens(r) for r in iter_mooncake(path)]
    assert [len(p) for p in replayed] == [len(p) for p in real]
    for i in range(len(real)):
        for j in range(i):
            true, seen = common_prefix(real[i], real[j]), common_prefix(replayed[i], replayed[j])
            assert seen <= true and seen >= true - true % B, (i, j, true, seen)


def test_the_line_has_the_output_length_and_ms_from_the_first_arrival(tmp_path):
    path = str(tmp_path / "t.jsonl")
    recorder = TraceRecorder(path)
    recorder.arrived(100.0)
    recorder.arrived(100.5)  # only the first arrival is time 0
    recorder.finished(request(tokens(700, 1), 17, 101.25))
    recorder.finished(request(tokens(30, 2), 0, 100.0))  # finished later, arrived first
    lines = [json.loads(line) for line in open(path)]
    assert lines == [{"timestamp": 1250, "input_length": 700, "output_length": 17, "hash_ids": [0, 1]},
                     {"timestamp": 0, "input_length": 30, "output_length": 0, "hash_ids": [2]}]
    assert recorder.written == 2
    # Finish order is not arrival order: the planner's reader sorts by timestamp.
    workload = read_workload(path, step_ms=50)
    assert [(e.arrival, e.prompt_len, e.output_len) for e in workload.entries] == [(0, 30, 0), (25, 700, 17)]


def test_the_file_holds_no_token_content(tmp_path):
    """Two recordings of different token ids with the same sharing structure, under different
    keys, are byte-identical: nothing in the file depends on what the tokens are."""
    rng = random.Random(3)
    system = tokens(3 * B + 11, 20)
    prompts = [system[:rng.randrange(1, len(system))] + tokens(rng.randrange(1, 2 * B), 30 + i) for i in range(12)]
    renamed = {t: t + 1_000_003 for p in prompts for t in p}  # an injective renaming of every token
    files = []
    for k, batch in enumerate([prompts, [[renamed[t] for t in p] for p in prompts]]):
        path = str(tmp_path / f"{k}.jsonl")
        recorder = TraceRecorder(path, key=bytes([k]) * 32)
        for i, prompt in enumerate(batch):
            recorder.finished(request(prompt, i, 5.0 + i))
        files.append(open(path, "rb").read())
    assert files[0] == files[1]
    assert all(set(json.loads(line)) == {"timestamp", "input_length", "output_length", "hash_ids"}
               for line in files[0].decode().splitlines())
    assert len({i for line in files[0].decode().splitlines() for i in json.loads(line)["hash_ids"]}) > 3


def test_salt_adapter_and_multimodal_inputs_separate_equal_tokens():
    ids = BlockIds()
    prompt = tokens(3 * B, 40)
    plain = ids.hash_ids(prompt)
    salted = ids.hash_ids(prompt, request_seed("tenant-a", None))
    adapter = ids.hash_ids(prompt, request_seed(None, ("sql", "/adapters/sql")))
    assert len(set(plain) | set(salted) | set(adapter)) == 9
    assert ids.hash_ids(prompt, request_seed("tenant-a", None)) == salted
    # An image whose placeholder overlaps blocks 1 and 2 changes them, not block 0; another image
    # at the same place changes them differently.
    cat = ids.hash_ids(prompt, extras=block_extras(len(prompt), [("cat", B + 10, B)]))
    dog = ids.hash_ids(prompt, extras=block_extras(len(prompt), [("dog", B + 10, B)]))
    assert cat[0] == dog[0] == plain[0]
    assert len({cat[1], dog[1], plain[1]}) == 3 and len({cat[2], dog[2], plain[2]}) == 3


def test_a_requests_adapter_and_images_reach_its_ids(tmp_path):
    path = str(tmp_path / "t.jsonl")
    recorder = TraceRecorder(path)
    prompt = tokens(2 * B, 41)
    sql = types.SimpleNamespace(lora_name="sql", lora_path="/adapters/sql")
    for req in (request(prompt, 1, 1.0), request(prompt, 1, 2.0, lora=sql),
                request(prompt, 1, 3.0, mm=[("image-1", B + 3, 20)]), request(prompt, 1, 4.0)):
        recorder.finished(req)
    plain, adapter, image, again = (json.loads(line)["hash_ids"] for line in open(path))
    assert again == plain and not set(adapter) & set(plain) and image[0] == plain[0] and image[1] != plain[1]


def test_requests_without_token_ids_are_skipped(tmp_path):
    path = str(tmp_path / "t.jsonl")
    recorder = TraceRecorder(path)
    embeds = request([], 4, 1.0)
    embeds.prompt_token_ids = None
    recorder.finished(embeds)
    recorder.finished(request(tokens(5, 1), 4, 2.0))
    assert recorder.skipped == 1 and recorder.written == 1 and len(open(path).readlines()) == 1


def test_a_short_write_is_cut_back_to_whole_lines_and_stops_the_recording(tmp_path, monkeypatch):
    path = str(tmp_path / "t.jsonl")
    recorder = TraceRecorder(path)
    recorder.finished(request(tokens(600, 1), 2, 1.0))
    real_write = os.write
    monkeypatch.setattr(trace_recorder.os, "write", lambda fd, data: real_write(fd, data[:len(data) // 2]))
    recorder.finished(request(tokens(600, 2), 2, 2.0))  # a full disk: half the line went out
    monkeypatch.setattr(trace_recorder.os, "write", real_write)
    recorder.finished(request(tokens(600, 3), 2, 3.0))
    text = open(path).read()
    assert text.endswith("\n") and len(text.splitlines()) == 1 and recorder.written == 1
    assert "recording stopped after 1 requests: wrote" in recorder.stopped


@pytest.mark.parametrize("make, reason", [
    (lambda d: os.path.join(d, "missing", "t.jsonl"), "does not exist"),
    (lambda d: d, "is a folder"),
    (lambda d: _with(os.path.join(d, "old.jsonl"), "{}\n"), "already holds 3 bytes (an earlier recording?)"),
])
def test_a_bad_path_is_refused_naming_the_value(tmp_path, make, reason):
    path = make(str(tmp_path))
    with pytest.raises(ValueError) as e:
        check_path(path, first=True)
    assert str(e.value).startswith(f"KVPROOF_RECORD={path!r}: ") and reason in str(e.value)


def test_an_unwritable_file_is_refused_and_a_later_process_appends_to_the_first_ones_file(tmp_path):
    path = str(tmp_path / "t.jsonl")
    check_path(path, first=True)
    assert os.path.getsize(path) == 0  # the first process created it
    _with(path, "{}\n")
    check_path(path, first=False)  # the engine core, after the API server: appending is fine
    if os.geteuid() != 0:  # root writes through any mode
        os.chmod(path, 0o444)
        with pytest.raises(ValueError, match="cannot be opened for appending"):
            check_path(path, first=False)
    with pytest.raises(ValueError, match=r"KVPROOF_RECORD='/proc/kvproof-record\.jsonl': cannot be opened"):
        check_path("/proc/kvproof-record.jsonl", first=True)


def _with(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.mark.vllm
def test_a_bad_path_fails_at_register_and_installs_nothing(monkeypatch, tmp_path):
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvproof.integrations.vllm import plugin

    for name in ("KVPROOF_CONTRACTS", "KVPROOF_MANAGER", "KVPROOF_STOP_REPORT"):
        monkeypatch.delenv(name, raising=False)
    bad = str(tmp_path / "no-such-folder" / "trace.jsonl")
    monkeypatch.setenv("KVPROOF_RECORD", bad)
    methods = Scheduler.__init__, Scheduler.add_request, Scheduler._free_request
    with pytest.raises(ValueError, match=f"KVPROOF_RECORD={bad!r}: folder .* does not exist"):
        plugin.register()
    assert (Scheduler.__init__, Scheduler.add_request, Scheduler._free_request) == methods
    assert not plugin.installed() and "KVPROOF_STOP_REPORT" not in os.environ


_OFFLINE = """
import json, os
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm.v1.engine.llm_engine import LLMEngine
from kvproof.integrations.vllm.tiny_model import tiny_model_dir
load_general_plugins()
engine = LLMEngine.from_engine_args(EngineArgs(
    model=tiny_model_dir(), skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=512,
    enable_prefix_caching=True, max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=256,
    distributed_executor_backend="kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor"))
system = [(7 * i) % 1000 for i in range(700)]
requests = {  # id: prompt, max tokens, arrival (s), cache salt
    "a": (system + [1, 2, 3], 5, 1000.0, None), "b": (system + [4, 5], 1, 1000.25, None),
    "salted": (system + [1, 2, 3], 2, 1000.5, "tenant-b"), "aborted": (system + [9] * 100, 60, 1001.0, None),
    "running": ([3] * 900, 500, 1001.5, None),
}
for rid, (prompt, n, arrival, salt) in requests.items():
    engine.add_request(rid, {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})},
                       SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=arrival)
generated, finished = {rid: 0 for rid in requests}, set()
while not {"a", "b", "salted"} <= finished or generated["aborted"] < 3:
    for out in engine.step():
        generated[out.request_id] = len(out.outputs[0].token_ids)
        if out.finished:
            finished.add(out.request_id)
engine.abort_request(["aborted"])
for _ in range(3):
    for out in engine.step():
        generated[out.request_id] = len(out.outputs[0].token_ids)
engine.engine_core.shutdown()
print("REPORT " + json.dumps({"generated": generated, "finished": sorted(finished)}), flush=True)
"""


@pytest.mark.vllm
def test_an_offline_engine_records_finished_and_aborted_requests_not_running_ones(tmp_path):
    """vLLM's real engine (the staging executor, the plugin loaded as vLLM loads it, no checks):
    the real ``Request``'s fields reach the file -- the given arrival times, the tokens
    generated, an aborted request's so far, the cache salt -- and a request still running at
    shutdown has no line."""
    pytest.importorskip("vllm")
    from .test_plugin import _run_fresh

    path = str(tmp_path / "offline.jsonl")
    report = _run_fresh(_OFFLINE, KVPROOF_RECORD=path)
    generated = report["generated"]
    assert {"a", "b", "salted"} <= set(report["finished"]) and "running" not in report["finished"]
    lines = [json.loads(line) for line in open(path)]
    by_length = {(x["input_length"], x["output_length"]): x for x in lines}
    assert sorted(by_length) == sorted([(703, 5), (702, 1), (703, 2), (800, generated["aborted"])])
    assert 3 <= generated["aborted"] < 60
    a, b, salted, aborted = (by_length[k] for k in [(703, 5), (702, 1), (703, 2), (800, generated["aborted"])])
    assert (a["timestamp"], b["timestamp"], salted["timestamp"], aborted["timestamp"]) == (0, 250, 500, 1000)
    assert a["hash_ids"][0] == b["hash_ids"][0] == aborted["hash_ids"][0] and a["hash_ids"][1] != b["hash_ids"][1]
    assert not set(salted["hash_ids"]) & set(a["hash_ids"] + b["hash_ids"] + aborted["hash_ids"])


_DATA_PARALLEL = """
import json
from types import SimpleNamespace
from vllm.plugins import load_general_plugins
from vllm.v1.core.sched.scheduler import Scheduler
load_general_plugins()
try:
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2))
    Scheduler.__init__(object.__new__(Scheduler), config)
    error = None
except ValueError as e:
    error = str(e)
print("REPORT " + json.dumps({"error": error}), flush=True)
"""


@pytest.mark.vllm
def test_a_data_parallel_engine_is_refused_at_scheduler_construction(tmp_path):
    pytest.importorskip("vllm")
    from .test_plugin import _run_fresh

    report = _run_fresh(_DATA_PARALLEL, KVPROOF_RECORD=str(tmp_path / "t.jsonl"))
    expected = ("KVPROOF_RECORD records one engine, not 2 data-parallel ones: serve with --data-parallel-size 1, "
                "or unset KVPROOF_RECORD")
    assert report["error"] == expected
    assert report["status"] == 1 and report["last"] == "kvproof: " + expected  # the stop report's last line
