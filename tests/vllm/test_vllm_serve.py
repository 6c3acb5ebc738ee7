"""A real ``vllm serve`` subprocess on 127.0.0.1 with kvproof's checks (the plugin, no
``--scheduler-cls``) and the model-free CPU staging executor, TP = DCP = 2 and 4.

Hundreds of completions over HTTP from multi-turn chats sharing system prompts: first one at a
time (so their hits can be compared), then a concurrent burst. Zero violations (the plugin logs
and counts them, and the counters reach ``/metrics`` from the engine core); every request's
cached tokens (from the usage reply) equal vLLM's own Scheduler on the same trace (the engine
harness), and equal kvproof's replay or differ by a named rule; the server shuts down cleanly
and leaves no process behind. The metrics directory is reused from an earlier run: /metrics
starts from zero all the same."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
pytest.importorskip("psutil")

from kvproof.integrations.vllm.engine_harness import EngineHarness, StepHook  # noqa: E402
from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager  # noqa: E402
from kvproof.cli.main import main  # noqa: E402
from kvproof.integrations.vllm.tiny_model import ATTENTION_ONLY  # noqa: E402
from kvproof.planner.reuse import reusable_fraction, workload_reuse  # noqa: E402
from kvproof.sim.mooncake import MOONCAKE_BLOCK  # noqa: E402
from kvproof.sim.replay import replay  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.sim.workload import read_workload  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from .serving import BLOCK, BUDGET, MAX_LEN, MAX_SEQS, NUM_BLOCKS, Server  # noqa: E402


def chats(seed: int, num_chats: int, turns: int, systems: int = 3, system_len: tuple[int, int] = (60, 300)):
    """Chats over a few shared system prompts (``system_len``: their length range); a turn's
    prompt is the previous prompt, its output and new user tokens (the outputs come from the
    server)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(*system_len))] for _ in range(systems)]
    for c in range(num_chats):
        history = list(prompts[c % systems])
        for t in range(turns):
            history += [rng.randrange(1000) for _ in range(rng.randrange(3, 80))]
            output = yield f"c{c}t{t}", tuple(history), rng.randrange(1, 5)
            history += output


class Junctions(StepHook):
    """Where vLLM ended each request's first chunk and the junction it stopped for."""

    def __init__(self):
        self.first_chunk_end, self.junction = {}, {}

    def scheduled(self, harness, step, output):
        for new in output.scheduled_new_reqs:
            rid = new.req_id
            if rid not in self.first_chunk_end:
                self.first_chunk_end[rid] = new.num_computed_tokens + output.num_scheduled_tokens[rid]
                self.junction[rid] = harness.scheduler.requests[rid].shared_prefix_boundary


def name_difference(rid, vllm_hit, ours, trace, junctions, layout):
    """The rule behind vLLM caching more than kvproof for ``rid``, or None. Two are known:

    * vLLM's hit is the state of an earlier request whose first chunk vLLM stopped at its
      shared-prefix junction (block-floored): a checkpoint kvproof does not take yet;
    * vLLM's hit is an earlier request's prompt-tail partial key, which vLLM keeps as an alias
      after the block fills up (docs/vllm-semantics.md §10.2) and kvproof retires
      (docs/coordinator.md).
    """
    index = [t.id for t in trace].index(rid)
    prompt = trace[index].prompt
    mamba_block, hash_block_size = layout.groups[0].group.block_size, layout.hash_block_size
    for other in trace[:index]:
        j = junctions.junction.get(other.id, 0)
        if j and junctions.first_chunk_end.get(other.id) == vllm_hit == j - j % mamba_block:
            return f"{rid}: vLLM {vllm_hit}, kvproof {ours} -- vLLM checkpointed {other.id}'s shared-prefix junction"
    for other in trace[:index]:
        tail = (len(other.prompt) - 1) // hash_block_size * hash_block_size
        if tail == vllm_hit and other.prompt[:tail] == prompt[:tail]:
            return (f"{rid}: vLLM {vllm_hit}, kvproof {ours} -- vLLM hit {other.id}'s prompt-tail key, kept as an "
                    "alias after its block filled")
    return None


def previous_run(metrics_dir: str) -> str:
    """A PROMETHEUS_MULTIPROC_DIR reused from an earlier run: a process that counted 7 kvproof
    violations there and ended. Returns the file it left."""
    before = set(os.listdir(metrics_dir))
    subprocess.run([sys.executable, "-c", "from prometheus_client import Counter; Counter('kvproof_violations', 'x', "
                    "['invariant']).labels(invariant='INV-FROM-AN-EARLIER-RUN').inc(7)"],
                   env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}, check=True, timeout=120)
    (left,) = set(os.listdir(metrics_dir)) - before
    return left


def serve_chats(server: Server, conversation):
    """Send ``conversation`` (:func:`chats`) one request at a time, each done before the next,
    then its last 64 prompts again (with their outputs) as a concurrent burst. Returns the trace
    of the sequential requests, their usage replies by id, and the burst's usage replies."""
    trace, usage = [], {}
    step = conversation.send(None)
    while True:  # one request at a time
        rid, prompt, max_tokens = step
        reply = server.complete(prompt, max_tokens)
        output = tuple(reply["choices"][0]["token_ids"])
        usage[rid] = reply["usage"]
        trace.append(TraceRequest(rid, prompt, output, 1 + 40 * len(trace)))  # each done before the next
        try:
            step = conversation.send(output)
        except StopIteration:
            break
    burst = [t for t in trace[-64:]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the same prompts again, overlapping
        replies = list(pool.map(lambda t: server.complete(t.prompt + t.output, 2), burst))
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    return trace, usage, [r["usage"] for r in replies]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


#: The hash unit of the async-scheduling run (``--prefix-match-unit``).
ASYNC_UNIT = 4


def model_layout(dcp: int, hash_block_size=None):
    """The tiny model's layout as the server builds it (vLLM's Mamba group comes first for this
    model, as the server's log shows)."""
    return resolve_layout(LayoutConfig((CacheGroup(GroupKind.MAMBA, BLOCK), CacheGroup(GroupKind.FULL_ATTENTION, BLOCK)),
                                       dcp=dcp, max_model_len=MAX_LEN, hash_block_size=hash_block_size))


def metric(metrics: str, name: str) -> float:
    """The sum of a counter's samples in a /metrics text (0 if absent)."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))


@pytest.mark.parametrize("dcp, num_chats, turns", [(2, 40, 5), (4, 12, 5)])
def test_vllm_serve_with_checks(dcp, num_chats, turns, tmp_path):
    metrics_dir = str(tmp_path / "prometheus")
    os.mkdir(metrics_dir)
    stale = previous_run(metrics_dir)
    server = Server(dcp, metrics_dir=metrics_dir)
    try:
        server.wait_until_up()
        # The reused directory starts from zero: the earlier run's file is gone, its count with it.
        assert stale not in os.listdir(metrics_dir)
        assert "INV-FROM-AN-EARLIER-RUN" not in server.metrics()
        trace, usage, _ = serve_chats(server, chats(dcp, num_chats, turns))
        served = {rid: cached(u) for rid, u in usage.items()}
        metrics = server.metrics()
    finally:
        code, left = server.stop()
    assert code == 0 and left == []
    # The checks ran inside the engine core and found nothing.
    assert metric(metrics, "kvproof_checked_steps_total") > len(trace)
    assert "kvproof_violations_total{" not in metrics

    layout = model_layout(dcp)
    junctions = Junctions()
    harness = EngineHarness(layout, NUM_BLOCKS, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, hooks=[junctions])
    assert harness.run(trace).num_cached_tokens == served
    assert sum(served.values()) > 0

    ours = replay(trace, layout, NUM_BLOCKS, BUDGET)
    assert ours.violations == []
    mine = {r.request_id: r.num_cached_tokens for r in ours.requests}
    behind = [rid for rid in served if mine[rid] < served[rid]]
    named = [name_difference(rid, served[rid], mine[rid], trace, junctions, layout) for rid in behind]
    print(f"\nDCP {dcp}: {len(trace)} requests, vLLM cached {sum(served.values())} tokens, kvproof "
          f"{sum(mine.values())}; kvproof behind on {len(behind)}, ahead on {sum(mine[r] > served[r] for r in served)}")
    for line in named:
        print("  " + str(line))
    assert None not in named, [rid for rid, n in zip(behind, named) if n is None]


@pytest.mark.parametrize("dcp, num_chats, turns, scheduling",
                         [(2, 40, 5, "sync"), (4, 12, 5, "sync"), (2, 40, 5, "async")])
def test_vllm_serve_with_kvproofs_manager(dcp, num_chats, turns, scheduling):
    """The same conversations served with kvproof's manager (``KVPROOF_MANAGER=kvproof``,
    kvproof's rules) and the cheap checks. Stock vLLM's cached tokens come from vLLM's real
    Scheduler and manager on the same trace (the engine harness, which
    ``test_vllm_serve_with_checks`` shows equal to a served stock server). None may cache
    fewer tokens than with vLLM's manager (a same-step sharer of another's prefix waits a step:
    docs/vllm.md, "Serving with kvproof's manager"). ``async``: with ``--async-scheduling`` (GPU
    runs' default; the staging executor keeps it on a CPU) and a 4-token hash unit, so Mamba
    states sit inside blocks and the step after one often overwrites its block before the key;
    stock is vLLM's AsyncScheduler in the harness."""
    args = ("--async-scheduling", "--prefix-match-unit", str(ASYNC_UNIT)) if scheduling == "async" else ()
    server = Server(dcp, env={"KVPROOF_MANAGER": "kvproof"}, args=args)
    try:
        server.wait_until_up()
        trace, usage, burst = serve_chats(server, chats(dcp, num_chats, turns))
        metrics = server.metrics()
    finally:
        code, left = server.stop()
    output = server.final_output
    assert code == 0 and left == []
    scheduler = "AsyncScheduler" if scheduling == "async" else "Scheduler"
    assert f"kvproof's KV-cache manager serves this engine's {scheduler} (" in output, output[-4000:]
    # Nothing failed while serving. (At SIGTERM vLLM 0.33.0 stops its engine core with timeout 0
    # and force-kills it; its API server's output handler may then log EngineDeadError.)
    serving = output.partition("[shutdown] API server: shutdown triggered")[0]
    assert " ERROR " not in serving and "INV-" not in output, output[-4000:]
    # No leak at exit but nanobind's report of Triton's bindings, which the API server prints at
    # interpreter exit with kvproof inert too (vLLM imports Triton on a CPU as well).
    leaks = [line for line in output.splitlines() if "leak" in line.lower()]
    assert all(line.startswith(("nanobind: ", " - leaked ", "See https://nanobind")) for line in leaks), leaks[:8]
    assert "kvproof_violations_total{" not in metrics
    # The content oracle checked the reads of every token the forward pass computed, on every
    # rank: each request's uncached prompt tokens and every output token but the last (the last
    # is sampled, never fed back), nothing recomputed.
    replies = [*usage.values(), *burst]
    assert metric(metrics, "vllm:num_preemptions_total") == 0
    assert metric(metrics, "kvproof_content_checked_tokens_total") == sum(
        u["prompt_tokens"] - cached(u) + u["completion_tokens"] - 1 for u in replies)

    served = {rid: cached(u) for rid, u in usage.items()}
    layout = model_layout(dcp, ASYNC_UNIT if scheduling == "async" else None)
    harness = EngineHarness(layout, NUM_BLOCKS, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                            async_scheduling=scheduling == "async")
    stock = harness.run(trace).num_cached_tokens
    behind = {rid: (served[rid], stock[rid]) for rid in served if served[rid] < stock[rid]}
    ahead = sum(served[rid] > stock[rid] for rid in served)
    print(f"\nDCP {dcp}, {scheduling}, kvproof's manager: {len(trace)} sequential requests cached {sum(served.values())} tokens, "
          f"stock vLLM {sum(stock.values())}; ahead on {ahead}, behind on {len(behind)}; burst of {len(burst)} "
          f"cached {sum(map(cached, burst))}; the oracle checked "
          f"{metric(metrics, 'kvproof_content_checked_tokens_total'):.0f} tokens")
    assert behind == {}
    assert sum(served.values()) > 0


#: MTP speculative decoding with no draft model loaded (the staging executor drafts): with
#: vLLM's default lookahead block hashes, or with them off, so that vLLM drops the last hash unit
#: of every hit (EAGLE/MTP's block drop).
def speculative(lookahead: bool) -> tuple[str, str]:
    config = {"method": "mtp", "num_speculative_tokens": 2}
    if not lookahead:
        config["disable_lookahead_block_hashes"] = True
    return "--speculative-config", json.dumps(config)


@pytest.mark.parametrize("lookahead", [False, True], ids=["block drop", "lookahead hashes"])
def test_vllm_serve_speculative_with_kvproofs_manager(lookahead):
    """MTP drafts (the staging executor proposes them and rejects some by a fixed rule), TP = DCP
    = 2, full attention only (kvproof's manager refuses drafts over Mamba groups): the same
    conversations served with vLLM's manager and with kvproof's. Every read of the forward pass,
    drafts included, is checked by the content oracle (a rejected draft's KV is another prefix's);
    kvproof's manager caches per request exactly what vLLM's does, which is one hash unit short
    of kvproof's own hit without drafts (vLLM's real Scheduler on the same trace): the dropped
    unit where vLLM drops it. With lookahead hashes (vLLM's default) the same, minus the drop."""
    dcp, results = 2, {}
    for manager in ("vllm", "kvproof"):
        server = Server(dcp, env={"KVPROOF_MANAGER": manager}, model=ATTENTION_ONLY, args=speculative(lookahead))
        try:
            server.wait_until_up()
            trace, usage, burst = serve_chats(server, chats(dcp, 12, 5))
            metrics = server.metrics()
        finally:
            code, left = server.stop()
        assert code == 0 and left == [], server.final_output[-4000:]
        results[manager] = trace, usage, burst, metrics
    trace, usage, burst, metrics = results["kvproof"]
    assert results["vllm"][0] == trace  # the same outputs: drafts never change what is sampled
    assert "kvproof_violations_total{" not in metrics
    drafts = metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafts  # drafts were proposed, some accepted, some rejected
    # The oracle checked every scheduled token: each computed one, and the rejected drafts.
    computed = sum(u["prompt_tokens"] - cached(u) + u["completion_tokens"] - 1 for u in [*usage.values(), *burst])
    checked = metric(metrics, "kvproof_content_checked_tokens_total")
    assert computed + drafts - accepted <= checked <= computed + drafts

    served = {rid: cached(u) for rid, u in usage.items()}
    stock = {rid: cached(u) for rid, u in results["vllm"][1].items()}
    assert served == stock and sum(served.values()) > 0
    if lookahead:
        print(f"\nDCP {dcp}, MTP drafts, lookahead hashes: {len(trace)} sequential requests, {drafts:.0f} drafts, "
              f"{accepted:.0f} accepted; cached {sum(served.values())} tokens with either manager; "
              f"the oracle checked {checked:.0f} tokens")
        return
    layout = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, BLOCK),), dcp=dcp, max_model_len=MAX_LEN))
    without_drafts = EngineHarness(layout, NUM_BLOCKS, max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS,
                                   manager_class=KvproofKVCacheManager).run(trace).num_cached_tokens
    unit = layout.hash_block_size
    assert served == {rid: max(hit - unit, 0) for rid, hit in without_drafts.items()}
    assert sum(served.values()) > 0
    print(f"\nDCP {dcp}, MTP drafts: {len(trace)} sequential requests, {drafts:.0f} drafts, {accepted:.0f} accepted; "
          f"cached {sum(served.values())} tokens with either manager ({sum(without_drafts.values())} without drafts); "
          f"the oracle checked {checked:.0f} tokens; vLLM's manager under kvproof's checks: "
          f"{metric(results['vllm'][3], 'kvproof_violations_total'):.0f} violations")


@pytest.mark.parametrize("manager", ["vllm", "kvproof"])
def test_a_recorded_trace_of_served_chats_plans_their_reuse(manager, tmp_path):
    """``KVPROOF_RECORD``: multi-turn chats over system prompts of one to three Mooncake blocks,
    served (one at a time, then a concurrent burst), recorded, and planned on. The file has one
    line per finished request with the usage replies' lengths; two requests' ids agree on a
    whole block exactly when their prompts agree up to its end, and a chat's next turn carries
    the previous turn's ids. ``kvproof plan --trace FILE`` then replays the sequential requests:
    its ceiling at 512-token units equals the one computed from the served token ids (prompt
    reuse in whole blocks is recorded exactly), at the planner's hash unit it lies between that
    and the token ids' own, and its replay hits."""
    path = str(tmp_path / "served.jsonl")
    server = Server(2, env={"KVPROOF_MANAGER": manager, "KVPROOF_RECORD": path})
    try:
        server.wait_until_up()
        assert os.path.getsize(path) == 0  # created at start, empty until a request finishes
        trace, usage, burst = serve_chats(server, chats(7, 6, 4, system_len=(600, 1400)))
    finally:
        code, left = server.stop()
    assert code == 0 and left == [], server.final_output[-4000:]
    assert "kvproof records this engine's finished requests" in server.final_output

    text = open(path).read()
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]
    assert len(lines) == len(trace) + len(burst)
    # The sequential requests finished first, in order; the burst's lines in any order.
    sequential, rest = lines[:len(trace)], lines[len(trace):]
    assert [(x["input_length"], x["output_length"]) for x in sequential] == [
        (usage[t.id]["prompt_tokens"], usage[t.id]["completion_tokens"]) for t in trace]
    assert [len(t.prompt) for t in trace] == [x["input_length"] for x in sequential]
    assert sorted((x["input_length"], x["output_length"]) for x in rest) == sorted(
        (u["prompt_tokens"], u["completion_tokens"]) for u in burst)
    stamps = [x["timestamp"] for x in sequential]
    assert stamps[0] == 0 and stamps == sorted(stamps) and stamps[-1] > 0
    B = MOONCAKE_BLOCK
    for i, (a, x) in enumerate(zip(trace, sequential)):
        for b, y in zip(trace[:i], sequential[:i]):
            for k in range(min(len(a.prompt), len(b.prompt)) // B):
                assert (x["hash_ids"][k] == y["hash_ids"][k]) == (a.prompt[:B * (k + 1)] == b.prompt[:B * (k + 1)])
    turns = {}  # chat -> its turns' lines, in order
    for t, x in zip(trace, sequential):
        turns.setdefault(t.id.partition("t")[0], []).append(x["hash_ids"])
    assert all(later[:len(earlier)] == earlier for ids in turns.values() for earlier, later in zip(ids, ids[1:]))
    assert len({ids[0][0] for ids in turns.values()}) == 3  # six chats over three system prompts of 600+ tokens

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(["plan", "--trace", path, "--limit", str(len(trace)), "--json", "--no-progress", "--jobs", "1",
                       "--group", f"mamba:{BLOCK}", "--group", f"full_attention:{BLOCK}", "--dcp", "2",
                       "--max-model-len", str(MAX_LEN), "--num-blocks", str(NUM_BLOCKS),
                       "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", str(MAX_SEQS)])
    assert status == 0
    plan = json.loads(buf.getvalue())
    assert plan["workload"]["requests"] == len(trace) and "Mooncake format" in plan["workload"]["description"]
    (config,) = plan["configs"]
    unit = config["hash_block_size"]
    prompts = [TraceRequest(t.id, t.prompt, (), t.arrival) for t in trace]  # Mooncake replies are fresh tokens
    truth = reusable_fraction(prompts, (B, unit)).fractions
    recorded = workload_reuse(read_workload(path, limit=len(trace)), (B, unit)).fractions
    assert recorded[B] == pytest.approx(truth[B]) and truth[B] > 0.3
    assert plan["reuse_bound"][str(unit)] == pytest.approx(recorded[unit], abs=1e-6)
    assert recorded[B] <= recorded[unit] <= truth[unit]
    assert 0 < config["hit_rate"] <= plan["reuse_bound"][str(unit)]
    served = sum(cached(usage[t.id]) for t in trace) / sum(len(t.prompt) for t in trace)
    print(f"\n{manager}'s manager: {len(lines)} requests recorded; ceiling from the file {recorded[unit]:.1%} "
          f"(token ids: {truth[unit]:.1%}; whole blocks {truth[B]:.1%} both), planned hit rate "
          f"{config['hit_rate']:.1%}, served {served:.1%}")
